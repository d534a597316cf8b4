# Two commands do all the set-up on a fresh machine:
#   make run    creates .venv, installs devicekit alone, runs `devicekit run` on the bundled example
#   make test   creates .venv, installs devicekit and its test tools, runs the tests
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test durations lint bench clean

# the package alone: all that `make run` needs
$(BIN)/devicekit: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e .
	@touch $@

# the test tools (pytest, pytest-xdist, hypothesis, ruff) and the framework extras the integration tests use
# (Lightning, transformers: pinned in constraints.txt) on top, for `make test` and `make lint`
$(VENV)/.dev: $(BIN)/devicekit
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev,lightning,transformers]'
	@touch $@

run: $(BIN)/devicekit
	$(BIN)/devicekit run
	@echo "devicekit is installed in $(VENV): run $(BIN)/devicekit, or 'source $(BIN)/activate' first"

# the whole suite on pytest-xdist, one worker per core but at least 4 (many tests wait on the
# processes they start: on 2 cores 4 workers took 237 s, 2 took 274 s; with 2,500 tests 4 took
# 318 s and 6 took 332 s, the 2 cores then busy throughout: more workers only add CPU), the
# modules with the slowest recorded tests first (tests/suite_budget.py), the 15 slowest tests and
# every test over 5 s listed at the end; PYTEST_ARGS narrows it: make test PYTEST_ARGS="tests/sharing -x"
PYTEST_ARGS ?=
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ "$$n" -lt 4 ] && n=4; echo $$n)
test: $(VENV)/.dev
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --durations=15 $(PYTEST_ARGS)

# the same run, recording each test's duration (and, for the whole suite, its count and time)
# into tests/durations.json: the order `make test` runs modules in and the README's figures
durations: $(VENV)/.dev
	DEVICEKIT_RECORD_DURATIONS=1 $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --durations=15 $(PYTEST_ARGS)

lint: $(VENV)/.dev
	$(BIN)/ruff check src tests benchmarks

bench: $(VENV)/.dev
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev,bench]'
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache
