#!/usr/bin/env bash
# The wheels a GPU machine of this workplace lacks to run `python -m bench.gpu`, downloaded into .whl/ at the repository
# root (git-ignored), for Python 3.12 on x86-64 Linux.
#
# That machine's image (Python 3.12, torch 2.11 with CUDA 13, torchvision 0.26, numpy, pandas, matplotlib, scikit-learn,
# scipy, requests, pyyaml, pillow, cloudpickle, anyio, nvidia-ml-py, pytest, pytest-timeout, pytest-xdist, ...) has no
# fastai, and reaches no package registry. What fastai, mpcallbacks and bench.gpu import that is missing there is below:
# fastai's own packages, plum-dispatch and beartype (fastcore's dispatch), and python-fasthtml with what it imports when
# fastprogress 1.1.6 imports it (starlette, itsdangerous, python-multipart). Every one is pure Python (py3-none-any) but
# plum-dispatch 2.9.0, whose only wheels are compiled (mypyc; its cp312 manylinux x86-64 wheel is taken), all pinned to
# constraints.txt, the stack the test suite runs. Nothing else is fetched: `--no-deps`, and each wheel's
# Requires-Dist that is not here is either on the image or not imported by `fastai.basics`, `fastai.callback.fp16`,
# `mpcallbacks.all` and `bench.gpu` (fasthtml's uvicorn, httpx, oauthlib, fastlite, beautifulsoup4, ...; fastai's spacy,
# for fastai.text only).
#
# On the device machine, from the repository root, with `.whl` carried (the device tool's `carry: [".whl"]`, timeout_s about
# 540: bench.gpu's default budget is 400 s), one line:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; set -o pipefail; PYTHONUNBUFFERED=1 python3 -m bench.gpu --out $OUT 2>&1 | tee $OUT/gpu_log.txt
#
# Verified on 2026-11-27 on the CPU machine, with no GPU: a throwaway venv of Python 3.12.1 (pyenv's) holding only what the
# image holds that matters here (PyPI's torch 2.11.0 and torchvision 0.26.0, numpy 2.5.2, pandas, matplotlib,
# scikit-learn, scipy, pyyaml, requests, packaging, pillow, nvidia-ml-py, pytest, pytest-timeout, pytest-xdist, anyio,
# cloudpickle, psutil, rich), then these wheels installed exactly as above into a --target folder on PYTHONPATH, ran
# `import fastai.basics, fastai.callback.fp16, fastai.callback.schedule, mpcallbacks.all, bench.gpu` and
# `python -m bench.gpu --smoke` to the end, and the CUDA-only tests' pytest run (skipped there: no CUDA).
#
# Usage: tools/gpu_wheels.sh [PYTHON]   (PYTHON: any Python with pip, default python3; it only downloads)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-python3}
DEST=.whl
# name==version: constraints.txt's pins
WHEELS=(
  fastai==2.8.12
  fastcore==2.2.39
  fastprogress==1.1.6
  fastdownload==0.0.8
  fasttransform==0.0.5
  plum-dispatch==2.9.0
  beartype==0.23.1
  python-fasthtml==0.14.14
  starlette==1.10.0
  itsdangerous==2.2.0
  python-multipart==0.0.34
)
for spec in "${WHEELS[@]}"; do # (each pin must match constraints.txt, which the test suite's stack is)
  grep -qixF "$spec" constraints.txt || { echo "constraints.txt does not pin $spec: update WHEELS in $0"; exit 1; }
done
rm -rf "$DEST" && mkdir -p "$DEST"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "${WHEELS[@]}" 2>&1 | { grep -v '^WARNING: Location' || true; } # (this machine's pip notices)
# One wheel per package (two versions of one stop the whole install there), each pure Python or built for CPython 3.12
# on x86-64 Linux
n=$(ls "$DEST"/*.whl | wc -l)
[ "$n" -eq "${#WHEELS[@]}" ] || { echo "expected ${#WHEELS[@]} wheels in $DEST, found $n"; ls "$DEST"; exit 1; }
if ls "$DEST"/*.whl | grep -Ev -- '-py3-none-any\.whl$|-cp312-cp312-manylinux[^-]*x86_64\.whl$'; then
  echo "^ neither pure Python nor CPython 3.12 x86-64 Linux"; exit 1; fi
ls -l "$DEST"
echo "$n wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
