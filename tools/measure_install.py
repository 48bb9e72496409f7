"""What installing mpcallbacks costs a new user: the time `pip install` takes and the size of the venv it makes.

Builds the wheel from this tree, makes a fresh venv in a temporary folder, and times a plain `pip install <wheel>`
(no pip cache, so every package is downloaded as on a first install), then measures the venv on disk and deletes it.
With `--torch-index-url`, torch is installed first from that index (e.g. PyTorch's CPU-only builds), as the README
suggests for machines without an NVIDIA GPU. Prints one markdown table row; tools/README.md keeps the results.

    python tools/measure_install.py                       # PyPI's default torch (on Linux: the CUDA build)
    python tools/measure_install.py --torch-index-url https://download.pytorch.org/whl/cpu

Several minutes and several GB of disk for the default build; nothing is left behind."""
from __future__ import annotations
import argparse, datetime, os, platform, shutil, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*cmd, **kw) -> str:
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True, **kw).stdout


def tree_bytes(path:Path) -> int:
    "Bytes of the files under `path` (each file once, symlinks not followed)"
    seen,total = set(),0
    for dirpath,_,files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(dirpath, f))
            if (st.st_dev, st.st_ino) in seen: continue
            seen.add((st.st_dev, st.st_ino)); total += st.st_size
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--python', default=sys.executable, help='The Python that makes the venv')
    ap.add_argument('--torch-index-url', help='Install torch from this index first (e.g. PyTorch CPU-only builds)')
    ap.add_argument('--keep', action='store_true', help='Keep the temporary folder (its path is printed)')
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix='mpcallbacks-install-'))
    try:
        run(args.python, '-m', 'build', '--wheel', '--outdir', tmp/'dist', ROOT)
        wheel = next((tmp/'dist').glob('*.whl'))
        venv = tmp/'venv'
        run(args.python, '-m', 'venv', venv)
        pip = [venv/'bin'/'python', '-m', 'pip', '--no-cache-dir', '--disable-pip-version-check', 'install', '-q']
        start = time.monotonic()
        if args.torch_index_url: run(*pip, 'torch', '--index-url', args.torch_index_url)
        run(*pip, wheel)
        secs = time.monotonic() - start
        size = tree_bytes(venv)
        torch_version = run(venv/'bin'/'python', '-c', 'import torch; print(torch.__version__)').strip()
        py = run(venv/'bin'/'python', '-c', 'import platform; print(platform.python_version())').strip()
        pip_version = run(venv/'bin'/'python', '-m', 'pip', '--version').split()[1]
        source = f'torch from {args.torch_index_url}, then the wheel' if args.torch_index_url else 'the wheel, torch from PyPI'
        print('| date | what | Python, pip | torch installed | time | venv size |\n|---|---|---|---|---|---|')
        print(f'| {datetime.date.today()} | `pip install` {source} | {py}, {pip_version} | {torch_version} | '
              f'{secs:.0f} s | {size/1e9:.1f} GB |')
        print(f'({platform.system()} {platform.machine()}, {os.cpu_count()} CPUs; the time includes the downloads)')
    finally:
        if args.keep: print(f'kept {tmp}')
        else: shutil.rmtree(tmp, ignore_errors=True)


if __name__ == '__main__': main()
