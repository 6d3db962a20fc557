# Two fresh-machine entry points: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvfsm-installed
SPEC := spec/decode_offload.yaml

.PHONY: demo test venv bench clean

venv: $(STAMP)

# torch is pinned to the CPU build first so the range in pyproject.toml installs nothing bigger.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvfsm demo

test: $(STAMP)
	$(BIN)/kvfsm gen $(SPEC) --check
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/kvfsm bench

clean:
	rm -rf $(VENV) build *.egg-info
