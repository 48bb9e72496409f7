# Everything installs into .venv from nothing: `make demo` and `make test` are the two commands of the README.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed-$(shell cat requirements-dev.txt pyproject.toml | md5sum | cut -c1-10)
QUIET_PIP := grep -v '^WARNING: Location' || true

.PHONY: install demo test sync-check nbtest pytest

$(STAMP):
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 2>&1 | $(QUIET_PIP)
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1 2>&1 | $(QUIET_PIP)
	$(PY) -m pip install -q -r requirements-dev.txt 2>&1 | $(QUIET_PIP)
	$(PY) -m pip install -q --no-deps -e . 2>&1 | $(QUIET_PIP)
	$(PY) -c "import torch, fastai, nbdev, mpcallbacks; print('torch', torch.__version__, 'fastai', fastai.__version__, 'nbdev', nbdev.__version__)"
	rm -f $(VENV)/.installed-*
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(PY) demo.py

# The notebooks are the source: exporting and cleaning them must change nothing that is committed.
sync-check: $(STAMP)
	$(BIN)/nbdev-export
	$(BIN)/nbdev-clean
	@if [ -n "$$(git status --porcelain -- mpcallbacks nbs)" ]; then \
	  git status --porcelain -- mpcallbacks nbs; \
	  echo "nbdev-export/nbdev-clean changed the files above: run them and commit the result."; exit 1; fi

nbtest: $(STAMP)
	$(BIN)/nbdev-test

pytest: $(STAMP)
	$(BIN)/pytest -q tests

test: sync-check nbtest pytest

# README.md is generated from nbs/index.ipynb (nbdev-readme needs Quarto, which cannot be installed here).
readme: $(STAMP)
	$(BIN)/nbdev-proc-nbs >/dev/null 2>&1 || true
	$(BIN)/jupyter nbconvert --to markdown _proc/index.ipynb --output-dir . --output README --log-level WARN
