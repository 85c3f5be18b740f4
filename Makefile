# Two commands a newcomer needs: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed-stamp

# Python caches the bytecode it compiles (and pytest its rewritten test modules): where the
# environment forbids it, every test process and every CLI or worker process it starts compiles
# the package and the tests again (measured: 5.5 of a collection's 11 s of CPU).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup demo test test-fast test-fast-py313 test-stress test-nemo-gym lint typecheck bench sample deploy serve clean docs

# uv installs the dev extras (the same packages pip resolves: 38 s against 195 s measured on a
# loaded 2-core machine); pip stays in the venv for the tests that build a wheel with it.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip uv
	$(BIN)/uv pip install -q --python $(BIN)/python -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# Azurite (npm), the Azure Blob server the tests start, installed once into .venv/azurite (git-ignored).
AZURITE = $(VENV)/azurite/node_modules/.bin/azurite-blob
$(AZURITE): | $(STAMP)
	$(BIN)/python -m tests.support.stores install-azurite

# Enrich the bundled sample on an embedded Prefect server (no server to start).
demo: setup
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/rollout-capture demo --output out/sample.enriched.jsonl

# Everything, in two passes on two workers each, run side by side: the unit tests as `make
# test-fast` runs them (every seed here; a test left unmarked that starts a server fails), their
# report kept in build/test-unit.log and shown at the end, beside the `integration` tests, a file at
# a time per worker so a file's servers and clusters stay in one process, the slowest files first
# (tests/conftest.py SLOWEST_FIRST), naming its ten slowest tests. The integration tests wait on
# servers and processes for a quarter of their time: the unit tests fill it (measured on 2 cores:
# 401 s side by side against 477 s one after the other). Either failing fails the target; Ctrl-C
# stops both.
test: setup $(AZURITE)
	@mkdir -p build; \
	$(BIN)/pytest -q -n 2 -m "not integration" > build/test-unit.log 2>&1 & unit=$$!; \
	trap 'kill $$unit 2>/dev/null; exit 130' INT TERM; \
	echo "The unit tests run beside the integration tests below; their report follows them."; \
	status=0; \
	$(BIN)/pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m integration --durations=10 || status=1; \
	wait $$unit || status=1; \
	echo; echo "The unit tests (build/test-unit.log):"; cat build/test-unit.log; \
	exit $$status

# The unit tests alone (no server, cluster, browser or CLI process: the `integration` marker,
# tests/conftest.py), the protocol simulations on 200 of their 1,500 seeds. Under 90 s on 2 cores.
test-fast: setup
	ROLLOUT_CAPTURE_SIM_SEEDS=200 $(BIN)/pytest -q -n 2 -m "not integration"

# `make test` beside a CPU hog keeping every core busy (tests/support/cpu_hog.py): a test that
# fails here but not on an idle machine fails by chance, and is a bug of the test.
test-stress: setup
	$(BIN)/python -m tests.support.cpu_hog $(MAKE) --no-print-directory test

# The released NeMo Gym itself beside ours (tests/test_nemo_gym_070.py): a Python 3.13 venv with the
# pinned nemo-gym wheel (it declares Python >= 3.13.14; 3.13.0 runs it) and rollout-capture's wheel
# installed beside it, non-editable (what users install is what we test), kept in build/ per
# version, then the tier on it. uv installs it (and caches what it downloads: pip took minutes for
# its 1.4 GB), from the machine's own Python 3.13 (PYTHON313), never one it downloads.
NEMO_GYM_VERSION ?= 0.7.0
PYTHON313 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python) $(shell command -v python3.13))
NG_VENV  = build/nemo-gym-$(NEMO_GYM_VERSION)
NG_STAMP = $(NG_VENV)/.installed-stamp
NG_WHEEL = build/wheel
PACKAGE_SOURCES = pyproject.toml setup.py $(shell find rollout_capture flows tasks deployments cli -type f -not -path '*__pycache__*')
export UV_PYTHON_DOWNLOADS = never
# A recipe's first line: stops with a clear error when PYTHON313 is no Python 3.13.
NEED_PYTHON313 = "$(PYTHON313)" -c 'import sys; assert sys.version_info[:2] == (3, 13)' 2>/dev/null || { \
	  echo "make $(MAKECMDGOALS) needs a Python 3.13 (for $@) and found none:" >&2; \
	  echo "  PYTHON313='$(PYTHON313)' is not one. Install Python 3.13 (pyenv install 3.13, apt install" >&2; \
	  echo "  python3.13) or name its interpreter: make $(MAKECMDGOALS) PYTHON313=/path/to/python3.13" >&2; \
	  exit 2; }

