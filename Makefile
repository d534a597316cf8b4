# Two commands do all the set-up on a fresh machine:
#   make run    creates .venv, installs devicekit, runs `devicekit run` on the bundled example
#   make test   creates .venv, installs devicekit with its test tools, runs the tests
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test lint bench clean

$(BIN)/devicekit: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
	@touch $@

run: $(BIN)/devicekit
	$(BIN)/devicekit run

test: $(BIN)/devicekit
	$(BIN)/python -m pytest -q

lint: $(BIN)/devicekit
	$(BIN)/ruff check src tests benchmarks

bench: $(BIN)/devicekit
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev,bench]'
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache
