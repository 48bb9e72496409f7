# Everything installs into .venv from nothing: `make demo` and `make test` are the two commands of the README.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed-$(shell cat requirements-dev.txt constraints.txt pyproject.toml | md5sum | cut -c1-10)
QUIET_PIP := { grep -v '^WARNING: Location' || true; } # hide this machine's pip notices; pip's own failure still fails (pipefail)
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: install demo test sync-check nbtest pytest stack-test bench gpu-wheels readme readme-check dist-check docs docs-check

$(STAMP):
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 2>&1 | $(QUIET_PIP)
	$(PY) -m pip install -q -c constraints.txt torch==2.14.1 torchvision==0.29.1 2>&1 | $(QUIET_PIP)
	$(PY) -m pip install -q -c constraints.txt -r requirements-dev.txt 2>&1 | $(QUIET_PIP)
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

# One worker per core (pytest-xdist), each taking a whole test file at a time: the data-parallel tests share one launch
# of their processes (a module fixture). (`--dist loadgroup` would split files further, but with pytest 9.2 it no longer
# groups: a known pytest-xdist bug, reported upstream.)
PYTEST_ARGS := -q --durations=15 -n auto --dist loadfile tests

pytest: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS)

# The README's test command, and all CI runs: the notebooks are in sync and clean, README.md is fresh and renders on
# PyPI, the wheel and sdist pass `twine check --strict` and carry the LICENSE, the notebook tests and pytest pass, and
# the docs site builds and passes its checks in headless Chromium. The quick checks run first; then nbdev-test, pytest
# (in a worker per core) and the docs at once, each target's output printed whole when it ends.
test: sync-check readme-check dist-check numbers-check examples-check
	$(MAKE) --no-print-directory -j3 --output-sync=target nbtest pytest docs-check examples-run

# The notebooks and the tests on another stack than the pinned one, in a venv of its own (STACK_VENV, .venv-$(STACK) by
# default; PYTHON makes it), as CI's matrix runs them:
#   make stack-test STACK=floor    the oldest releases pyproject.toml allows: torch 2.4.1, fastai 2.8.8, fastcore 2.0.0
#                                  (2.1.0 on Python 3.10, which fastcore 2.0 does not support)
#   make stack-test STACK=newest   the newest torch and fastai, and everything else as pip resolves it today
# nbdev-test and pytest only: the other checks of `make test` compare generated files that only the pinned nbdev and
# nbconvert reproduce byte for byte.
STACK ?= floor
STACK_VENV ?= .venv-$(STACK)
PYTHON ?= python3
STACK_floor := torch==2.4.1 torchvision==0.19.1 fastai==2.8.8 "fastcore==2.0.0; python_version>='3.11'" \
	"fastcore==2.1.0; python_version<'3.11'"
STACK_newest := --upgrade torch torchvision fastai

# The floor's torch lacks FSDP2's public `fully_shard` (torch 2.6): its nbdev-test skips the sharded notebooks, besides
# nbdev's default skips (names starting with _ or .). nbdev 3.3 spells the option --skip-file-re, the floor's 3.2 --skip_file_re.
SKIP_SHARDED = $$($(STACK_VENV)/bin/nbdev-test -h | grep -q -- --skip-file-re && echo --skip-file-re || echo --skip_file_re) '^[_.]|_sharded'

stack-test:
	@test -n "$(filter floor newest,$(STACK))" || { echo "STACK is floor or newest, not '$(STACK)'"; exit 1; }
	test -x $(STACK_VENV)/bin/python || $(PYTHON) -m venv $(STACK_VENV)
	$(STACK_VENV)/bin/python -m pip install -q --upgrade pip 2>&1 | $(QUIET_PIP)
	$(STACK_VENV)/bin/python -m pip install -q $(STACK_$(STACK)) -e ".[dev]" 2>&1 | $(QUIET_PIP)
	$(STACK_VENV)/bin/python -c "import sys, torch, fastai, fastcore, nbdev, mpcallbacks; print('python', sys.version.split()[0], \
	  'torch', torch.__version__, 'fastai', fastai.__version__, 'fastcore', fastcore.__version__, 'nbdev', nbdev.__version__)"
	$(STACK_VENV)/bin/nbdev-test $(if $(filter floor,$(STACK)),$(SKIP_SHARDED))
	$(STACK_VENV)/bin/pytest $(PYTEST_ARGS)

# README.md is generated from nbs/index.ipynb: nbdev's processed notebook through nbconvert's markdown exporter, with
# the `# title` and `> summary` on top instead of front matter (nbdev-readme needs Quarto, which cannot be installed here).
readme: $(STAMP)
	$(PY) tools/build_readme.py README.md

