# Two commands do all the set-up on a fresh machine (see README):
#   make train   -- the default run on the embedded toy world (flowalign train: configs/default.yaml)
#   make test    -- install into .venv and run the whole test suite
# and `make docs` builds the documentation site into site/ (mkdocs build --strict).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install test test-fast train clean docs docs-serve docs-gen toy-wan

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

# Rebuild the toy video world's model, assets/toy-wan (about 3 h 10 min on one core; each stage its own folder):
# the VAE, text encoder and a first DiT at the command's defaults, a DiT of 1x2x2 patches on them, then two more
# cycles on clips it has not seen. The asset's pretrain_log.json holds every stage's settings (tests read these lines).
TOY_WAN_STAGES := outputs/toy-wan-stages
toy-wan: install
	$(BIN)/flowalign toy pretrain-video --out $(TOY_WAN_STAGES)/0
	$(BIN)/flowalign toy pretrain-video init_from=$(TOY_WAN_STAGES)/0 reinit_transformer=true "patch_size=[1,2,2]" steps=2400 batch_size=32 --out $(TOY_WAN_STAGES)/1
	$(BIN)/flowalign toy pretrain-video init_from=$(TOY_WAN_STAGES)/1 "patch_size=[1,2,2]" seed=1 latent_clips=8192 steps=3000 batch_size=32 lr=5e-4 warmup_steps=50 --out $(TOY_WAN_STAGES)/2
	$(BIN)/flowalign toy pretrain-video init_from=$(TOY_WAN_STAGES)/2 "patch_size=[1,2,2]" seed=2 latent_clips=16384 steps=3000 batch_size=32 lr=5e-4 warmup_steps=50 --out $(TOY_WAN_STAGES)/3

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
