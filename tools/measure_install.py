"""What installing mpcallbacks costs a new user: the time `pip install` takes and the size of the venv it makes.

Builds the wheel from this tree, makes a fresh venv in a temporary folder, and times the README's install: torch
first where a build is chosen, with torchvision (fastai needs it, and a torchvision made for another torch release would
make pip replace the torch installed first): `--torch-index-url`, e.g. PyTorch's CPU-only index, or `--torch-wheel`, a
torch wheel file copied from a machine that reaches that index, with `--torchvision` naming the torchvision to go with
it. Then `pip install <wheel>[demo]` (no pip cache, so every package is fetched as on a first install). Then it measures the venv on disk (and the NVIDIA libraries in it) and deletes it.
Prints one markdown table row; with `--record PATH` (the README's Install section renders `bench/results/install.json`)
it appends the run there, with where pip took the packages from.

    python tools/measure_install.py --record cuda                  # PyPI's default torch (on Linux: the CUDA build)
    python tools/measure_install.py --record cpu --torch-index-url https://download.pytorch.org/whl/cpu
    python tools/measure_install.py --record cpu --torch-wheel torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl \
        --torchvision torchvision==0.28.0

    python tools/measure_install.py --record make --measure-venv .venv   # the size of a venv already made (`make install`'s)

Several minutes and several GB of disk for the default build; nothing is left behind."""
from __future__ import annotations
import argparse, datetime, json, os, platform, shutil, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT/'bench'/'results'/'install.json'


# The venv's pip must see only the venv: a PYTHONPATH to a source tree would show it mpcallbacks as installed already
ENV = {k:v for k,v in os.environ.items() if k not in ('PYTHONPATH', 'PYTHONHOME', 'PIP_USER', 'VIRTUAL_ENV')}


def run(*cmd, **kw) -> str:
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True, env=ENV, **kw).stdout


def tree_bytes(path:Path) -> int:
    "Bytes of the files under `path` (each file once, symlinks not followed)"
    seen,total = set(),0
    for dirpath,_,files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(dirpath, f))
            if (st.st_dev, st.st_ino) in seen: continue
            seen.add((st.st_dev, st.st_ino)); total += st.st_size
    return total


def pip_sources(python) -> str:
    "Where this machine's pip takes packages from: its configured indexes and find-links, or PyPI"
    conf = run(python, '-m', 'pip', 'config', 'list').splitlines()
    keys = ('index-url', 'extra-index-url', 'find-links')
    lines = sorted({l.split('.', 1)[-1] for l in conf if any(l.split('.', 1)[-1].startswith(k + '=') for k in keys)})
    return '; '.join(lines) or 'PyPI (pip\'s default index)'


def record(row:dict) -> None:
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {'runs': []}
    data['runs'].append(row)
    RESULTS.write_text(json.dumps(data, indent=1) + '\n')
    print(f'recorded in {RESULTS.relative_to(ROOT)}')


