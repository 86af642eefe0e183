#!/usr/bin/env bash
# The GPU check on a machine with no package index: install the wheels carried in .gpu/wheels and
# pdserve itself into /tmp/site, then run `pdserve bench gpu`. From the checkout's root:
#     bash benchmarks/gpu_check.sh OUT_DIR [pdserve bench gpu flags...]
# Prepare .gpu/ first on a machine with pip access: `make gpu-bundle`.
set -euo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [flags]}
shift
site=/tmp/pdserve-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .gpu/wheels/*.whl
# pdserve's own wheel, built here offline (setuptools and wheel are on the image).
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" .
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
model=()
if [ -f .gpu/model.gguf ]; then
    model=(--model-path .gpu/model.gguf)
elif ls .gpu/model.part-* >/dev/null 2>&1; then
    cat .gpu/model.part-* > /tmp/pdserve-model.gguf
    model=(--model-path /tmp/pdserve-model.gguf)
fi
mkdir -p "$out"
set +e
python3 -P -m pdserve.cli bench gpu --out "$out" "${model[@]}" "$@" 2>&1 | tee "$out/run.log"
status=${PIPESTATUS[0]}
tar -czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$out/logs"
exit "$status"
