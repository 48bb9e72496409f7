"""Time the test suite as the README quotes it (`make test` whole, and pytest's count, outcome and time within it), or
only count its tests.

A full run (about 10 minutes on 2 CPU cores) runs `make test` (with `.venv` installed: the time is the suite's, not the
installation's) with pytest writing a JUnit report, and writes `bench/results/suite.json`: the wall time of
`make test`, pytest's count of tests, how many passed, failed, were skipped or expected to fail, pytest's own time, the
stack it ran on, the machine and its load.

`--count` (seconds) only collects the tests (`pytest --collect-only`) and updates the count in `suite.json`, keeping
the last full run's times and the count they were measured with: the README then says the suite has that many tests
and that its time is the last full run's, of so many tests. `tests/test_suite_count.py` fails when pytest collects
another count than the file's, so after adding tests:

    python tools/measure_suite.py --count    # seconds: the count, then `make numbers` (saves the sentences, writes README.md)
    python tools/measure_suite.py            # the whole suite timed, then `make numbers`

Both run this checkout's package (PYTHONPATH is set to it). Nothing is written when `make test` fails, unless
`--record-failures`."""
from __future__ import annotations
import argparse, datetime, json, os, platform, re, subprocess, sys, tempfile, time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT/'bench'/'results'/'suite.json'
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]))


def cpu_name() -> str:
    if not Path('/proc/cpuinfo').exists(): return platform.processor()
    return next((l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name')), platform.processor())


def make_var(name:str) -> str:
    "The value of a variable of the Makefile"
    out = subprocess.run(['make', '-s', '--no-print-directory', '--eval', f'print-var: ; @echo $({name})', 'print-var'],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return out.strip()


def collected(py) -> int:
    "How many tests pytest collects from tests/ (what tests/test_suite_count.py compares with the file)"
    proc = subprocess.run([py, '-m', 'pytest', '--collect-only', '-q', '-p', 'no:cacheprovider', 'tests'], cwd=ROOT, env=ENV,
                          capture_output=True, text=True)
    m = re.search(r'^(\d+) tests? collected', proc.stdout, re.M)
    if proc.returncode or not m: sys.exit(f'pytest --collect-only failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}')
    return int(m.group(1))


def count(py) -> None:
    "Update the count of tests in suite.json, keeping the last full run's times (and the count they were measured with)"
    record = json.loads(RESULTS.read_text())
    n = collected(py)
    record['count'] = dict(tests=n, date=str(datetime.date.today()))
    RESULTS.write_text(json.dumps(record, indent=1) + '\n')
    timed = record['pytest']['tests']
    print(f"{RESULTS.relative_to(ROOT)}: {n} tests (the last full run, {record['date']}, timed {timed}); now `make numbers`")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--count', action='store_true', help='Only count the tests (seconds) and update the count in suite.json')
    ap.add_argument('--record-failures', action='store_true', help='Write suite.json even when make test fails')
    args = ap.parse_args()
    py = ROOT/'.venv'/'bin'/'python'
    if args.count: return count(py)
    stack = json.loads(subprocess.run([py, '-c', 'import json, platform, torch, fastai; print(json.dumps(dict(python=platform.python_version(), '
                                       'torch=torch.__version__, fastai=fastai.__version__)))'], check=True, capture_output=True, text=True).stdout)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp)/'junit.xml'
        pytest_args = f"{make_var('PYTEST_ARGS')} --junitxml={junit}"
        env = dict(ENV, MPCALLBACKS_TIMING_SUITE='1')
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
    # (pytest's last line, `909 passed, 3 skipped, 135 warnings in 532.07s (0:08:52)`, framed in `=` without -q)
    summary = next((m for l in reversed(log) if (m := re.match(r'(?:=+ )?(\d+ (?:passed|failed).*) in ([\d.]+)s', l.strip()))), None)
    outcome = dict((w, int(n)) for n,w in re.findall(r'(\d+) (\w+)', summary.group(1))) if summary else {}
    record = dict(date=str(datetime.date.today()), make_test_seconds=round(secs), make_test_rc=rc,
                  pytest=dict(tests=counts['tests'], passed=outcome.get('passed', 0), failed=outcome.get('failed', 0),
                              errors=outcome.get('errors', outcome.get('error', 0)), skipped=outcome.get('skipped', 0),
                              xfailed=outcome.get('xfailed', 0), xpassed=outcome.get('xpassed', 0),
                              seconds=round(float(summary.group(2))) if summary else round(float(suite.get('time', 0))),
                              args=make_var('PYTEST_ARGS')),
                  stack=stack, cpu=cpu_name(), cores=os.cpu_count(), load=[round(load_before, 1), round(load_after, 1)],
                  count=dict(tests=counts['tests'], date=str(datetime.date.today())))
    print(json.dumps(record, indent=1))
    if rc and not args.record_failures: sys.exit(f'make test failed ({rc}): {RESULTS.relative_to(ROOT)} not written')
    RESULTS.write_text(json.dumps(record, indent=1) + '\n')
    print(f'{RESULTS.relative_to(ROOT)} written: now `make numbers`')


if __name__ == '__main__': main()
