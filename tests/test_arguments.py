"Bad `to_mixed` arguments and models that cannot work fail at `to_mixed()` with a message naming the argument or parameter; numpy scalars are numbers; error messages name the true cause."
import math, re
import numpy as np
import pytest, torch
from torch import nn
from fastai.basics import Learner, CrossEntropyLossFlat, Callback
from mpcallbacks.all import MasterMixedPrecision, NonFiniteGradients
from mpcallbacks.test_utils import synth_dls, synth_learner
from test_casting_is_atomic import snapshot, assert_exactly_as_before
from intact import assert_at_rest, hook_ids

bad = [(dict(growth_interval=True), 'growth_interval'),
       (dict(mixed_inference='no'), 'mixed_inference'),
       (dict(loss_scale=None, init_scale=-5), 'init_scale'),
       (dict(loss_scale=1024., init_scale=512.), 'init_scale'), # init_scale only applies to dynamic scaling
       (dict(growth_factor=math.inf), 'growth_factor'),
       (dict(growth_factor='2'), 'growth_factor'),
       (dict(backoff_factor='x'), 'backoff_factor'),
       (dict(min_scale='1'), 'min_scale'),
       (dict(loss_scale='1e4'), 'loss_scale'),
       (dict(loss_scale=-1.), 'loss_scale'),
       (dict(loss_scale=0), 'loss_scale'),
       (dict(loss_scale=math.nan), 'loss_scale'),
       (dict(loss_scale=True), 'loss_scale'),
       (dict(max_consecutive_skips=2.5), 'max_consecutive_skips')]

@pytest.mark.parametrize('kwargs,name', bad, ids=[f'{k}={v!r}' for kw, _ in bad for k, v in [list(kw.items())[-1]]])
def test_bad_argument_fails_at_to_mixed_naming_it(kwargs, name):
    learn = synth_learner()
    with pytest.raises((ValueError, TypeError), match=re.escape(name)): learn.to_mixed(torch.float16, **kwargs)
    assert not any(isinstance(c, MasterMixedPrecision) for c in learn.cbs)

def test_init_scale_with_static_scale_says_it_only_applies_to_dynamic_scaling():
    with pytest.raises((ValueError, TypeError), match='dynamic'): synth_learner().to_mixed(torch.float16, loss_scale=1024., init_scale=512.)

accepted = [('init_scale', np.float32(1024.)), ('init_scale', np.int64(1024)), ('init_scale', np.float64(1024.)),
            ('loss_scale', np.float32(512.)), ('loss_scale', np.int64(512)), ('growth_factor', np.float32(4.)),
            ('backoff_factor', np.float32(.25)), ('growth_interval', np.int64(100)), ('min_scale', np.float32(2.)),
            ('max_consecutive_skips', np.int64(60))]

@pytest.mark.parametrize('name,value', accepted, ids=[f'{n}={type(v).__name__}' for n, v in accepted])
def test_numpy_scalars_are_accepted(name, value):
    learn = synth_learner().to_mixed(torch.float16, **{name: value})
    mmp = learn.master_mixed_precision
    if name in ('init_scale', 'loss_scale'): assert mmp.loss_scale == float(value)
    else: assert getattr(mmp.scaler, name) == value

def test_name_pattern_matching_no_module_warns():
    learn = synth_learner()
    with pytest.warns(UserWarning, match='Linear'): learn.to_mixed(torch.bfloat16, keep_fp32='Linear')

# ---- models that cannot train in mixed precision: refused at to_mixed, naming the parameter, untouched

class Complex(nn.Module):
    def __init__(self): super().__init__(); self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 2)); self.phase = nn.Parameter(torch.zeros(2, dtype=torch.cfloat))
    def forward(self, x): return self.body(x) * self.phase.real.exp()

def float64_model():
    torch.manual_seed(0); return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 2).double())

def shared_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    m[1].bias = m[2].weight # one tensor, a Linear's bias and a BatchNorm's weight
    return m

models = [(float64_model, r'3\.(weight|bias)'), (Complex, 'phase')]

@pytest.mark.parametrize('make,name', models, ids=['float64', 'complex'])
def test_model_that_cannot_work_is_refused_at_to_mixed(make, name):
    model = make()
    learn = Learner(synth_dls(), model, loss_func=CrossEntropyLossFlat())
    snap = snapshot(model)
    with pytest.raises(ValueError, match=name): learn.to_mixed(torch.bfloat16)
    assert not any(isinstance(c, MasterMixedPrecision) for c in learn.cbs)
    assert_exactly_as_before(model, snap)

def test_a_tensor_shared_by_a_16bit_layer_and_a_normalization_trains_as_in_fp32():
    "Every slot holds the FP32 master: the Linear's op casts it, BatchNorm reads it in FP32; one tensor, one gradient, in FP32"
    from like_fp32 import fit_once, assert_like_fp32
    def make(): return Learner(synth_dls(), shared_model(), loss_func=CrossEntropyLossFlat())
    ref, mix = fit_once(make, None, 2, 1e-2),fit_once(make, dict(dtype=torch.bfloat16), 2, 1e-2)
    assert mix.learn.model[1].bias is mix.learn.model[2].weight
    assert_like_fp32(ref, mix, cos_min=0.9)

# ---- NonFiniteGradients names the true cause

def test_overflowing_static_scale_is_named_as_the_cause():
    learn = synth_learner().to_mixed(torch.float16, loss_scale=2.**15, max_consecutive_skips=3)
    learn.loss_func = lambda out, y: nn.functional.cross_entropy(out, y) * 2.**10 # every float16 gradient overflows at 2**15
    hooks = hook_ids(learn.model)
    with pytest.raises(NonFiniteGradients, match='static'): learn.fit(1, 1e-2)
    assert learn.master_mixed_precision.skipped == 3
    assert_at_rest(learn, hooks)

def test_non_finite_weights_are_not_called_the_last_good_weights():
    learn = synth_learner().to_mixed(torch.bfloat16, max_consecutive_skips=3)
    hooks = hook_ids(learn.model)
    with torch.no_grad(): learn.model[4].weight[0, 0] = float('nan') # e.g. from a bad checkpoint
    with pytest.raises(Exception) as e: learn.fit(1, 1e-2) # NonFiniteGradients today; an earlier refusal is fine too
    assert 'last good weights' not in str(e.value), str(e.value)
    assert_at_rest(learn, hooks)

class WrapInDataParallel(Callback):
    "Wraps the model as fastai's `ParallelTrainer` does at `before_fit` (order 0, before ours), as over two GPUs"
    def before_fit(self):
        dp = nn.DataParallel(self.learn.model, device_ids=[])
        dp.device_ids = [0, 1]
        self.learn.model = dp

def test_data_parallel_over_several_gpus_is_refused_naming_ddp():
    "Its replica threads enter autocast in float16 whatever the type: refused at to_mixed, and at a fit that wraps the model"
    learn = synth_learner()
    model = learn.model
    learn.model = nn.DataParallel(model, device_ids=[]); learn.model.device_ids = [0, 1]
    with pytest.raises(ValueError, match='DistributedDataParallel instead'): learn.to_mixed(torch.bfloat16)
    learn.model = model
    learn.to_mixed(torch.bfloat16)
    with pytest.raises(ValueError, match='DistributedDataParallel instead'): learn.fit(1, 1e-2, cbs=WrapInDataParallel())
    learn.model = model # (what fastai's `ParallelTrainer.after_fit` would have given back)
    assert_at_rest(learn)
