# Two fresh-machine entry points: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvfsm-installed
TEST_STAMP := $(VENV)/.kvfsm-test-installed
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

.PHONY: demo test venv test-deps bench clean mutate

venv: $(STAMP)

# torch is pinned to the CPU build first so the range in pyproject.toml installs nothing bigger.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,bench]'
	touch $(STAMP)

# Every test also runs the optional integrations for real: a Mooncake master (needs Debian's libibverbs1)
# and transformers' continuous batching.
$(TEST_STAMP): $(STAMP)
	dpkg -s libibverbs1 >/dev/null 2>&1 || { $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; }
	$(BIN)/python -m pip install -q -e '.[dev,bench,mooncake,transformers,mutation]'
	touch $(TEST_STAMP)

test-deps: $(TEST_STAMP)

demo: $(STAMP)
	$(BIN)/kvfsm demo

test: $(TEST_STAMP)
	for spec in spec/*.yaml; do $(BIN)/kvfsm gen $$spec --check || exit 1; done
	$(BIN)/kvfsm schema --check
	KVFSM_REQUIRE_MOONCAKE=1 KVFSM_REQUIRE_TRANSFORMERS=1 KVFSM_REQUIRE_MUTMUT=1 $(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/kvfsm bench

# Mutation testing (docs/mutation.md): every mutant of the runtime, the data plane and the generated machine
# against the fast test subset, then docs/mutation.md and tests/mutation/survivors.json. About an hour on 2 cores.
MUTATE_CHILDREN ?= 2

mutate: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,bench,mutation]'
	$(BIN)/python tests/mutation/mutate.py run --max-children $(MUTATE_CHILDREN)

clean:
	rm -rf $(VENV) build *.egg-info
