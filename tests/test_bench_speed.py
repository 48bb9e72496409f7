"The benchmark's section modules stand alone, and section 8 (whole steps at realistic widths) runs end to end on its smallest model."
import subprocess, sys
import torch

def test_section_modules_do_not_import_the_runner():
    # Each section formats its own tables: importing one must not pull in bench.run, which imports them all
    code = ("import sys, bench.memory, bench.sharded, bench.syncs, bench.speed, bench.step_peak, bench.accuracy; "
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

def test_whole_step_targets_name_every_row_over_its_limit():
    "The results' targets table judges section 8 on the native types: a row above autocast is named and fails the target, an emulated type is not judged"
    from bench.run import whole_step_targets
    def row(key, ms): return dict(key=key, model=key, ms=ms)
    mlp = {('fused', 'to_mixed', 'bfloat16'): 103., ('fused', 'autocast', 'bfloat16'): 100., ('fused', 'pure 16-bit', 'bfloat16'): 90.,
           ('adam', 'to_mixed', 'bfloat16'): 101., ('adam', 'autocast', 'bfloat16'): 130.,
           ('fused', 'to_mixed', 'float16'): 500., ('fused', 'autocast', 'float16'): 100.} # (float16 emulated: not judged)
    tiny = {('fused', 'to_mixed', 'bfloat16'): 10., ('fused', 'autocast', 'bfloat16'): 10.04}
    speed = dict(dtypes=['bfloat16', 'float16'], native=['bfloat16'], opts=['adam', 'fused'], rows=[row('mlp', mlp), row('tiny', tiny)])
    peak = lambda c, dt, mib: dict(model='resnet', name='ResNet-18', config=c, dtype=dt, peak_MiB=mib)
    peaks = [peak('FP32', '-', 445.), peak('to_mixed', 'bfloat16', 318.), peak('autocast', 'bfloat16', 354.)]
    syncs = [dict(model='digits CNN', opt='fused AdamW', config='to_mixed bfloat16', extra=0, extra_per_step=0.)]
    vs_ac,vs_pure,adam,sync,mem = whole_step_targets(speed, peaks, syncs)
    assert vs_ac[2] is False and vs_ac[1].startswith('1 of 3 above') and 'mlp, fused AdamW, bfloat16' in vs_ac[1], vs_ac
    assert vs_pure[2] is False and '1.14x' in vs_pure[1], vs_pure
    assert adam[2] is True and sync[2] is True and mem[2] is True
    speed['native'] = []
    assert all(t[2] is None for t in whole_step_targets(speed, [], [])) # (nothing measured: nothing judged)

def test_accuracy_section_runs_and_matches_autocast():
    "Section 9 on a small transformer: `to_mixed`'s gradients are autocast's, as close to FP32's (its forward is autocast's)"
    from bench.accuracy import run_accuracy, accuracy_section
    from bench.run import accuracy_targets
    rows = run_accuracy('cpu', bs=4, seq=16, d=32, n_layers=1)
    assert [r['dtype'] for r in rows] == ['bfloat16', 'float16'] and all(0 < r['autocast'] < 0.1 for r in rows)
    assert all(t[2] for t in accuracy_targets(rows)), accuracy_targets(rows)
    assert '| bfloat16 | 64 |' in accuracy_section(rows)
