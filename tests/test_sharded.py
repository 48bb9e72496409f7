"""`to_sharded()` with `to_mixed()`: FSDP2 over gloo on CPU, at 2 and 4 ranks. One launch per world size runs every
scenario of `sharded_worker.py`; each test compares the ranks' records with each other and with one process."""
import warnings
from contextlib import contextmanager
import pytest, torch
from torch import nn
from fastai.learner import load_learner
import sharded_worker as sw
import distributed_worker as dw

F, T = False, True
# FSDP2's `fully_shard` is public from torch 2.6 (`to_sharded` says so on an older torch)
pytestmark = pytest.mark.skipif(not hasattr(__import__('torch.distributed.fsdp').distributed.fsdp, 'fully_shard'),
                                reason='sharded training needs torch 2.6 or newer')

@pytest.fixture(scope='module', params=[2, 4], ids=lambda w: f'{w}ranks')
def ranks(request, tmp_path_factory):
    "`ranks(name)`: what each rank recorded in scenario `name`; `ranks.world`: how many ranks"
    world = request.param
    out = tmp_path_factory.mktemp(f'sharded{world}')
    ok, log = sw.launch(out, list(sw.scenarios), world)
    def result(name):
        files = [out/f'{name}.w{world}.rank{r}.pt' for r in range(world)]
        if not all(f.exists() for f in files): pytest.fail(f'Scenario {name} left no result ({log})', pytrace=False)
        return [torch.load(f, weights_only=False) for f in files]
    result.out,result.ok,result.log,result.world = out,ok,log,world
    return result

@contextmanager
def one_thread():
    "As the ranks compute (one thread each): the matmuls split their sums the same way"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try: yield
    finally: torch.set_num_threads(n)

