"Scaling and masters: the scale's trajectory, underflow, master accumulation, skipping, dtypes, arguments."
import re
from collections import defaultdict
from functools import partial
import pytest, torch
from torch import nn, Tensor
from fastai.callback.progress import ProgressCallback
from fastai.basics import (Learner, Callback, DataLoaders, CancelFitException, CrossEntropyLossFlat,
                           accuracy, set_seed, SGD, Adam, OptimWrapper)
import fastai.callback.schedule # fit_one_cycle
from mpcallbacks.callback import MasterMixedPrecision
from mpcallbacks.test_utils import synth_learner, synth_dls, opt_params, InjectNonFinite

# ---- the scaler against torch.amp.GradScaler, through a real fit

def gradscaler_trajectory(skips, init, growth, backoff, interval):
    "The scale torch's GradScaler uses at each step, fed the same inf/NaN verdicts"
    p = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([p], lr=0.)
    gs = torch.amp.GradScaler('cpu', init_scale=init, growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    res = []
    for skip in skips:
        res.append(gs.scale(torch.ones(())).item())
        p.grad = torch.tensor([float('inf') if skip else 1., 1.])
        gs.step(opt); gs.update()
    return res, gs.get_scale(), gs._get_growth_tracker()

@pytest.mark.parametrize('init,growth,backoff,interval', [(2.**10, 2., .5, 3), (1000., 1.5, .25, 2)])
def test_scaler_trajectory_equals_gradscaler(init, growth, backoff, interval):
    learn = synth_learner().to_mixed(torch.float16, init_scale=init, growth_factor=growth, backoff_factor=backoff, growth_interval=interval, min_scale=2.**-20) # (a floor out of reach: GradScaler has none)
    inject = InjectNonFinite(at=[1, 2, 9, 15], value=float('nan'))
    learn.fit(2, 1e-2, cbs=inject)
    hist = learn.master_mixed_precision.scaler.history
    assert len(hist) == 16 # 256 items / bs 32, two epochs
    skips = [s for _, s in hist]
    assert [i for i, s in enumerate(skips) if s] == [1, 2, 9, 15]
    theirs, final, tracker = gradscaler_trajectory(skips, init, growth, backoff, interval)
    assert [sc for sc, _ in hist] == theirs
    assert learn.master_mixed_precision.loss_scale == final
    assert learn.master_mixed_precision.scaler.growth_tracker == tracker
    assert learn.master_mixed_precision.skipped == 4

def test_scale_grows_after_growth_interval():
    learn = synth_learner().to_mixed(torch.float16, init_scale=4., growth_interval=3)
    learn.fit(1, 1e-3) # 8 good steps
    assert learn.master_mixed_precision.loss_scale == 4. * 2**(8 // 3)
    assert learn.master_mixed_precision.scaler.growth_tracker == 8 % 3

# ---- underflow rescue and master accumulation

class Const(nn.Module):
    "One weight vector; prediction = x @ w"
    def __init__(self, n=4, w=1.): super().__init__(); self.w = nn.Parameter(torch.full((n,), w))
    def forward(self, x): return x @ self.w

def tiny_loss_learner(k, lr_mode='sgd'):
    "Loss = k * mean(pred), with x = 1: every weight's true gradient is exactly k"
    x = torch.ones(64, 4); ds = list(zip(x, torch.zeros(64)))
    dls = DataLoaders.from_dsets(ds, ds[:8], bs=16, num_workers=0, device='cpu')
    learn = Learner(dls, Const(), loss_func=lambda pred, y: k * pred.mean(), opt_func=partial(SGD, mom=0.), wd=0.)
    learn.remove_cb(ProgressCallback)
    return learn

def test_underflow_rescue():
    k, lr = 1e-8, 1e3 # a true gradient of 1e-8 is below float16's smallest subnormal (6e-8)
    assert torch.tensor(k/16, dtype=torch.float16) == 0 # what reaches the weights' backward, per item
    scaled = tiny_loss_learner(k).to_mixed(torch.float16) # dynamic scaling
    scaled.fit(1, lr)
    unscaled = tiny_loss_learner(k).to_mixed(torch.float16, loss_scale=None)
    unscaled.fit(1, lr)
    fp32 = tiny_loss_learner(k); fp32.fit(1, lr)
    assert torch.equal(unscaled.model.w.detach(), torch.ones(4)) # gradients flushed to zero: nothing moved
    moved = 1 - scaled.model.w.detach()
    assert torch.allclose(moved, torch.full((4,), 4 * lr * k), rtol=1e-2) # 4 steps of lr*k
    assert torch.allclose(scaled.model.w.detach(), fp32.model.w.detach(), rtol=0, atol=1e-7)

def test_master_accumulation_moves_weights_pure_float16_cannot():
    k, lr, n_steps = 1e-3, 1e-2, 4*25 # lr*k = 1e-5, a 24th of half a float16 ulp at 1.0
    learn = tiny_loss_learner(k).to_mixed(torch.float16)
    learn.fit(25, lr)
    fp32 = tiny_loss_learner(k); fp32.fit(25, lr)
    assert torch.allclose(1 - learn.model.w.detach(), torch.full((4,), n_steps * lr * k), rtol=1e-2) # FP32 rounding of 1 - 1e-5 steps
    assert torch.allclose(learn.model.w.detach(), fp32.model.w.detach(), rtol=0, atol=1e-7)
    # the same steps in pure float16 do not move the weights at all
    w16 = torch.ones(4, dtype=torch.float16)
    for _ in range(n_steps): w16 -= lr * torch.full((4,), k, dtype=torch.float16)
    assert torch.equal(w16, torch.ones(4, dtype=torch.float16))

# ---- overflow: exactly that step is skipped

def test_inf_skips_exactly_that_step_and_training_goes_on():
    learn = synth_learner().to_mixed(torch.float16, init_scale=2.**12)
    before = {}
    class Snap(Callback):
        order = MasterMixedPrecision.order + 1
        def __init__(self): self.n = 0
        def before_batch(self):
            if self.training and self.n == 5:
                before['w'] = [p.detach().clone() for p in opt_params(self.learn)]
                before['state'] = {i: {k: v.clone() for k, v in self.opt.state[p].items() if isinstance(v, Tensor)} for i, p in enumerate(opt_params(self.learn))}
        def after_batch(self):
            if not self.training: return
            if self.n == 5:
                for a, b in zip(before['w'], opt_params(self.learn)): assert torch.equal(a, b.detach())
                for i, p in enumerate(opt_params(self.learn)):
                    for k, v in before['state'][i].items(): assert torch.equal(v, self.opt.state[p][k])
            self.n += 1
    learn.fit(4, 1e-2, cbs=[InjectNonFinite(at=[5]), Snap()])
    mmp = learn.master_mixed_precision
    assert [i for i, (_, s) in enumerate(mmp.scaler.history) if s] == [5]
    assert mmp.skipped == 1 and mmp.loss_scale == 2.**11
    losses = [v[0] for v in learn.recorder.values]
    assert losses[-1] < losses[0]

def test_check_and_skip_run_in_every_mode():
    for kw in (dict(dtype=torch.bfloat16), dict(dtype=torch.float16, loss_scale=None), dict(dtype=torch.float16, loss_scale=64.)):
        learn = synth_learner().to_mixed(**{'dtype': torch.float16, **kw})
        scale = learn.master_mixed_precision.loss_scale
        learn.fit(1, 1e-2, cbs=InjectNonFinite(at=[2], value=float('nan')))
        assert learn.master_mixed_precision.skipped == 1, kw
        assert learn.master_mixed_precision.loss_scale == scale, kw # static scales never move
        assert all(torch.isfinite(p).all() for p in learn.model.parameters()), kw

def test_recorder_logs_unscaled_loss():
    fp32 = synth_learner(); fp32.fit(1, 1e-2)
    mixed = synth_learner().to_mixed(torch.float16); mixed.fit(1, 1e-2)
    assert mixed.master_mixed_precision.loss_scale == 2.**16
    assert abs(mixed.recorder.values[-1][0] - fp32.recorder.values[-1][0]) < 0.05
    assert max(float(l) for l in mixed.recorder.losses) < 5

# ---- parity on real data

def digits_run(dtype, epochs=4):
    from mpcallbacks.digits import digits_dls, digits_cnn
    dls = digits_dls(seed=0); set_seed(0)
    learn = Learner(dls, digits_cnn(), loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    learn.remove_cb(ProgressCallback)
    if dtype is not None: learn.to_mixed(dtype)
    learn.fit_one_cycle(epochs, 1e-2)
    return learn.recorder.values[-1][2]

def test_parity_on_digits():
    fp32 = digits_run(None)
    assert fp32 > 0.95
    for dt in (torch.float16, torch.bfloat16): assert abs(digits_run(dt) - fp32) <= 0.02, dt

# ---- what other callbacks see, and the optimizer

def inner_opt(opt):
    "The optimizer that holds the state: fastai's (under our `OptimizerWithScaler`), or torch's inside an `OptimWrapper`"
    opt = getattr(opt, 'opt', opt)
    return getattr(opt, 'opt', opt)

class Probe(Callback):
    order = MasterMixedPrecision.order + 1
    def __init__(self): self.seen = defaultdict(set)
    def before_fit(self):
        self._record('before_fit')
        self.hook = self.model[0].register_forward_hook(self._in_forward)
    def _in_forward(self, m, args, out): # inside the forward: the master itself, autocast's 16-bit cast in its op
        if not self.training: self._record('validate')
        self.seen['conv_out'].add(out.dtype)
        self.seen['synced'].add(m.weight is self.opt.param_lists[0][0])
    def after_fit(self): self.hook.remove()
    def after_pred(self):
        self.seen['pred'].add(self.pred.dtype)
        self.seen['masters'].add(self.model[0].weight is self.opt.param_lists[0][0]) # outside the forward: the masters
    def before_step(self):
        self.seen['step_grads'] |= {p.grad.dtype for p in opt_params(self.learn) if p.grad is not None}
        self.seen['clip_view'] |= {p.dtype for p in self.learn.parameters()}
    def after_step(self): self.seen['masters'].add(self.model[0].weight is self.opt.param_lists[0][0])
    def _record(self, k):
        self.seen[k+'_conv'] |= {p.dtype for p in self.model[0].parameters()} | {p.dtype for p in self.model[4].parameters()}
        self.seen[k+'_bn'] |= {p.dtype for p in self.model[1].parameters()} | {b.dtype for b in self.model[1].buffers() if b.is_floating_point()}
        self.seen[k+'_opt'] |= {p.dtype for p in opt_params(self.learn)}
        state = inner_opt(self.opt).state
        self.seen[k+'_state'] |= {v.dtype for p in opt_params(self.learn) for v in state.get(p, {}).values() if isinstance(v, Tensor) and v.is_floating_point()}

@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
@pytest.mark.parametrize('opt_func', [Adam, partial(OptimWrapper, opt=torch.optim.AdamW)], ids=['fastai-Adam', 'OptimWrapper-AdamW'])
def test_dtypes_during_fit(dtype, opt_func):
    learn = synth_learner(opt_func=opt_func).to_mixed(dtype)
    learn.create_opt()
    groups = [[id(p) for p in pg] for pg in learn.opt.param_lists]
    probe = Probe()
    learn.fit(2, 1e-2, cbs=probe)
    s = probe.seen
    assert s['before_fit_conv'] == s['validate_conv'] == {torch.float32} and s['conv_out'] == {dtype} # 16-bit in the forward's ops only
    assert s['before_fit_bn'] == s['validate_bn'] == {torch.float32}
    assert s['before_fit_opt'] == s['validate_opt'] == {torch.float32}
    assert s['validate_state'] == {torch.float32}
    assert s['pred'] == {torch.float32} and s['step_grads'] == {torch.float32} and s['clip_view'] == {torch.float32}
    assert s['synced'] == {True} and s['masters'] == {True}
    # after fit: the same groups, in the same order, holding the model's own (FP32) parameters
    assert [[id(p) for p in pg] for pg in learn.opt.param_lists] == groups
    assert opt_params(learn) == list(learn.model.parameters())
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}

def test_param_groups_keep_number_sizes_order_during_fit():
    learn = synth_learner(splitter=lambda m: [list(m[:2].parameters()), list(m[2:].parameters())]).to_mixed(torch.float16)
    learn.create_opt()
    sizes = [[p.shape for p in pg] for pg in learn.opt.param_lists]
    seen = {}
    class Look(Callback):
        order = MasterMixedPrecision.order + 1
        def before_train(self): seen['sizes'] = [[p.shape for p in pg] for pg in self.opt.param_lists]; seen['n'] = len(self.opt.param_lists)
    learn.fit(1, 1e-2, cbs=Look())
    assert seen == {'sizes': sizes, 'n': 2}

# ---- the state after fit, also after an exception

def test_second_fit_continues_with_scaler_state():
    learn = synth_learner().to_mixed(torch.float16, init_scale=2.**8, growth_interval=5)
    learn.fit(1, 1e-2, cbs=InjectNonFinite(at=[0]))
    state = learn.master_mixed_precision.scaler.state_dict()
    assert len(state.pop('history')) >= 1
    assert state == {'scale': 2.**7 * 2, 'growth_tracker': 2, 'skipped': 1, 'consecutive_skips': 0, 'dynamic': True, 'growth_interval': 5} # 1 skip, 7 good steps
    learn.fit(1, 1e-2) # 8 more good steps: the counter goes on from 2
    assert learn.master_mixed_precision.skipped == 1
    assert learn.master_mixed_precision.loss_scale == 2.**7 * 2**3 and learn.master_mixed_precision.scaler.growth_tracker == 0
    assert len(learn.master_mixed_precision.scaler.history) == 16

# ---- errors and idempotence

@pytest.mark.parametrize('kwargs,err,msg', [
    (dict(dtype=torch.float32), ValueError, 'torch.float16 or torch.bfloat16'),
    (dict(dtype=torch.int8), ValueError, 'torch.float16 or torch.bfloat16'),
    (dict(dtype='fp8'), ValueError, 'Unknown dtype'),
    (dict(dtype=3), TypeError, 'torch.dtype'),
    (dict(loss_scale=0), ValueError, 'positive finite'),
    (dict(loss_scale=-2.), ValueError, 'positive finite'),
    (dict(loss_scale=float('nan')), ValueError, 'positive finite'),
    (dict(loss_scale=float('inf')), ValueError, 'positive finite'),
    (dict(loss_scale='static'), ValueError, "'dynamic'"),
    (dict(loss_scale=[1]), TypeError, 'positive number'),
    (dict(growth_factor=1.), ValueError, 'growth_factor must be > 1'),
    (dict(backoff_factor=0.), ValueError, 'backoff_factor must be in (0, 1)'),
    (dict(backoff_factor=1.), ValueError, 'backoff_factor must be in (0, 1)'),
    (dict(growth_interval=0), ValueError, 'growth_interval'),
    (dict(dtype=torch.bfloat16, backoff_factor=2.), ValueError, 'backoff_factor must be in (0, 1)'), # unused by bfloat16's
    (dict(loss_scale=64., growth_factor=.5), ValueError, 'growth_factor must be > 1'),               # and a static scale
    (dict(init_scale=0.), ValueError, 'positive finite'),
])
def test_bad_arguments_fail_at_to_mixed(kwargs, err, msg):
    learn = synth_learner()
    with pytest.raises(err, match=re.escape(msg)): learn.to_mixed(**{'dtype': torch.float16, **kwargs})
    assert not any(isinstance(c, MasterMixedPrecision) for c in learn.cbs)

def test_to_mixed_twice_leaves_one_callback_with_later_settings():
    learn = synth_learner().to_mixed(torch.float16, init_scale=8.).to_mixed(torch.bfloat16, loss_scale=32.)
    cbs = [c for c in learn.cbs if isinstance(c, MasterMixedPrecision)]
    assert len(cbs) == 1 and cbs[0] is learn.master_mixed_precision
    assert cbs[0].dtype == torch.bfloat16 and cbs[0].loss_scale == 32. and not cbs[0].scaler.dynamic
    learn.fit(1, 1e-2)
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}
    assert learn.to_unmixed() is learn and not any(isinstance(c, MasterMixedPrecision) for c in learn.cbs)

def test_loss_scale_defaults_by_dtype():
    learn = synth_learner()
    assert learn.to_mixed(torch.float16).master_mixed_precision.loss_scale == 2.**16
    assert learn.to_mixed(torch.float16).master_mixed_precision.scaler.dynamic
    assert learn.to_mixed(torch.bfloat16).master_mixed_precision.loss_scale == 1.
    assert not learn.master_mixed_precision.scaler.dynamic
    assert learn.to_mixed(torch.bfloat16, loss_scale='dynamic').master_mixed_precision.scaler.dynamic
    assert isinstance(learn.master_mixed_precision.loss_scale, float) and isinstance(learn.master_mixed_precision.skipped, int)

def test_each_weight_is_cast_once_per_forward():
    "The masters -> 16-bit cast is autocast's, once per batch's forward for each weight its ops read (its cache), never outside a forward"
    from torch.utils._python_dispatch import TorchDispatchMode
    from mpcallbacks.test_utils import synth_dls
    class Casts(TorchDispatchMode):
        def __init__(self, params): super().__init__(); self.params,self.n = {id(p) for p in params},0
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and id(args[0]) in self.params and (kwargs or {}).get('dtype') == torch.bfloat16: self.n += 1
            return func(*args, **(kwargs or {}))
    learn = synth_learner().to_mixed(torch.bfloat16)
    learn.dls = synth_dls(bs=16) # 16 training batches, 4 validation batches
    with Casts(learn.model.parameters()) as casts: learn.fit(2, 1e-2)
    n_weights = 4 # the conv's and the linear layer's weight and bias; BatchNorm's are read in FP32
    assert casts.n == 2 * n_weights * (len(learn.dls.train) + len(learn.dls.valid)), casts.n
