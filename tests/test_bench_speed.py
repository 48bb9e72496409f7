"The benchmark's section modules stand alone, and section 8 (whole steps at realistic widths) runs end to end on its smallest model."
import subprocess, sys
import torch

def test_section_modules_do_not_import_the_runner():
    # Each section formats its own tables: importing one must not pull in bench.run, which imports them all
    code = ("import sys, bench.memory, bench.sharded, bench.syncs, bench.speed, bench.step_peak; "
            "print('bench.run' in sys.modules)")
    out = subprocess.run([sys.executable, '-W', 'ignore', '-c', code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == 'False'

def test_speed_section_runs_on_the_overhead_bound_model():
    from bench.speed import run_speed, speed_section, configs
    r = run_speed('cpu', models=('tiny',), rounds=1, threads=1)
    (row,) = r['rows']
    measured = set(row['ms']) | set(row['failed'])
    for o in ('adam', 'fused'):
        assert (o, 'FP32', None) in measured
        for dt in r['dtypes']: assert {(o, c, dt) for c in configs if c != 'FP32'} <= measured
    assert all(ms > 0 for ms in row['ms'].values())
    assert not {k for k in row['failed'] if k[1] != 'pure 16-bit'} # only pure 16-bit may fail, and says why in the table
    text = speed_section(r)
    assert '| 100x Linear(32, 32)' in text and 'to_mixed / autocast' in text and 'fastai Adam / fused AdamW' in text
    assert torch.get_num_threads() == 1 # the thread count the tests set is restored

def test_bookkeeping_section_runs():
    "Section 1 calls into the cast's machinery: it fails here, not at the next `make bench`, when that changes"
    from bench.bookkeeping import run_bookkeeping, bookkeeping_section
    rows = run_bookkeeping(torch.device('cpu'), warmup=1, repeats=1)
    assert len(rows) == 2 and all(ms > 0 for r in rows for ms in r['ms'].values())
    assert '| ours copy-back |' in bookkeeping_section(rows)
