"Bad arguments are refused at the call, naming the argument and what it takes: the loss scales float16's range makes useless, a growth factor that can only overshoot, `to_sharded`'s units, mesh and reshard_after_forward (before anything is sharded), and the precision doctor's and `mixed_summary`'s."
import os, re, socket
import pytest, torch
from torch import nn
import torch.distributed as dist
from mpcallbacks.all import MasterMixedPrecision, ShardedTrainer
from mpcallbacks.distributed import fsdp_sharded
from mpcallbacks.test_utils import synth_learner
from intact import assert_at_rest, hook_ids

# ---- loss scales: bounded by the 16-bit type's range, and a growth factor that cannot only overshoot

bad_scales = [(torch.float16, dict(loss_scale=1e5), 'loss_scale=100000.0 is above 65504'),
              (torch.float16, dict(loss_scale=2.**24), 'loss_scale=16777216.0 is above 65504'),
              (torch.float16, dict(init_scale=2.**100), 'init_scale=1.2676506002282294e+30 is above 2**24'),
              (torch.float16, dict(init_scale=2.**25), 'init_scale=33554432.0 is above 2**24'),
              (torch.float16, dict(min_scale=2.**-30), 'min_scale=9.313225746154785e-10 is at or below 2**-24'),
              (torch.float16, dict(loss_scale=8., min_scale=2.**-25), 'min_scale=2.9802322387695312e-08 is at or below 2**-24'),
              (torch.float16, dict(growth_factor=1e300), 'growth_factor must be > 1 and at most 2**16'),
              (torch.bfloat16, dict(loss_scale='dynamic', growth_factor=2.**17), 'growth_factor must be > 1 and at most 2**16')]

@pytest.mark.parametrize('dtype,kwargs,msg', bad_scales, ids=[f'{str(d)[6:]}-{k}={v:g}' for d, kw, _ in bad_scales for k, v in [list(kw.items())[-1]]])
def test_a_scale_the_type_cannot_use_is_refused_at_to_mixed(dtype, kwargs, msg):
    learn = synth_learner(); hooks = hook_ids(learn.model)
    with pytest.raises(ValueError, match=re.escape(msg)): learn.to_mixed(dtype, **kwargs)
    assert not learn._grab_cbs(MasterMixedPrecision)
    assert_at_rest(learn, hooks)

good_scales = [(torch.float16, dict(loss_scale=65504.)), (torch.float16, dict(init_scale=2.**24)), (torch.float16, dict(min_scale=2.**-23)),
               (torch.float16, dict(growth_factor=2.**16)), (torch.bfloat16, dict(loss_scale='dynamic', init_scale=2.**100)),
               (torch.bfloat16, dict(loss_scale=2.**40)), (torch.bfloat16, dict(loss_scale='dynamic', min_scale=2.**-100, init_scale=1.))]

@pytest.mark.parametrize('dtype,kwargs', good_scales, ids=[f'{str(d)[6:]}-{k}={v:g}' for d, kw in good_scales for k, v in [list(kw.items())[-1]]])
def test_scales_within_the_types_range_are_accepted(dtype, kwargs):
    synth_learner().to_mixed(dtype, **kwargs)

# ---- to_sharded: refused at the call, nothing sharded

@pytest.fixture
def one_rank_group(tmp_path):
    if dist.is_initialized(): yield; return
    dist.init_process_group('gloo', init_method=f'file://{tmp_path}/pg', rank=0, world_size=1)
    try: yield
    finally: dist.destroy_process_group()

def bad_sharding(learn):
    return [(dict(units=5), TypeError, "units must be None or a list of the model's modules, got int 5"),
            (dict(units=learn.model[0]), TypeError, "units must be None or a list of the model's modules, got Conv2d"),
            (dict(units=['0']), TypeError, "these are not modules: ['0']"),
            (dict(units=[nn.Linear(2, 2)]), ValueError, "units must be modules of the model"),
            (dict(reshard_after_forward='yes'), TypeError, "reshard_after_forward must be True or False, got str 'yes'"),
            (dict(mesh='cpu'), TypeError, "mesh must be None (every rank of the default process group) or a torch `DeviceMesh`"),
            (dict(distribute_data='no'), TypeError, "distribute_data must be True, False or None")]

