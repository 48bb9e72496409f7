"""`to_mixed()` under data-parallel training: two CPU processes over gloo, the model wrapped in DDP as fastai's
`DistributedTrainer` wraps it. One launch runs every scenario of `distributed_worker.py`; each test compares the ranks'
records (digests of the masters and 16-bit weights after every batch, scales, skip flags, call counts)."""
import warnings
import pytest, torch
from torch import nn
from fastai.learner import load_learner
import distributed_worker as dw

pytestmark = pytest.mark.filterwarnings('ignore:float16 math is emulated')
F, T = False, True

@pytest.fixture(scope='module')
def ranks(tmp_path_factory):
    "`ranks(name)`: what each of the two ranks recorded in scenario `name`"
    out = tmp_path_factory.mktemp('ddp')
    ok, log = dw.launch(out, list(dw.scenarios))
    def result(name):
        files = [out/f'{name}.rank{r}.pt' for r in range(2)]
        if not all(f.exists() for f in files): pytest.fail(f'Scenario {name} left no result ({log})', pytrace=False)
        return [torch.load(f, weights_only=False) for f in files]
    result.out,result.ok,result.log = out,ok,log
    return result

def test_both_ranks_ran_every_scenario_and_exited_cleanly(ranks):
    assert ranks.ok, ranks.log
    assert all((ranks.out/f'{name}.rank{r}.pt').exists() for name in dw.scenarios for r in range(2))

def per_batch(res, key): return [b[key] for b in res['batches']]

def took_good_step(res):
    "For each batch: whether it ended with an optimizer step that was not skipped"
    steps, hist = per_batch(res, 'steps'), res['history']
    return [n > prev and not hist[n-1][1] for prev, n in zip([0] + steps, steps)]

# ---- all ranks hold the same weights

@pytest.mark.parametrize('name', ['sync_every_step', 'no_sync_step', 'grad_accumulation', 'batch_equivalence', 'checkpoint'])
def test_ranks_hold_bit_identical_masters_and_16bit_weights_after_every_batch(ranks, name):
    r0, r1 = ranks(name)
    if name == 'checkpoint': r0, r1 = r0['resumed'], r1['resumed'] # the fit after both ranks loaded rank 0's checkpoint
    assert len(r0['batches']) == len(r1['batches']) > 0
    for key in ('masters', 'weights'): assert per_batch(r0, key) == per_batch(r1, key)
    assert r0['history'] == r1['history']
    # the digests do see the weights: they change at each good step, and only then (the masters after the batch that
    # stepped, the 16-bit weights in the forward of the next batch)
    good = took_good_step(r0)
    for key,steps in (('masters', good[1:]), ('weights', good[:-1])):
        d = per_batch(r0, key)
        assert [a != b for a, b in zip(d, d[1:])] == steps

# ---- the overflow verdict is the same on every rank

def test_inf_in_one_ranks_loss_makes_every_rank_skip_with_no_collective_of_ours(ranks):
    r0, r1 = ranks('sync_every_step') # rank 1's loss is inf in batch 5; DDP syncs every backward
    expected = [(256., F), (256., F), (256., F), (512., F), (512., F), (512., T), (256., F), (256., F)] # growth_interval 3
    assert r0['history'] == r1['history'] == expected
    assert per_batch(r0, 'loss_finite') == [T]*8 # rank 0 skipped on the inf DDP's all-reduce brought from rank 1
    assert per_batch(r1, 'loss_finite') == [T]*5 + [F] + [T]*2
    assert per_batch(r0, 'all_reduce') == per_batch(r1, 'all_reduce') == [0]*8

def test_inf_in_one_ranks_unsynced_gradient_makes_every_rank_skip_with_one_all_reduce(ranks):
    r0, r1 = ranks('no_sync_step') # batch 2 runs under `no_sync`, and rank 1's gradient gets an inf after its backward
    expected = [(256., F), (256., F), (256., T), (128., F), (128., F), (128., F), (256., F), (256., F)]
    assert r0['history'] == r1['history'] == expected
    assert per_batch(r0, 'all_reduce') == per_batch(r1, 'all_reduce') == [0, 0, 1, 0, 0, 0, 0, 0]

def test_grad_accumulation_with_ddp_sync_skips_together_with_no_collective_of_ours(ranks):
    r0, r1 = ranks('grad_accumulation') # two batches a step; rank 1's loss is inf in batch 4, the first of step 2
    assert r0['history'] == r1['history'] == [(256., F), (256., F), (512., T), (256., F)] # growth_interval 2
    assert per_batch(r0, 'all_reduce') == per_batch(r1, 'all_reduce') == [0]*8

