"""bench.gpu, the one command a GPU machine runs, checked here on the CPU: its smoke run end to end (every config of both
models, the table and the targets written), and the parts that only a GPU exercises for real (the largest-batch probes,
what counts as running out of memory, the autocast state a failed fit leaves, the sync debug mode's scope, the pytest
subprocess's summary) driven with stand-ins."""
import json, subprocess, sys
import pytest, torch
from torch import nn
from bench import gpu
from bench.gpu import (largest_batch, is_allocation_error, leave_autocast, fits_in_memory, cuda_only_tests, run_cuda_tests,
                       Workload, image_batch, rows_order, configs)

def test_gpu_modules_do_not_import_the_runner():
    "bench.gpu stands alone, as every section module does: importing it (or section 5, which calls it) must not pull in bench.run"
    code = "import sys, bench.gpu, bench.cuda_throughput; print('bench.run' in sys.modules)"
    out = subprocess.run([sys.executable, '-W', 'ignore', '-c', code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == 'False'

def test_smoke_run_measures_every_config_and_writes_the_table(tmp_path, capsys):
    res = gpu.main(['--smoke', '--no-tests', '--device', 'cpu', '--out', str(tmp_path)])
    assert [p['status'] for p in res['preflight']] == ['PASS', 'PASS', 'PASS', 'PASS', 'SKIP'], res['preflight'] # (the sync debug mode needs CUDA)
    rows = res['rows']
    assert [(r['key'], r['config'], r['opt_key']) for r in rows] == [(k, c, o) for k in ('resnet', 'gpt') for c,o in rows_order]
    for r in rows:
        assert not r['errors'] and not r['skipped'], r
        assert r['rate'] > 0 and len(r['windows']) == res['sizes']['n_windows'] * res['sizes']['passes'] == len(r['pass_rates']) * res['sizes']['n_windows']
        assert r['syncs']['cuda'] is None and r['syncs']['rule']['per_step'] >= 0 # (CUDA's own count needs CUDA)
        assert set(r['syncs_extra']) == {'rule', 'cuda'} and r['syncs_extra']['rule'] is not None
        assert r['peak_MiB'] is None and 'no CUDA memory statistics' in r['largest']['note'] and r['energy_per'] is None
    assert len(res['targets']) == 9 and {t['met'] for t in res['targets'] if 'largest batch' in t['target']} == {None}
    md = (tmp_path / 'gpu.md').read_text()
    for part in ('### GPU: whole training steps (smoke run, tiny models)', '#### a. Preflight', '#### b. CUDA-only tests',
                 '#### c. Throughput', '#### Targets', '| config | optimizer | images/s |', '| config | optimizer | tokens/s |',
                 '| to_mixed(bfloat16) | fused AdamW |', "| to_mixed(float16) | fastai Adam |", '**every config ran with TF32 off**'):
        assert part in md, part
    assert json.loads((tmp_path / 'gpu.json').read_text())['rows'][0]['config'] == 'FP32'
    partial = dict(res, complete=False, tests=None, rows=rows[:3], phases=dict(total=9., preflight=2.)) # (as written while it runs)
    assert 'Incomplete' in gpu.gpu_markdown(partial) and 'tests not run' in gpu.gpu_markdown(partial)
    assert '#### Targets' in capsys.readouterr().out # (both printed too)
    assert not torch.is_autocast_enabled('cpu') and torch.backends.cudnn.allow_tf32 # (nothing left behind: TF32's flags restored)

def test_without_cuda_main_says_so_unless_smoke():
    if torch.cuda.is_available(): pytest.skip('this machine has CUDA')
    with pytest.raises(SystemExit, match='needs a CUDA device.*--smoke'): gpu.main([])
    with pytest.raises(SystemExit): gpu.main(['--smoke', '--budget-s', '0']) # (argparse: --budget-s must be positive)
    with pytest.raises(SystemExit): gpu.main(['--smoke', '--models', 'resnet,vgg'])
    with pytest.raises(SystemExit): gpu.main(['--smoke', '--device', 'meta'])

def test_largest_batch_is_predicted_by_a_line_and_confirmed_by_two_probes_at_most():
    peak = lambda bs: 100. + 10. * bs # MiB: the model and its state, and 10 MiB per sample
    def fits_up_to(limit, seen):
        def fits(n):
            seen.append(n)
            return (True, '') if n <= limit else (False, 'OutOfMemoryError: CUDA out of memory')
        return fits
    points,capacity = [(64, peak(64)), (32, peak(32))],peak(1000)
    seen = []
    r = largest_batch(fits_up_to(10**6, seen), points, capacity, cap=4096)
    assert r['predicted'] == 1000 and seen == [944, 1000] and r['largest'] == 1000 # 95% of it, then it
    seen = []
    r = largest_batch(fits_up_to(960, seen), points, capacity, cap=4096)
    assert seen == [944, 1000] and r['largest'] == 944
    seen = []
    r = largest_batch(fits_up_to(900, seen), points, capacity, cap=4096)
    assert seen == [944, 800] and r['largest'] == 800 # 95% did not fit: 80%
    seen = []
    r = largest_batch(fits_up_to(500, seen), points, capacity, cap=4096)
    assert seen == [944, 800] and r['largest'] is None
    seen = []
    r = largest_batch(fits_up_to(10**6, seen), points, capacity, cap=64)
    assert seen == [64] and r['largest'] == 64 # no probe above the cap
    r = largest_batch(lambda n: (None, 'RuntimeError: CUDA error: an illegal memory access'), points, capacity, cap=4096)
    assert len(r['probes']) == 1 and r['largest'] is None # another error: no second probe
    assert largest_batch(fits_up_to(10**6, []), [(64, 50.), (32, 50.)], capacity, cap=4096)['predicted'] is None # no growth: no line

@pytest.mark.parametrize('exc,alloc', [
    (torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB'), True),
    (RuntimeError('cuDNN error: CUDNN_STATUS_ALLOC_FAILED'), True),
    (RuntimeError('CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`'), True),
    (RuntimeError('CUDA error: out of memory'), True),
    (RuntimeError('CUDA error: an illegal memory access was encountered'), False),
    (ValueError('expected 4 channels'), False),
])
def test_what_counts_as_running_out_of_memory(exc, alloc):
    assert is_allocation_error(exc) is alloc
    try: # raised from another exception, as fastai's or torch's wrappers do
        try: raise exc
        except Exception as inner: raise RuntimeError('the fit stopped') from inner
    except RuntimeError as outer: assert is_allocation_error(outer) is alloc

class RaisesInForward(nn.Module):
    "Enters autocast as a mixed-precision callback's `before_batch` does, then runs out of memory above `limit` samples"
    def __init__(self, limit:int):
        super().__init__()
        self.limit,self.lin = limit,nn.Linear(3 * 8 * 8, 10)
    def forward(self, x):
        torch.autocast('cpu', dtype=torch.bfloat16).__enter__() # (never exited: the fit raises before after_loss)
        if len(x) > self.limit: raise torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 20.00 GiB')
        return self.lin(x.flatten(1))

def test_a_probe_that_runs_out_of_memory_is_no_fit_and_leaves_no_autocast_behind():
    w = Workload('stand-in', 'images', 1000, lambda: RaisesInForward(8), image_batch(8, 10), 1, 4, 2, 2, 64)
    ok,note = fits_in_memory(w, 'FP32', 'fused', 16, 'cpu')
    assert ok is False and 'OutOfMemoryError' in note
    assert not torch.is_autocast_enabled('cpu') and torch.autocast_increment_nesting() == 1 # (nesting back to 0)
    torch.autocast_decrement_nesting()
    assert fits_in_memory(w, 'FP32', 'fused', 8, 'cpu')[0] is True
    leave_autocast()

class Loud(nn.Module):
    "A linear layer whose output is multiplied by 2^12: at float16's first loss scale (2^16) its gradients overflow"
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3 * 8 * 8, 10)
    def forward(self, x): return self.lin(x.flatten(1)) * 2.**12

def test_the_short_fits_of_a_float16_config_start_at_the_loss_scale_its_timed_fit_came_to():
    "Two steps from 2^16 are both skipped where gradients are large (ResNet-50 on an H200), and to_mixed raises for a fit that learned nothing: the short fits start where the timed fit's scale came to"
    w = Workload('stand-in', 'images', 1000, Loud, image_batch(8, 10), 1, 8, 4, 4, 64)
    sizes = gpu.Sizes(20, 2, 2, (2, 4), 2) # (20 warm-up steps: the scale halves down to one that fits)
    scales = {}
    for config in ('to_mixed(float16)', 'fastai to_fp16()'):
        res = gpu.measure_throughput(w, config, 'fused', 'cpu', sizes, gpu.Energy('cpu'))
        if config == 'fastai to_fp16()' and not torch.cuda.is_available(): # (fastai's GradScaler is torch.amp's for 'cuda': off without CUDA)
            assert res['scale_after'] is None
            continue
        scales[config] = scale = res['scale_after']
        assert scale is not None and scale < 2.**16, scale
        learn = gpu.make_learner(w, config, 'fused', 4, 2, 'cpu', scale)
        assert (learn.master_mixed_precision.loss_scale if config == 'to_mixed(float16)' else learn.mixed_precision.kwargs['init_scale']) == scale
    scale = scales['to_mixed(float16)']
    with pytest.raises(FloatingPointError, match='All 2 optimizer steps'): gpu.measure_peak(w, 'to_mixed(float16)', 'fused', 4, 'cpu')
    assert gpu.measure_peak(w, 'to_mixed(float16)', 'fused', 4, 'cpu', scale) is None # (CPU: no peak, and no error)
    assert gpu.syncs_per_step(w, 'to_mixed(float16)', 'fused', 'cpu', (2, 4), scale)['rule']['per_step'] >= 0
    assert fits_in_memory(w, 'to_mixed(float16)', 'fused', 4, 'cpu', scale)[0] is True
    assert fits_in_memory(w, 'to_mixed(float16)', 'fused', 4, 'cpu')[0] is None # (from 2^16: an error that is not memory)

def test_leave_autocast_is_harmless_with_no_autocast_entered():
    leave_autocast()
    assert not torch.is_autocast_enabled('cpu') and torch.autocast_increment_nesting() == 1
    torch.autocast_decrement_nesting()

def test_the_fused_step_check_holds_the_sync_debug_mode_from_batch_start_to_step_end(monkeypatch):
    "On CUDA the mode raises at a sync; here a stand-in records it: 'error' through the optimizer steps of batches 2 and 3, off for fastai's after_batch and after the fit"
    mode,at_step,at_after_batch = [0],[],[]
    monkeypatch.setattr(torch.cuda, 'set_sync_debug_mode', lambda m: mode.__setitem__(0, m))
    step = torch.optim.AdamW.step
    def spy(self, *args, **kwargs):
        at_step.append(mode[0])
        return step(self, *args, **kwargs)
    monkeypatch.setattr(torch.optim.AdamW, 'step', spy)
    class RecorderStandIn(gpu.Callback):
        order = 50 # fastai's Recorder's, which copies the loss to the host
        def after_batch(self): at_after_batch.append(mode[0])
    small_fit = gpu._small_fit
    monkeypatch.setattr(gpu, '_small_fit', lambda *a, cbs=(), **k: small_fit(*a, cbs=list(cbs) + [RecorderStandIn()], **k))
    assert 'no sync' in gpu.check_fused_step_no_sync('cpu')
    assert at_step == [0, 'error', 'error'] and at_after_batch == [0, 0, 0] and mode[0] == 0

def test_cuda_only_tests_are_found_by_their_skipif(tmp_path):
    assert 'tests/test_fused_steps.py::test_on_cuda_the_flags_come_back_with_no_wait_per_step' in cuda_only_tests()
    tests = tmp_path / 'tests'
    tests.mkdir()
    (tests / 'test_a.py').write_text("import pytest, torch\n@pytest.mark.skipif(not torch.cuda.is_available(), reason='CUDA')\n"
                                     "def test_one(): pass\ndef test_two(): pass\n"
                                     "@pytest.mark.skipif(not torch.cuda.is_available(), reason='CUDA')\nclass TestGPU:\n    def test_x(self): pass\n")
    (tests / 'test_b.py').write_text("import pytest, torch\npytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='CUDA')\n")
    (tests / 'test_c.py').write_text("import pytest\n@pytest.mark.skipif(True, reason='other')\ndef test_three(): pass\n")
    assert cuda_only_tests(tests) == ['tests/test_a.py::test_one', 'tests/test_a.py::TestGPU', 'tests/test_b.py']

@pytest.mark.parametrize('rc,out,status', [
    (0, '.                [100%]\n1 passed in 3.21s\n', 'PASS'),
    (0, 's                [100%]\nSKIPPED [1] tests/test_x.py:79: needs CUDA\n1 skipped, 2 warnings in 0.09s\n', 'SKIP'),
    (0, '.s               [100%]\n1 passed, 1 skipped in 1.00s\n', 'FAIL'), # (on a GPU a skip means the test did not see CUDA)
    (1, 'F                [100%]\nFAILED tests/test_x.py::test_y - AssertionError\n1 failed in 2.00s\n', 'FAIL'),
    (None, None, 'FAIL'), # the time limit
])
def test_the_tests_subprocess_is_judged_by_its_exit_code_and_summary(monkeypatch, rc, out, status):
    def fake_run(cmd, **kwargs):
        assert cmd[1:3] == ['-m', 'pytest'] and cmd[-1] == 'tests/test_x.py::test_y' and kwargs['timeout'] == 5
        if rc is None: raise subprocess.TimeoutExpired(cmd, kwargs['timeout'], output=b'collected 1 item\n', stderr=None)
        return subprocess.CompletedProcess(cmd, rc, out, '')
    monkeypatch.setattr(subprocess, 'run', fake_run)
    res = run_cuda_tests(timeout_s=5, ids=['tests/test_x.py::test_y'])
    assert res['status'] == status, res
    if out: assert res['summary'] == out.strip().splitlines()[-1]
    else: assert res['tail'] == 'collected 1 item\nstopped after 5 s' # (a time-out's output comes as bytes)

def test_section_5_formats_the_gpu_table():
    "make bench's section 5 is bench.gpu's table: its rows format with the targets; without CUDA it says so"
    from bench.cuda_throughput import cuda_section
    assert 'Skipped: no CUDA device' in cuda_section(None)
    row = lambda key, config, opt, rate: dict(model='ResNet-50, 224 px' if key == 'resnet' else 'GPT', key=key, unit='images', per=1000,
        config=config, opt=opt, opt_key='fused' if opt == 'fused AdamW' else 'adam', bs=128, bs_small=64, bs_syncs=8, errors={}, skipped=[],
        rate=rate, peak_MiB=1000., peak_small_MiB=600., energy_per=1.5, largest=dict(predicted=2000, largest=1896, probes=[(1896, True, '')]),
        syncs_extra=dict(cuda=dict(per_step=0., per_fit=1.), rule=dict(per_step=1., per_fit=0.)))
    rows = [row('resnet', c, 'fused AdamW', 1000. if c == 'FP32' else 2500.) for c in configs]
    text = cuda_section(rows)
    assert '### 5. CUDA throughput' in text and '| to_mixed(float16) | fused AdamW | 2,500 | **2.50x** |' in text
    assert '1896 (predicted 2000; 1896 fits)' in text
    assert "| ResNet-50: to_mixed(float16) >= 2x FP32 (TF32 off), fused AdamW | 2.50x (ResNet-50) | yes |" in text

def test_the_throughput_fits_are_interleaved_and_pooled(monkeypatch):
    "Configs in order, then in reverse (A B C, C B A): a drift of the device's clocks falls on every config alike; the windows of both fits pooled"
    order = []
    def fake(w, config, opt, device, sizes, energy):
        order.append((config, opt))
        n = len(order)
        return dict(rate=float(n), windows=[float(n)] * sizes.n_windows, timed_s=1., peak_MiB=None, energy_per=None, scale_after=None)
    monkeypatch.setattr(gpu, 'measure_throughput', fake)
    monkeypatch.setattr(gpu, 'syncs_per_step', lambda *a, **k: dict(rule=None, cuda=None))
    rows = gpu.run_table('cpu', smoke=True, models=('resnet',))
    n = len(rows_order)
    assert order == list(rows_order) + list(rows_order)[::-1]
    assert [r['pass_rates'] for r in rows] == [[i + 1., 2 * n - i] for i in range(n)]
    assert all(r['rate'] == (n + 0.5) and len(r['windows']) == 2 * gpu.sizes_for['smoke'].n_windows for r in rows) # (the median of both fits' windows)