@pytest.mark.parametrize('i', range(7))
def test_a_bad_sharding_argument_is_refused_at_to_sharded_and_nothing_is_sharded(one_rank_group, i):
    learn = synth_learner().to_mixed(torch.bfloat16)
    kwargs, exc, msg = bad_sharding(learn)[i]
    with pytest.raises(exc, match=re.escape(msg)): learn.to_sharded(**kwargs)
    assert not learn._grab_cbs(ShardedTrainer) and not fsdp_sharded(learn.model)
    assert not any(type(m).__name__.startswith('FSDP') for m in learn.model.modules())
    learn.fit(1, 1e-2) # the learner trains as it did, unsharded

def test_a_bad_sharding_argument_is_named_even_without_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(TypeError, match='units'): synth_learner().to_sharded(units=5)

def test_a_two_dimensional_mesh_is_accepted_and_a_three_dimensional_one_refused(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    learn = synth_learner()
    with pytest.raises(TypeError, match='mesh must be'): learn.to_sharded(mesh=init_device_mesh('cpu', (1, 1, 1)))
    learn.to_sharded(mesh=init_device_mesh('cpu', (1,)))
    assert learn._grab_cbs(ShardedTrainer)

# ---- the precision doctor and mixed_summary

def test_precision_report_refuses_a_bad_keep_fp32_or_n_batches():
    learn = synth_learner().to_mixed(torch.bfloat16)
    with pytest.raises(TypeError, match=re.escape("keep_fp32 takes None, module types")): learn.precision_report(keep_fp32=5)
    with pytest.raises(TypeError, match=re.escape("these are neither: [5]")): learn.precision_report(keep_fp32=[nn.LayerNorm, 5])
    with pytest.raises(TypeError, match=re.escape("n_batches must be a positive int (training batches to measure), got bool True")):
        learn.precision_report(n_batches=True)
    with pytest.raises(TypeError, match='n_batches'): learn.precision_report(n_batches=2.)
    with pytest.raises(ValueError, match='n_batches'): learn.precision_report(n_batches=0)
    assert len(learn.precision_report(keep_fp32=nn.Linear, n_batches=1))

def test_mixed_summary_refuses_a_by_reason_that_is_not_a_bool():
    learn = synth_learner().to_mixed(torch.bfloat16)
    with pytest.raises(TypeError, match=re.escape("by_reason must be True or False, got str 'no'")): learn.mixed_summary(by_reason='no')
    assert len(learn.mixed_summary(by_reason=True)) < len(learn.mixed_summary(by_reason=False))

def test_the_doctor_never_advises_a_static_float16_scale_that_to_mixed_refuses():
    from test_precision_doctor import tiny_loss_learner
    rep = tiny_loss_learner().to_mixed(torch.float16, loss_scale=None).precision_report()
    advised = [int(k) for k in re.findall(r'a static 2\*\*(\d+)', ' '.join(rep.reason))]
    assert all(2.**k <= 65504 for k in advised), advised # it advised a static 2**44
    for k in advised: tiny_loss_learner().to_mixed(torch.float16, loss_scale=2.**k)
    assert "use loss_scale='dynamic'" in rep.reason[0]

@pytest.mark.parametrize('lr', [float('nan'), float('inf'), -1e-3, slice(1e-4, float('nan'))])
def test_a_learning_rate_that_would_ruin_the_weights_is_refused_naming_it(lr):
    "fit(lr=nan) turned every weight NaN at the first step, and the error that followed blamed the scale"
    from intact import assert_fp32_and_intact
    learn = synth_learner().to_mixed(torch.bfloat16)
    before = [p.detach().clone() for p in learn.model.parameters()]
    with pytest.raises(ValueError, match=r'fit\(lr=.*the learning rate must be a finite number >= 0'): learn.fit(1, lr)
    assert all(torch.equal(a, b) for a,b in zip(before, learn.model.parameters()))
    assert_fp32_and_intact(learn)
