# Two fresh-machine entry points: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvfsm-installed
TEST_STAMP := $(VENV)/.kvfsm-test-installed
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
# `make test` builds the main venv and sglang's side by side (a core each). The steps that touch what the two
# share, apt's database and the checkout's kvfsm.egg-info that an editable install writes, run one at a time
# under a lock on pyproject.toml.
ONE_AT_A_TIME := $(shell command -v flock >/dev/null 2>&1 && echo flock pyproject.toml)
APT_INSTALL = $(ONE_AT_A_TIME) $(SUDO) env DEBIAN_FRONTEND=noninteractive sh -c \
	'apt-get update -qq >/dev/null && apt-get install -y -qq $(1) >/dev/null'
# the main suite on every core, a module at a time, in the order tests/conftest.py puts them (the long first). One worker
# more than the cores was tried on the 2-core CI machine: a fresh clone's `make test` took 720 and 750 s with 3 workers,
# 745 s with 2 (2026-12-06), within the spread of runs, so not kept.
TEST_WORKERS ?= auto
PYTEST_PARALLEL = -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
# pip compiles nothing at install; a module is compiled when it is first imported, and its bytecode kept then, so
# PYTHONDONTWRITEBYTECODE is lifted for everything this Makefile runs. Compiling all of torch at install took 35 s
# of a venv's 82 s on the 2-core CI machine, against 2 s for the part of it an import reads; transformers, SGLang
# and vLLM are mostly modules the tests never import.
PIP_INSTALL = -m pip install -q --no-compile
unexport PYTHONDONTWRITEBYTECODE
# uv installs every venv's packages (UV_INSTALL), from its cache once it has seen a package, and compiles no bytecode
# either, as PIP_INSTALL's --no-compile. What it saves, measured on the 2-core CI machine: SGLang's 100-odd
# requirements install in 6 s the first time and 1 s from the cache, where pip took most of that venv's 142 s (106 s
# of CPU); the main venv with its test extras takes 25 s, where pip took 62 s.
# uv also makes the venvs (NEW_VENV; seeded with pip, which the fallback below needs): 0.6 s a venv, where
# `python -m venv` took 14 s of wall time and 6.4 s of CPU, most of it ensurepip.
# torch goes in alone first (PIP_TORCH): the pinned CPU build from the machine's own wheels (pip's find-links, which
# uv does not read by itself, so they are handed to it), about 1 s a venv from uv's cache where pip took 21-25 s and 11 s
# of CPU. Where no local wheel matches, pip installs it from the index under the machine's constraint file. torch's
# dependencies come with the venv's other packages.
TORCH_PIN := torch==2.13.0
FIND_LINKS = $${PIP_FIND_LINKS:-$$($(PY) -m pip config get global.find-links 2>/dev/null)}
PIP_TORCH = links="$(FIND_LINKS)"; { [ -n "$$links" ] && $(UV_INSTALL) $(1) --no-index --no-deps \
	$$(printf -- '--find-links %s ' $$links) $(TORCH_PIN) 2>/dev/null; } || $(1) $(PIP_INSTALL) $(TORCH_PIN)
NEW_VENV = test -x $(1)/bin/python || $(UV) venv -q --seed --python $(PY) $(1)
UV_VENV := build/uv
UV := $(UV_VENV)/bin/uv
UV_INSTALL = $(UV) pip install -q --python

.PHONY: demo test venv test-deps bench clean mutate test-compat lint docs

venv: $(STAMP)

# torch is pinned to the CPU build first so the range in pyproject.toml installs nothing bigger.
$(STAMP): pyproject.toml | $(UV)
	$(call NEW_VENV,$(VENV))
	$(call PIP_TORCH,$(BIN)/python)
	$(ONE_AT_A_TIME) $(UV_INSTALL) $(BIN)/python -e '.[dev,bench]'
	touch $(STAMP)

# the maker of the venvs and installer of their packages (above), in a folder of its own (no venv: 2.8 s, not 8.7)
$(UV):
	$(PY) $(PIP_INSTALL) --root-user-action=ignore --target $(UV_VENV) 'uv>=0.4'

# Every test also runs the optional integrations for real: a Mooncake master (needs Debian's libibverbs1)
# and transformers' continuous batching.
# Only the extras' packages (`-r pyproject.toml`): kvfsm itself stays as $(STAMP) installed it. An editable
# re-install of kvfsm here would take .venv/bin/kvfsm away while static-checks runs it (a clean clone's `make test`
# failed so).
TEST_EXTRAS := --extra dev --extra bench --extra mooncake --extra transformers --extra mutation
$(TEST_STAMP): $(STAMP)
	dpkg -s libibverbs1 >/dev/null 2>&1 || $(call APT_INSTALL,libibverbs1)
	$(ONE_AT_A_TIME) $(UV_INSTALL) $(BIN)/python -r pyproject.toml $(TEST_EXTRAS)
	touch $(TEST_STAMP)