def measure_venv(args) -> None:
    "The size of a venv that is already there, and the torch in it"
    venv = args.measure_venv.resolve()
    py = venv/'bin'/'python'
    site = Path(run(py, '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])').strip())
    size,nvidia = tree_bytes(venv),(tree_bytes(site/'nvidia') if (site/'nvidia').exists() else 0)
    row = dict(name=args.record, date=str(datetime.date.today()), what=f'the venv at {args.measure_venv} (size only)',
               python=run(py, '-c', 'import platform; print(platform.python_version())').strip(),
               pip=run(py, '-m', 'pip', '--version').split()[1], torch=run(py, '-c', 'import torch; print(torch.__version__)').strip(),
               seconds=None, venv_bytes=size, nvidia_bytes=nvidia,
               machine=f'{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs', sources=pip_sources(py), note=args.note)
    print(f"{row['what']}: torch {row['torch']}, {size/1e9:.1f} GB, of which NVIDIA {nvidia/1e9:.1f} GB")
    if args.record: record(row)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--python', default=sys.executable, help='The Python that makes the venv')
    src = ap.add_mutually_exclusive_group()
    src.add_argument('--torch-index-url', help='Install torch from this index first (e.g. PyTorch CPU-only builds)')
    src.add_argument('--torch-wheel', type=Path, help='Install torch from this wheel file first (e.g. a CPU-only build)')
    ap.add_argument('--torchvision', default='torchvision', help='What to install with torch: a requirement or a wheel file')
    ap.add_argument('--record', metavar='NAME', help=f'Append the run to {RESULTS.relative_to(ROOT)} under this name (cpu, cuda)')
    ap.add_argument('--note', default='', help='What to know about this run (recorded with it)')
    ap.add_argument('--measure-venv', type=Path, help='Only measure this existing venv (its size), and record that')
    ap.add_argument('--keep', action='store_true', help='Keep the temporary folder (its path is printed)')
    args = ap.parse_args()
    if args.measure_venv: return measure_venv(args)
    tmp = Path(tempfile.mkdtemp(prefix='mpcallbacks-install-'))
    try:
        run(args.python, '-m', 'build', '--wheel', '--outdir', tmp/'dist', ROOT)
        wheel = next((tmp/'dist').glob('*.whl'))
        venv = tmp/'venv'
        run(args.python, '-m', 'venv', venv)
        pip = [venv/'bin'/'python', '-m', 'pip', '--no-cache-dir', '--disable-pip-version-check', 'install', '-q']
        load_before,start = os.getloadavg()[0],time.monotonic()
        if args.torch_index_url: run(*pip, 'torch', args.torchvision, '--index-url', args.torch_index_url)
        if args.torch_wheel: run(*pip, args.torch_wheel.resolve(), args.torchvision)
        run(*pip, f'{wheel}[demo]')
        secs,load_after = time.monotonic() - start,os.getloadavg()[0]
        size = tree_bytes(venv)
        site = Path(run(venv/'bin'/'python', '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])').strip())
        nvidia = tree_bytes(site/'nvidia') if (site/'nvidia').exists() else 0
        torch_version = run(venv/'bin'/'python', '-c', 'import torch; print(torch.__version__)').strip()
        run(venv/'bin'/'python', '-c', 'import mpcallbacks.all, mpcallbacks.digits') # installed, and it imports
        py = run(venv/'bin'/'python', '-c', 'import platform; print(platform.python_version())').strip()
        pip_version = run(venv/'bin'/'python', '-m', 'pip', '--version').split()[1]
        torch_from = (f'torch and {args.torchvision} from {args.torch_index_url}, then' if args.torch_index_url else
                      f'torch from the wheel file {args.torch_wheel.name} and {args.torchvision}, then' if args.torch_wheel else '')
        what = f'`pip install` {torch_from} the wheel with [demo]'.replace('  ', ' ')
        row = dict(name=args.record, date=str(datetime.date.today()), what=what, python=py, pip=pip_version,
                   torch=torch_version, seconds=round(secs), venv_bytes=size, nvidia_bytes=nvidia,
                   machine=f'{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs', sources=pip_sources(venv/'bin'/'python'),
                   load=[round(load_before, 1), round(load_after, 1)], note=args.note)
        print('| date | what | Python, pip | torch installed | time | venv size | of which NVIDIA |\n|---|---|---|---|---|---|---|')
        print(f"| {row['date']} | {what} | {py}, {pip_version} | {torch_version} | {row['seconds']} s | {size/1e9:.1f} GB | "
              f'{nvidia/1e9:.1f} GB |')
        print(f"({row['machine']}, 1-minute load average {row['load'][0]} before and {row['load'][1]} after (more than the "
              f"CPUs: other work shared them); pip's sources: {row['sources']}; the time includes fetching every package from them)")
        if args.record: record(row)
    finally:
        if args.keep: print(f'kept {tmp}')
        else: shutil.rmtree(tmp, ignore_errors=True)


if __name__ == '__main__': main()