# The numbers the README and the docs quote come from the files that measured them (bench/results/: results.md from
# `make bench`, cpu_step.md from `python -m bench.step` on a CPU without native bfloat16, install.json from
# tools/measure_install.py, suite.json from tools/measure_suite.py). numbers-check fails
# when a cell that renders a sentence from them has a stale saved output (`make numbers` saves the fresh one, then make
# readme), or a number written next to a link into bench/results (or a link named `measured` or `tested`) is not in
# the text it cites. A few seconds; tools/check_numbers.py says how.
.PHONY: numbers numbers-check examples-check examples-run suite-count
numbers: $(STAMP)
	$(PY) tools/check_numbers.py --fix --rendered-only
	$(MAKE) --no-print-directory readme

# After adding or removing tests: pytest's count of them into bench/results/suite.json (pytest --collect-only, seconds;
# the suite's time stays the last full run's, `python tools/measure_suite.py`), then the sentences and README.md that
# quote it. tests/test_suite_count.py fails until then.
suite-count: $(STAMP)
	$(PY) tools/measure_suite.py --count
	$(MAKE) --no-print-directory numbers

numbers-check: $(STAMP)
	$(PY) tools/check_numbers.py

# The examples of the home page and of every page in the sidebar's sections run as shown: every name they use comes from a shown cell
# or a builtin, not from a hidden import or the page's own exports, and no shown line is longer than a code box shows
# (90 characters: tools/check_examples.py). A few seconds.
examples-check: $(STAMP)
	$(PY) tools/check_examples.py

# The shown cells of the API, Internals and helpers' pages run alone, in order, each page in a fresh Python: what a reader copies works with the
# imports the page shows (a method fastai patches onto Learner, as fit_one_cycle, needs its module imported). About two
# minutes of one core.
examples-run: $(STAMP)
	$(PY) tools/check_examples.py --run API Internals "Helpers for the examples"

# Fails when README.md is not what `make readme` makes of nbs/index.ipynb. A few seconds.
readme-check: $(STAMP)
	@tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	$(PY) tools/build_readme.py "$$tmp/README.md" >/dev/null; \
	diff -u README.md "$$tmp/README.md" || { echo "README.md is stale: run \`make readme\` and commit it."; exit 1; }
	$(PY) tools/check_package.py --readme README.md

# The packages PyPI would get: built into a temporary folder, `twine check --strict` (metadata, README), then the
# LICENSE in both, no partial test suite in the sdist, and the README rendered as PyPI renders it. About 20 s.
dist-check: $(STAMP)
	@tmp=$$(mktemp -d); log=$$(mktemp); trap 'rm -rf "$$tmp" "$$log" build' EXIT; \
	$(PY) -m build --outdir "$$tmp" . >"$$log" 2>&1 || { cat "$$log"; exit 1; }; \
	$(PY) -m twine check --strict "$$tmp"/*; \
	$(PY) tools/check_package.py "$$tmp"

# The benchmark against fastai on the device present: prints markdown tables, writes bench/results/ (results.md, PNG plots),
# and ends with the headline ratios. About 15 minutes on 2 CPU cores, half of them section 8's whole training steps at
# realistic widths, on every core. `$(PY) -m bench.run --quick`: everything, fewer repeats. Sections alone, from the
# repository root: `$(PY) -m bench.speed` (whole steps at realistic widths; --help: models, optimizers, fits), then
# `-m bench.step_peak` (their peak memory), `-m bench.syncs`, `-m bench.memory`, `-m bench.sharded`; `-m bench.step` writes
# section 2's whole steps alone to bench/results/cpu_step.md (the README's figures for a CPU without native bfloat16).
bench: $(STAMP)
	$(PY) -m bench.run

# The GPU table (`python -m bench.gpu`, see its docstring) runs on a machine with CUDA but without fastai and without a
# package registry: this downloads the 11 wheels it lacks (2.4 MB, constraints.txt's versions, for CPython
# 3.12) into .whl/, which that machine installs into /tmp/site with the line in tools/gpu_wheels.sh's header.
gpu-wheels:
	tools/gpu_wheels.sh $(if $(wildcard $(PY)),$(PY),python3)

# The docs site without Quarto: nbdev's processed notebooks (_proc/) through nbconvert's HTML exporter into _docs/, one
# page per notebook, with the sidebar of nbs/sidebar.yml (see tools/build_docs.py for why nbconvert).
# `nbdev-docs` builds the same site with Quarto wherever Quarto is installed. About 20 s.
docs: $(STAMP)
	$(PY) tools/build_docs.py

# Opens every page of _docs/ in headless Chromium (Debian's, installed if missing) at 1280 and 400 px and fails on
# broken links or anchors (also those of _modidx.py and the module docstrings), images that do not load, tracebacks,
# progress bars or local paths in outputs, empty or misordered API entries, search that does not find and open a
# section, or a page wider than a 400 px phone (tools/README.md lists every check); screenshots go to
# _docs/screenshots/. About 15 s, plus the build and Chromium's installation.
docs-check: docs
	@command -v chromium >/dev/null || { echo "Installing Debian's chromium..."; \
	  $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
	$(PY) tools/check_docs.py
