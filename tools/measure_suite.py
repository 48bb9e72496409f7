"""Time the test suite as the README quotes it: `make test` whole, and pytest's count, outcome and time within it.

Runs `make test` (with `.venv` installed: the time is the suite's, not the installation's) with pytest writing a JUnit
report, and writes `bench/results/suite.json`: the wall time of `make test`, pytest's count of tests (what it
collected: the number `tests/test_suite_count.py` compares with what pytest collects), how many passed, failed, were
skipped or expected to fail, pytest's own time, the stack it ran on, the machine and its load. The README's
Development section renders its sentence from that file (`make numbers readme` after this).

    python tools/measure_suite.py            # about 10 minutes on 2 CPU cores; writes bench/results/suite.json

Nothing is written when `make test` fails, unless `--record-failures`."""
from __future__ import annotations
import argparse, datetime, json, os, platform, re, subprocess, sys, tempfile, time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT/'bench'/'results'/'suite.json'


def cpu_name() -> str:
    if not Path('/proc/cpuinfo').exists(): return platform.processor()
    return next((l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name')), platform.processor())


def make_var(name:str) -> str:
    "The value of a variable of the Makefile"
    out = subprocess.run(['make', '-s', '--no-print-directory', '--eval', f'print-var: ; @echo $({name})', 'print-var'],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return out.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--record-failures', action='store_true', help='Write suite.json even when make test fails')
    args = ap.parse_args()
    py = ROOT/'.venv'/'bin'/'python'
    stack = json.loads(subprocess.run([py, '-c', 'import json, platform, torch, fastai; print(json.dumps(dict(python=platform.python_version(), '
                                       'torch=torch.__version__, fastai=fastai.__version__)))'], check=True, capture_output=True, text=True).stdout)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp)/'junit.xml'
        pytest_args = f"{make_var('PYTEST_ARGS')} --junitxml={junit}"
        env = dict(os.environ, MPCALLBACKS_TIMING_SUITE='1')
        load_before,start = os.getloadavg()[0],time.monotonic()
        proc = subprocess.Popen(['make', 'test', f'PYTEST_ARGS={pytest_args}'], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        log = []
        for line in proc.stdout: sys.stdout.write(line); log.append(line)
        rc = proc.wait()
        secs,load_after = time.monotonic() - start,os.getloadavg()[0]
        suite = ET.parse(junit).getroot() if junit.exists() else None
    if suite is None: sys.exit(f'make test ended ({rc}) before pytest wrote its report')
    if suite.tag == 'testsuites': suite = suite.find('testsuite')
    counts = {k:int(suite.get(k, 0)) for k in ('tests', 'failures', 'errors', 'skipped')}
    summary = next((m for l in reversed(log) if (m := re.match(r'=+ (.*\d+ (?:passed|failed).*) in ([\d.]+)s', l.strip()))), None)
    outcome = dict((w, int(n)) for n,w in re.findall(r'(\d+) (\w+)', summary.group(1))) if summary else {}
    record = dict(date=str(datetime.date.today()), make_test_seconds=round(secs), make_test_rc=rc,
                  pytest=dict(tests=counts['tests'], passed=outcome.get('passed', 0), failed=outcome.get('failed', 0),
                              errors=outcome.get('errors', outcome.get('error', 0)), skipped=outcome.get('skipped', 0),
                              xfailed=outcome.get('xfailed', 0), xpassed=outcome.get('xpassed', 0),
                              seconds=round(float(summary.group(2))) if summary else round(float(suite.get('time', 0))),
                              args=make_var('PYTEST_ARGS')),
                  stack=stack, cpu=cpu_name(), cores=os.cpu_count(), load=[round(load_before, 1), round(load_after, 1)])
    print(json.dumps(record, indent=1))
    if rc and not args.record_failures: sys.exit(f'make test failed ({rc}): {RESULTS.relative_to(ROOT)} not written')
    RESULTS.write_text(json.dumps(record, indent=1) + '\n')
    print(f'{RESULTS.relative_to(ROOT)} written: now `make numbers readme`')


if __name__ == '__main__': main()
