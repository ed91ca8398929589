# Each target creates .venv on first use and reinstalls when pyproject.toml changes,
# so a fresh clone needs nothing but Python >= 3.11 (and the PostgreSQL server
# binaries for the PostgreSQL half of the test suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck pytest browser durations test-long chaos bench bench-quick constraints clean

# The test suite's sample plugin is not installed here (the suite puts it on PYTHONPATH),
# so `make run` starts a daemon with nothing but what you configure; older venvs lose it.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	$(BIN)/python -m pip uninstall --quiet --yes scheduler-sample-plugin 2>/dev/null || true
	touch $(STAMP)

# Debug logging by default here, so you see every tick; override with SCHEDULER_LOG__LEVEL.
run: $(STAMP)
	SCHEDULER_LOG__LEVEL=$${SCHEDULER_LOG__LEVEL:-debug} $(BIN)/scheduler-daemon run

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The suite mostly waits on real processes and servers: with two workers the two cores
# sat 40-50 % idle, with three 10 % (pytest stage 543 s -> 397 s on a clean clone here).
# Each worker has its own throwaway PostgreSQL, and a file's tests stay on one.
# Files are handed out heaviest first, by tests/file_durations.json (`make durations`
# refreshes it), not by xdist's count of tests per file: see tests/rig/durations.py.
PYTEST_WORKERS ?= 3
PYTEST_XDIST = -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The tests marked browser (any test using the browser fixture is) run in `make browser`.
# The 30 slowest tests are listed at the end: where the suite's time goes.
pytest: $(STAMP)
	$(BIN)/pytest -q $(PYTEST_XDIST) --durations=30 -m 'not browser' $(PYTEST_ARGS)

# Real-browser tests: Debian's chromium (apt-get install chromium; .ci/run does it as root)
# driven by Playwright through executable_path, never `playwright install`. One process, so
# one Chromium at a time; PYTEST_BROWSER_ARGS, not PYTEST_ARGS, so that narrowing the main
# stage to a few files does not leave this one with no tests (pytest's exit status 5).
browser: $(STAMP)
	$(BIN)/pytest -q -m browser $(PYTEST_BROWSER_ARGS)

test: lint typecheck pytest browser

# Runs the main stage and records each file's time, for the order above.
durations: $(STAMP)
	$(MAKE) pytest PYTEST_ARGS="--record-file-durations tests/file_durations.json $(PYTEST_ARGS)"

# The long variants kept out of `make test` (tests marked chaos_long), the soak excepted.
# Run it after a change to leadership/ or loops/: the scripted proofs of promises 2, 3 and 6
# live here (docs/guarantees.md); `make test` has only the chaos slice and narrower tests.
test-long: $(STAMP)
	$(BIN)/pytest -q $(PYTEST_XDIST) --run-long -m chaos_long \
	    --deselect tests/chaos/test_chaos.py::test_chaos_soak $(PYTEST_ARGS)

# One long nemesis run: make chaos SEED=7 DURATION=1800 REPLICAS=5 SHARDS=16 RTT_MS=10
# (defaults: a random seed, 300 s, 5 replicas, 1 shard: one plugin leader, 0 ms: RTT_MS is
# a standing round trip added to every replica's link). Its history, report and timeline
# land in chaos-runs/.
chaos: $(STAMP)
	CHAOS_SEED=$(SEED) CHAOS_DURATION=$(DURATION) CHAOS_REPLICAS=$(REPLICAS) \
	    CHAOS_SHARDS=$(SHARDS) CHAOS_RTT_MS=$(RTT_MS) \
	    $(BIN)/pytest -q -s --run-long tests/chaos/test_chaos.py::test_chaos_soak $(PYTEST_ARGS)

# Full run (about three hours here) and a smoke run of every benchmark (a few minutes); both
# write bench/results/ (the quick one under bench/results/quick/, never over the full).
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m bench

bench-quick: $(BENCH_STAMP)
	$(BIN)/python -m bench --quick

# The image's pinned dependencies: resolve the runtime dependencies alone in a throwaway venv.
constraints:
	rm -rf $(VENV)-constraints && $(PYTHON) -m venv $(VENV)-constraints
	$(VENV)-constraints/bin/pip install --quiet --only-binary=:all: .
	{ sed -n '/^#/p' constraints.txt; \
	  $(VENV)-constraints/bin/pip freeze --all --exclude scheduler-daemon \
	    | grep -v -e '^pip==' -e '^setuptools==' -e '^wheel=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt && rm -rf $(VENV)-constraints

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
