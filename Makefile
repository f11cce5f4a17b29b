# Every target sets up .venv first (pinned dependencies from pyproject.toml), so any one
# of them works first on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
PYTEST_ARGS ?=
# make test's pytest workers (pytest-xdist; one module stays on one worker, so a module's
# fixtures are set up once and session fixtures once per worker), costliest module first
# (tests/ordering.py).
# TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
# Every JVM the tests start (Spark drivers in pytest, in Ray actors, in `tierflow up`'s
# runtime; Spark's standalone daemons) compiles with C1 only: tests run small batches, where
# C2's compiler threads cost more CPU than their code saves, and the two workers share two
# cores (measured in docs/benchmarks.md: 30% less CPU, 13% less wall time for the Spark job
# tests; the code a JVM runs is the same). Not for bench, which measures the JVM as deployed.
# C1's code lives in the non-profiled half of a segmented code cache, which a test worker's
# Spark session (hundreds of generated query classes) can fill, and a full code cache ends
# the JVM ("Out of space in CodeCache"): one unsegmented cache of 512 MB (reserved, not used).
TEST_JVM := JAVA_TOOL_OPTIONS="$$JAVA_TOOL_OPTIONS -XX:TieredStopAtLevel=1 -XX:-SegmentedCodeCache -XX:ReservedCodeCacheSize=512m"

CHROMIUM ?= /usr/bin/chromium
SUDO   := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)

.PHONY: demo test test-fast test-long bench bench-nexmark chaos lint fmt setup java chromium clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "tierflow needs Python 3.11+ (found %s)" % sys.version.split()[0]'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	@touch $(STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,bench]'
	@touch $(BENCH_STAMP)

# Spark 4 needs Java 17+: fail early, naming the Debian package.
java: $(STAMP)
	@$(VENV)/bin/tierflow check

# The dashboard tests drive a real headless Chromium (Debian's package; Playwright's own
# browser download is not used). They fail, not skip, without it.
chromium:
	@test -x $(CHROMIUM) || { $(SUDO) apt-get update -qq && \
	  $(SUDO) apt-get install -y -qq chromium; } || \
	  { echo "make test needs the Debian package chromium (apt-get install chromium)"; exit 1; }

demo: $(STAMP) java
	$(VENV)/bin/tierflow demo

# The project's modules are byte-compiled first: with PYTHONDONTWRITEBYTECODE set in the
# environment, every Ray worker, Spark Python worker and CLI run would compile them from
# source again. (Spark's class archive, `java`, is built before the tests, not beside them:
# the costliest modules run first and are Spark's, so built beside them the archive competes
# with those modules for the cores and their JVMs start without it; docs/benchmarks.md.)
test: $(STAMP) java chromium lint
	@$(PY) -m compileall -q runtime actors jobs cluster tests > /dev/null
	$(TEST_JVM) $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 $(PYTEST_ARGS)

# The tests marked `unit`: pure code, no engine (tests/conftest.py fails a unit test that
# starts nats-server, Ray, Spark or any other process), so neither Java nor Chromium.
test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m unit $(PYTEST_ARGS)

# Benchmarks print numbers and assert no speed; files are tests/bench/bench_*.py. Each
# bench's own wall time is listed at the end (--durations=0).
# Then tests/bench/report.py merges reports/bench_*.json into reports/bench.json, draws
# reports/*.png and prints the table (also for a partial run: what did not run says so).
bench: $(BENCH_STAMP) java
	@mkdir -p reports && rm -f reports/bench_*.json
	$(PY) -m pytest -q -s -p no:cacheprovider --durations=0 -o python_files='bench_*.py' tests/bench $(PYTEST_ARGS); \
	rc=$$?; if [ $$rc -eq 5 ]; then echo "no benchmarks collected"; exit 0; fi; \
	$(PY) -m tests.bench.report || exit 1; exit $$rc

# Nexmark at full size (tests/bench/bench_nexmark.py): every query over 1,000,000 events,
# each answer against DuckDB's; `make bench` runs it over 200,000.
bench-nexmark: $(BENCH_STAMP) java
	@mkdir -p reports
	TIERFLOW_BENCH_NEXMARK_EVENTS=1000000 $(PY) -m pytest -q -s -p no:cacheprovider --durations=0 -o python_files='bench_*.py' tests/bench/bench_nexmark.py $(PYTEST_ARGS); \
	rc=$$?; $(PY) -m tests.bench.report || exit 1; exit $$rc

# The long fault-injection suite (tests marked `chaos`); `make test` runs a short form.
chaos: $(STAMP) java
	$(TEST_JVM) $(PY) -m pytest -q -p no:cacheprovider -m chaos $(PYTEST_ARGS); \
	rc=$$?; if [ $$rc -eq 5 ]; then echo "no chaos scenarios collected yet"; else exit $$rc; fi

# Full forms of tests whose short form `make test` runs (tests marked `long`).
test-long: $(STAMP) java
	$(TEST_JVM) $(PY) -m pytest -q -p no:cacheprovider -m long $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m tests.layers

fmt: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf .tierflow reports .pytest_cache