$(NG_STAMP): | $(STAMP)
	@$(NEED_PYTHON313)
	rm -rf $(NG_VENV)
	$(BIN)/uv venv -q --python $(PYTHON313) $(NG_VENV)
	$(BIN)/uv pip install -q --python $(NG_VENV)/bin/python --python-version 3.13.14 nemo-gym==$(NEMO_GYM_VERSION)
	touch $(NG_STAMP)

# The wheel, built from the tree (setuptools' build/lib emptied first: it would ship a module
# left there by an earlier build), installed in place of the last one.
$(NG_VENV)/.rollout-capture-stamp: $(NG_STAMP) $(PACKAGE_SOURCES)
	rm -rf build/lib $(NG_WHEEL)
	$(BIN)/pip wheel -q --no-deps --no-input -w $(NG_WHEEL) .
	rm -rf build/lib build/bdist.*
	$(BIN)/uv pip install -q --python $(NG_VENV)/bin/python --reinstall-package rollout-capture \
	  "$$(ls $(NG_WHEEL)/rollout_capture-*.whl)[proxy,azure]"
	touch $@

# Each module whole on one xdist worker (--dist loadfile): A and B share one run of the scenario
# (a module fixture), C (its own module) runs beside them on the other worker. -rP shows the counts.
test-nemo-gym: setup $(NG_VENV)/.rollout-capture-stamp
	NEMO_GYM_PYTHON=$(abspath $(NG_VENV))/bin/python $(BIN)/pytest -q -n 2 --dist loadfile -rP \
	  tests/test_nemo_gym_070.py tests/test_nemo_gym_070_collection.py

# The unit tests (as `make test-fast` runs them) on Python 3.13 too, in a venv of the dev extras
# built by uv from the machine's Python 3.13 (the tier's PYTHON313), kept in build/.
PY313_VENV = build/py313-dev
$(PY313_VENV)/.installed-stamp: pyproject.toml | $(STAMP)
	@$(NEED_PYTHON313)
	rm -rf $(PY313_VENV)
	$(BIN)/uv venv -q --python $(PYTHON313) $(PY313_VENV)
	$(BIN)/uv pip install -q --python $(PY313_VENV)/bin/python -e '.[dev]'
	touch $@

test-fast-py313: setup $(PY313_VENV)/.installed-stamp
	ROLLOUT_CAPTURE_SIM_SEEDS=200 $(PY313_VENV)/bin/pytest -q -n 2 -m "not integration"

# What CI (.ci/run) and the pre-commit hooks check: ruff, the format, and mypy --strict.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@$(MAKE) --no-print-directory typecheck

typecheck: setup
	@# mypy checks the package as it installs: flows/, tasks/, deployments/ linked in as rollout_capture.*
	rm -rf build/typecheck && mkdir -p build/typecheck/rollout_capture
	for e in rollout_capture/* flows tasks deployments cli; do ln -s ../../../$$e build/typecheck/rollout_capture/; done
	$(BIN)/mypy

bench: setup $(AZURITE)
	$(BIN)/python benchmarks/bench_merge.py
	$(BIN)/python benchmarks/bench_flow.py
	$(BIN)/python benchmarks/bench_s3.py
	$(BIN)/python benchmarks/bench_proxy.py
	$(BIN)/python benchmarks/bench_runs.py
	$(BIN)/python benchmarks/bench_backlog.py
	$(BIN)/python benchmarks/bench_stores.py

# Register the shipped deployments on the server PREFECT_API_URL names (the pool is created if missing):
#   make deploy RUNS_ROOT=/data/runs   (or s3://bucket/runs, with DEPLOY_ARGS="--credentials-block NAME")
deploy: setup
	$(BIN)/rollout-capture deploy --runs-root "$(RUNS_ROOT)" --pool rollout-capture $(DEPLOY_ARGS)

# Serve the flows from this machine (no work pool or worker needed; PREFECT_API_URL set):
#   make serve RUNS_ROOT=/data/runs   (or ROLLOUT_CAPTURE_RUNS_ROOT in the environment)
serve: setup
	$(BIN)/rollout-capture serve $(if $(RUNS_ROOT),--runs-root "$(RUNS_ROOT)")

# Build the documentation into site/ (mkdocs; the API reference from the docstrings).
docs: setup
	$(BIN)/mkdocs build --strict --site-dir site

# Regenerate rollout_capture/sample/ from the shared corpus (deterministic).
sample: setup
	$(BIN)/python examples/build_sample.py

clean:
	rm -rf out build dist site benchmarks/_corpus benchmarks/results .pytest_cache .ruff_cache .mypy_cache
