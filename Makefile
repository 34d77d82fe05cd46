# Two commands do all the set-up on a fresh machine (see README):
#   make train   -- the main job: GRPO on the embedded toy default (flowalign train)
#   make test    -- install into .venv and run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install test test-fast train clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --upgrade pip >/dev/null
	$(BIN)/python -m pip install -e ".[test]"
	touch $@

install: $(VENV)/.installed

test: install
	$(BIN)/python -m pytest -q

train: install
	$(BIN)/flowalign train

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