def test_no_sync_accumulation_agrees_on_the_verdict_with_one_all_reduce_per_step(ranks):
    r0, r1 = ranks('grad_accumulation_no_sync') # the first batch of each step under `no_sync`; rank 1's loss inf in batch 4
    assert r0['history'] == r1['history'] == [(256., F), (256., F), (512., T), (256., F)]
    assert per_batch(r0, 'all_reduce') == per_batch(r1, 'all_reduce') == [0, 1]*4 # at each step, none between

# ---- gradients all-reduced once, unscaled once per backward

@pytest.mark.parametrize('name', ['sync_every_step', 'grad_accumulation'])
def test_gradients_are_reduced_once_per_backward_and_unscaled_once_per_backward(ranks, name):
    for r in ranks(name):
        n = len(r['batches'])
        assert per_batch(r, 'reduced') == [r['grad_numel']]*n # every gradient element in exactly one bucket, once
        # DDP reduces the masters' FP32 gradients: 4 bytes per trainable parameter and backward, in one bucket
        assert per_batch(r, 'reduced_bytes') == [4 * r['grad_numel']]*n and per_batch(r, 'buckets') == [1]*n
        assert per_batch(r, 'unscale_') == [1]*n # each backward's gradients unscaled and checked as it ends

# ---- checkpoints and export

def same_tensors(a, b): return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

def same_opt_state(a, b):
    return len(a['state']) == len(b['state']) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x)
        for x, y in zip(a['state'], b['state']))

def test_only_rank0_writes_and_load_round_trips_masters_scaler_and_opt_state(ranks):
    r0, r1 = ranks('checkpoint') # saved after batch 2 of a DDP fit, exported after it, then both ranks loaded rank 0's file
    assert r0['files'] == ['export.pkl', 'mid.pth'] and r1['files'] == []
    saved = r0['saved']
    assert {k:v for k,v in saved['scaler'].items() if k != 'history'} == {'scale': 128., 'growth_tracker': 1, 'skipped': 1, 'consecutive_skips': 0, 'dynamic': True, 'growth_interval': 3} # batch 1 skipped
    sd = torch.load(ranks.out/'checkpoint_rank0'/'mid.pth', weights_only=False)
    assert all(t.dtype == torch.float32 for t in sd['model'].values())
    assert same_tensors(list(sd['model'].values()), saved['masters']) # the FP32 masters, not the 16-bit weights
    assert sd['opt']['mpcallbacks.loss_scaler'] == saved['scaler']
    assert same_opt_state(sd['opt'], saved['opt'])
    for r in (r0, r1):
        assert not same_tensors(r['end']['masters'], saved['masters']) and r['end']['scaler'] != saved['scaler']
        assert same_tensors(r['loaded']['masters'], saved['masters'])
        assert r['loaded']['scaler'] == saved['scaler']
        assert same_opt_state(r['loaded']['opt'], saved['opt'])
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        exported = load_learner(ranks.out/'checkpoint_rank0'/'export.pkl')
    assert same_tensors([p.detach() for p in exported.model.parameters()], r0['end']['masters'])

# ---- two ranks with batch b train as one process with batch 2b

def test_two_ranks_match_one_process_with_twice_the_batch(ranks):
    r0, r1 = ranks('batch_equivalence') # the MLP, bs 8 per rank, plain SGD, 16 steps
    trace = dw.Trace()
    one = dw.make_learner(dw.mlp(), rank=0, world=1, bs=16, ddp=False, keep_fp32=nn.LayerNorm, init_scale=2.**8, cbs=[trace])
    one.fit(2, 0.1)
    assert r0['history'] == trace.history == [(256., F)]*16
    init, ref = list(dw.mlp().parameters()), dw.opt_params(one)
    assert same_tensors(r0['masters'], r1['masters'])
    for two, w, w0 in zip(r0['masters'], ref, init):
        moved = (w - w0).abs().max()
        assert moved > 1e-2
        # float16 rounding (per-rank gradients, DDP's float16 sum) moves the weights by ~3e-5 over 16 steps; summing
        # instead of averaging, or a rank training on its own half only, would move them by ~1e-2
        assert (two - w).abs().max() < 2e-4

# ---- ranks that start apart, and accumulation under `no_sync`: the masters stay identical across ranks

def test_ranks_built_from_different_seeds_hold_identical_masters(ranks):
    r0, r1 = ranks('different_init')
    assert per_batch(r0, 'masters') == per_batch(r1, 'masters')

def test_no_sync_accumulation_keeps_ranks_identical(ranks):
    r0, r1 = ranks('grad_accumulation_no_sync')
    assert per_batch(r0, 'masters') == per_batch(r1, 'masters')
