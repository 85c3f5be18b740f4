# Two commands a newcomer needs: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed-stamp

.PHONY: setup demo test lint bench sample deploy serve clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# Enrich the bundled sample on an embedded Prefect server (no server to start).
demo: setup
	PREFECT_SERVER_ANALYTICS_ENABLED=false $(BIN)/rollout-capture enrich examples/sample/rollouts.jsonl \
		--capture-dir examples/sample/captures --output out/sample.enriched.jsonl

test: setup
	$(BIN)/pytest -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@# mypy checks the package as it installs: flows/, tasks/, deployments/ linked in as rollout_capture.*
	rm -rf build/typecheck && mkdir -p build/typecheck/rollout_capture
	for e in rollout_capture/* flows tasks deployments; do ln -s ../../../$$e build/typecheck/rollout_capture/; done
	$(BIN)/mypy

bench: setup
	$(BIN)/python benchmarks/bench_merge.py
	$(BIN)/python benchmarks/bench_flow.py
	$(BIN)/python benchmarks/bench_s3.py
	$(BIN)/python benchmarks/bench_proxy.py
	$(BIN)/python benchmarks/bench_runs.py

# Register the deployments on the server PREFECT_API_URL names (a fresh one needs the pool).
deploy: setup
	$(BIN)/prefect work-pool create rollout-capture --type process --overwrite
	$(BIN)/prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml

# Serve the flows from this machine (no work pool or worker needed).
serve: setup
	$(BIN)/rollout-capture serve

# Regenerate examples/sample/ from the shared corpus (deterministic).
sample: setup
	$(BIN)/python examples/build_sample.py

clean:
	rm -rf out build dist benchmarks/_corpus benchmarks/results .pytest_cache .ruff_cache .mypy_cache