def one_process(**kwargs):
    "The same fit in one process, unsharded"
    with one_thread(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn = sw.learner(0, 1, **kwargs)
        return learn

def same(a, b): return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

def test_every_rank_ran_every_scenario_and_exited_cleanly(ranks):
    assert ranks.ok, ranks.log

# ---- the sharded fit is the one-process fit

def test_sharded_fit_on_the_same_batches_is_bit_identical_to_one_process(ranks):
    rs = ranks('same_data') # every rank the same batches, so that the reduced gradient is each rank's: Adam, 2 epochs, bf16
    one = one_process(bs=16, split=False, **sw.mixed)
    with one_thread(): one.fit(2, 1e-2)
    assert rs[0]['history'] == list(one.master_mixed_precision.scaler.history)
    assert same(rs[0]['masters'], [p.detach() for p in one.model.parameters()])
    for r in rs: # FP32 DTensor masters after the fit; one all-reduce of the overflow verdict per step
        assert r['kinds'] == ['DTensor'] and r['dtypes'] == ['torch.float32']
        assert r['all_reduce'] == [1]*8

def test_gradient_accumulation_over_sharded_gradients_is_bit_identical_to_one_process(ranks):
    from fastai.callback.training import GradientAccumulation
    rs = ranks('grad_accumulation') # two batches a step: the second backward adds to the first's reduced, unscaled shards
    one = one_process(bs=16, split=False, cbs=[GradientAccumulation(n_acc=32)], **sw.mixed)
    with one_thread(): one.fit(2, 1e-2)
    assert len(rs[0]['history']) == 4 and rs[0]['history'] == list(one.master_mixed_precision.scaler.history)
    assert same(rs[0]['masters'], [p.detach() for p in one.model.parameters()])

def test_sharded_fit_on_split_batches_matches_one_process_with_the_whole_batch(ranks):
    rs = ranks('split_data') # bs 8 per rank, SGD: one process with bs 8*world
    one = one_process(bs=8*ranks.world, opt_func=sw.SGD, **sw.mixed)
    with one_thread(): one.fit(2, 0.1)
    init, ref = list(dw.mlp().parameters()), [p.detach() for p in one.model.parameters()]
    moved = max((w - w0).abs().max() for w, w0 in zip(ref, init))
    apart = max((two - w).abs().max() for two, w in zip(rs[0]['masters'], ref))
    assert moved > 5e-2
    # each rank's bfloat16 gradient is rounded over its part of the batch, not the whole: ~3e-4 at most over the fit,
    # against ~1e-2 for a sum instead of a mean, or a rank training on its own part only
    assert apart < 1e-3

# ---- the overflow verdict is every rank's

def test_inf_on_one_rank_is_skipped_by_every_rank(ranks):
    rs = ranks('inf_on_one_rank') # rank 1's loss inf at step 2; an inf in rank 1's own gradient shard only, at step 5
    expected = [(256., F), (256., F), (256., T), (128., F), (128., F), (128., T), (64., F), (64., F)] # growth_interval 3
    for r in rs:
        assert r['history'] == expected and r['skipped'] == 2
        assert r['all_reduce'] == [1]*8 # one all-reduce of the verdict per step, none more

def test_a_storm_of_skips_on_one_ranks_shard_stops_every_rank_in_float16(ranks):
    rs = ranks('storm_float16') # an inf in rank 1's own shard from step 1 on; 3 skips in a row stop the fit
    for r in rs:
        assert r['error'] == 'NonFiniteGradients'
        assert r['history'] == [(4., F), (4., T), (2., T), (1., T)]
        assert r['kinds'] == ['DTensor'] and r['dtypes'] == ['torch.float32']
    assert all(torch.isfinite(t).all() for t in rs[0]['masters']) # the last good step's masters

# ---- checkpoints and export

def test_load_resumes_the_same_trajectory(ranks):
    rs = ranks('checkpoint') # fit, save, fit on (a); load, fit on again (b)
    r = rs[0]
    assert same(r['loaded']['masters'], r['saved']['masters']) and r['loaded']['scaler'] == r['saved']['scaler']
    assert same(r['b']['masters'], r['a']['masters']) and r['b']['scaler'] == r['a']['scaler']
    assert not same(r['a']['masters'], r['saved']['masters'])
    assert all(x['opt_is_sharded'] for x in rs)

def test_the_checkpoint_is_an_unsharded_learners(ranks):
    r = ranks('checkpoint')[0]
    sd = torch.load(f"{r['path']}/models/mid.pth", weights_only=False)
    model = dw.mlp()
    assert list(sd['model']) == list(model.state_dict())
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in sd['model'].values())
    assert same(list(sd['model'].values()), r['saved']['masters'])
    assert sd['opt']['mpcallbacks.loss_scaler'] == r['saved']['scaler']
    plain = one_process(bs=8, **sw.mixed) # one process, unsharded, loads it
    plain.load(f"{r['path']}/models/mid", with_opt=True)
    assert same([p.detach() for p in plain.model.parameters()], r['saved']['masters'])
    assert plain.master_mixed_precision.scaler.state_dict() == r['saved']['scaler']
    atomic = torch.load(f"{r['path']}/models/atomic.pth", weights_only=False) # `save_atomic` at the end
    assert same(list(atomic['model'].values()), r['b']['masters'])

def test_export_is_a_plain_fp32_model(ranks):
    r = ranks('checkpoint')[0]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn = load_learner(f"{r['path']}/export.pkl")
    ps = list(learn.model.parameters())
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in ps)
    assert same([p.detach() for p in ps], r['b']['masters'])
    assert not any('FSDP' in type(m).__name__ for m in learn.model.modules())
    assert not learn.model._forward_pre_hooks and not learn.model._forward_hooks
    assert [type(c).__name__ for c in learn.cbs if type(c).__name__ in ('ShardedTrainer', 'MasterMixedPrecision')] == []
    learn.model(torch.randn(2, 1, 8, 8)) # it runs, in FP32

# ---- an exception on one rank

def test_an_exception_on_one_rank_ends_the_fit_on_every_rank_with_the_masters_in_place(ranks):
    rs = ranks('exception_on_one_rank') # rank 1 raises between the forward and the backward of batch 2
    assert rs[1]['error'] == 'ValueError'
    assert all(r['error'] == 'RuntimeError' for i, r in enumerate(rs) if i != 1) # their backward's collective timed out
    for r in rs: # the gathered 16-bit parameters were freed: every parameter is its FP32 master, the optimizer's
        assert r['kinds'] == ['DTensor'] and r['dtypes'] == r['local_dtypes'] == ['torch.float32'] and r['are_masters']
        assert r['fit_state']
