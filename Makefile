# Two commands for a fresh machine: `make demo` runs the main job, `make test` runs the tests.
# Both create the virtual environment (.venv, Python >= 3.12) on first use.
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $$(scripts/find-python.sh) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/pyro-bnn $(ARGS)

# One pytest worker per core (pytest-xdist), each test file on one worker so that its module
# fixtures are built once; every test runs single-threaded (tests/conftest.py).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check pyro_bnn tests benchmarks examples

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_core.py

clean:
	rm -rf $(VENV) .pytest_cache