test-deps: $(TEST_STAMP)

demo: $(STAMP)
	$(BIN)/kvfsm demo

# Every test: ruff and mypy (lint), the documentation site's build and the spec checks (static-checks); the
# suite on every core (test-suite); the differential tests against the real SGLang 0.5.23 and vLLM 0.34.0, each in
# its own venv (test-upstream, below). Each starts as soon as its own venv exists: the suite, the longest, runs
# while SGLang's and vLLM's venvs are still being installed (pip waits on the disk as much as on a core), and the
# cores the short ones leave idle (mypy is one process; SGLang's differential runs on one core for two minutes
# while vLLM's parts end in one) take the suite's work. -O prints each one's output whole.
test:
	$(MAKE) -j4 -O static-checks lint test-suite test-upstream

.PHONY: static-checks test-suite
# the docs and the spec checks need the demo's venv alone, so they run while the test venv's extras install
static-checks: $(STAMP)
	$(MAKE) docs
	for spec in spec/*.yaml; do $(BIN)/kvfsm gen $$spec --check || exit 1; done
	$(BIN)/kvfsm schema --check

test-suite: $(TEST_STAMP)
	KVFSM_REQUIRE_MOONCAKE=1 KVFSM_REQUIRE_TRANSFORMERS=1 KVFSM_REQUIRE_MUTMUT=1 $(BIN)/python -m pytest -q $(PYTEST_PARALLEL)

# ruff over the project's Python and mypy over kvfsm/ and generated/, as pyproject.toml configures them, in the test venv
# (mypy reads the optional integrations' engines it installs: transformers). mypy keeps its
# cache outside the checkout, so a fresh clone checks only what differs from the last check on this machine: a module
# whose size or content hash differs from its cached entry is checked again (mypy's own test; a type error added in a
# second clone is still found). What it saves: 33 s of CPU cold, under 2 s from the cache, on the 2-core CI machine.
MYPY_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kvfsm/mypy
export MYPY_CACHE_DIR
lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The documentation site (mkdocs.yml: docs/ with the Material theme) into build/site/, every warning an error: a
# broken link or anchor, a page outside the nav. NO_MKDOCS_2_WARNING silences the theme's start-up notice about
# its own end of life, which is printed on every run and is no warning about these docs.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

bench: $(STAMP)
	$(BIN)/kvfsm bench

# Mutation testing (docs/mutation.md): every mutant of the runtime, the data plane and the generated machine
# against the fast test subset, then docs/mutation.md and tests/mutation/survivors.json. About an hour on 2 cores.
MUTATE_CHILDREN ?= 2

mutate: $(STAMP)
	$(UV_INSTALL) $(BIN)/python -e '.[dev,bench,mutation]'
	$(BIN)/python tests/mutation/mutate.py run --max-children $(MUTATE_CHILDREN)

clean:
	rm -rf $(VENV) build *.egg-info

# The differential test against the real SGLang 0.5.23 (docs/sglang-upstream.md, tests/upstream/) has its own
# venv: sglang pins a CUDA torch, so it goes in --no-deps beside the CPU torch with only what its decode
# offload path imports (tests/upstream/requirements.txt); the last step JIT-builds upstream's native hash
# (a C++ extension: g++, ninja and OpenSSL's headers, installed from Debian when missing).
UPSTREAM_VENV := .venv-sglang
UPSTREAM_BIN := $(UPSTREAM_VENV)/bin
UPSTREAM_STAMP := $(UPSTREAM_VENV)/.kvfsm-sglang-installed
# vLLM's venv (below)
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.kvfsm-vllm-installed

.PHONY: upstream-venv test-upstream device-sglang-site

upstream-venv: $(UPSTREAM_STAMP)

$(UPSTREAM_STAMP): pyproject.toml tests/upstream/requirements.txt | $(UV)
	dpkg -s g++ ninja-build libssl-dev >/dev/null 2>&1 || $(call APT_INSTALL,g++ ninja-build libssl-dev)
	$(call NEW_VENV,$(UPSTREAM_VENV))
	$(call PIP_TORCH,$(UPSTREAM_BIN)/python)
	$(UV_INSTALL) $(UPSTREAM_BIN)/python --no-deps -r tests/upstream/requirements.txt
	$(ONE_AT_A_TIME) $(UV_INSTALL) $(UPSTREAM_BIN)/python -e '.[dev]'
	$(UPSTREAM_BIN)/python tests/upstream/harness.py --warm
	touch $(UPSTREAM_STAMP)

# Its parts run side by side (two at a time, a core each; -O keeps each part's output in one piece).
.PHONY: test-upstream-sglang test-upstream-triton
test-upstream: $(UPSTREAM_STAMP) $(VLLM_STAMP)
	$(MAKE) -j2 -O test-upstream-sglang test-upstream-triton test-vllm

test-upstream-sglang: $(UPSTREAM_STAMP)
	KVFSM_REQUIRE_SGLANG=1 $(UPSTREAM_BIN)/python -m pytest -q -p no:cacheprovider tests/upstream

# the Triton copy kernels, interpreted on the CPU (sglang's venv carries triton; the main venv does not)
test-upstream-triton: $(UPSTREAM_STAMP)
	TRITON_INTERPRET=1 $(UPSTREAM_BIN)/python -m pytest -q -p no:cacheprovider tests/dataplane/test_layer_pool.py \
		tests/dataplane/test_copy_engine.py -k "interpreted"

# the sglang site the device machine's GPU runs of tests/upstream carry (see tests/upstream/device_site.py)
DEVICE_WHEELS ?= .device/wheels312
device-sglang-site: $(UPSTREAM_STAMP)
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_34_x86_64 -d $(DEVICE_WHEELS) \
		$$(grep -vE '^#|^$$|^(triton|numpy|pydantic|pydantic_core|annotated-types|typing-inspection|PyYAML)==' \
		tests/upstream/requirements.txt)
	$(BIN)/python tests/upstream/device_site.py --wheels $(DEVICE_WHEELS) --out .device/sglang-site.tar.xz

# vLLM 0.34.0's offload manager against kvfsm's (docs/vllm.md, tests/upstream_vllm/) has its own venv: vLLM pins
# a CUDA torch, so it goes in --no-deps beside the CPU torch with only what its kv_offload import path needs
# (tests/upstream_vllm/requirements.txt), and without kvfsm's transformers extra (vLLM wants transformers <5.23).

.PHONY: vllm-venv test-vllm

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml tests/upstream_vllm/requirements.txt | $(UV)
	$(call NEW_VENV,$(VLLM_VENV))
	$(call PIP_TORCH,$(VLLM_BIN)/python)
	$(UV_INSTALL) $(VLLM_BIN)/python --no-deps -r tests/upstream_vllm/requirements.txt
	$(ONE_AT_A_TIME) $(UV_INSTALL) $(VLLM_BIN)/python -e '.[dev]'
	touch $(VLLM_STAMP)

# kvfsm's tests against vLLM's manager; then vLLM 0.34.0's own tests against kvfsm's manager (the CPU manager's,
# the offload factories', the OffloadingConnector's scheduler, events, metrics and config tests: vLLM's files
# unchanged in tests/upstream_vllm/upstream/, kvfsm's patches beside them, assembled into build/); then those that
# build kvfsm's manager again, in checked mode (docs/vllm.md). One torch thread each, as tests/conftest.py gives the
# suites under tests/: the processes of `make test` already fill every core.
VLLM_OWN_TESTS := build/vllm-own-tests
VLLM_CHECKED_TESTS := tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py \
	tests/v1/kv_connector/unit/offloading_connector/test_events.py tests/v1/kv_offload/test_factory.py \
	tests/v1/kv_offload/cpu/policies/test_factory.py tests/v1/kv_offload/cpu/test_manager.py
test-vllm: $(VLLM_STAMP)
	KVFSM_REQUIRE_VLLM=1 $(VLLM_BIN)/python -m pytest -q -p no:cacheprovider tests/upstream_vllm
	rm -rf $(VLLM_OWN_TESTS) && mkdir -p $(VLLM_OWN_TESTS)
	$(VLLM_BIN)/python tests/upstream_vllm/upstream/assemble.py $(VLLM_OWN_TESTS)
	cd $(VLLM_OWN_TESTS) && OMP_NUM_THREADS=1 $(CURDIR)/$(VLLM_BIN)/python -m pytest -q -p no:cacheprovider -rs tests
	cd $(VLLM_OWN_TESTS) && KVFSM_VLLM_CHECKED=1 OMP_NUM_THREADS=1 $(CURDIR)/$(VLLM_BIN)/python -m pytest -q -p no:cacheprovider -rsx \
		$(VLLM_CHECKED_TESTS)

# The compatibility matrix (README "Tested versions"): a fresh venv per row, oldest and newest Python, torch,
# transformers and pydantic, and the whole suite in each (tests/compat/matrix.py; about 10 minutes a row).
test-compat:
	$(PY) tests/compat/matrix.py run
