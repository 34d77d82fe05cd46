# Two commands do all the set-up on a fresh machine (see README):
#   make train   -- the default run on the embedded toy world (flowalign train: configs/default.yaml)
#   make test    -- install into .venv and run the whole test suite
# and `make docs` builds the documentation site into site/ (mkdocs build --strict).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install test test-fast train clean docs docs-serve docs-gen

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --upgrade pip >/dev/null
	$(BIN)/python -m pip install -e ".[test]"
	touch $@

install: $(VENV)/.installed

# One pytest-xdist worker per core (tests/conftest.py gives each one intra-op thread); an idle worker steals queued
# tests from a busy one, so the minute-long multi-process tests do not leave the other core idle at the end.
test: install
	$(BIN)/python -m pytest -q -n auto --dist worksteal

train: install
	$(BIN)/flowalign train

test-fast: install
	$(BIN)/python -m pytest -q -n auto --dist worksteal -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

$(VENV)/.docs-installed: pyproject.toml | $(VENV)/.installed
	$(BIN)/python -m pip install -e ".[test,docs]"
	touch $@

# The generated reference pages must be fresh (python -m flowalign.cli.reference regenerates them).
docs: $(VENV)/.docs-installed
	$(BIN)/python -m flowalign.cli.reference --check
	$(BIN)/python docs/generate.py --check
	$(BIN)/mkdocs build --strict --site-dir site

# Rewrite the generated blocks of the docs (family and comparison tables) from the code and docs/data/.
docs-gen: install
	$(BIN)/python docs/generate.py

docs-serve: $(VENV)/.docs-installed
	$(BIN)/mkdocs serve
