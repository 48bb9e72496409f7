"""Optimizer steps: a fused torch optimizer skips flagged steps in its kernel, with no host sync, exactly as
`torch.amp.GradScaler` drives it; fastai's `Adam`/`SGD` step through torch's fused kernels with fastai's state."""
import math
from functools import partial
import pytest, torch
from fastai.basics import Callback, OptimWrapper, Adam, SGD, CancelStepException
import fastai.callback.schedule # fit_one_cycle
from mpcallbacks.callback import MasterMixedPrecision
from mpcallbacks.checkpoint import OptimizerWithScaler
from mpcallbacks.scaler import NonFiniteGradients
from mpcallbacks.test_utils import synth_learner, opt_params, InjectNonFinite, count_syncs, lagging_flags

pytestmark = pytest.mark.filterwarnings('ignore:float16 math is emulated')
fused_adamw = partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True))

def syncs_of(learn, epochs=2, **kwargs) -> int:
    with count_syncs() as n: learn.fit(epochs, 1e-3, **kwargs)
    return sum(n.values())

@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_fused_optimizer_adds_no_host_sync_per_step(dtype):
    "With CUDA's rules (flags landing a step late in pinned memory, counted as CUDA syncs): none per step, one wait per fit at most, for the flag still on its way at its end"
    extra = []
    for epochs in (2, 4):
        fp32 = syncs_of(synth_learner(opt_func=fused_adamw), epochs)
        learn = synth_learner(opt_func=fused_adamw).to_mixed(dtype)
        extra.append(syncs_of(learn, epochs) - fp32)
        assert learn.master_mixed_precision.scaler.pending_steps == 0
        assert len(learn.master_mixed_precision.scaler.history) == 8 * epochs
    assert extra[0] == extra[1] <= 1, f"{extra} syncs beyond FP32's over 16 and 32 steps"

@pytest.mark.parametrize('lag,waits', [(0, 0), (2, 1), (10**6, 3)])
def test_flags_are_read_as_they_land_and_waited_for_only_at_the_end_or_25_behind(lag, waits):
    "A device `lag` steps behind the host: the host waits for its flags only at the fit's end, or when 25 are on their way"
    fp32 = syncs_of(synth_learner(opt_func=fused_adamw), epochs=8)
    learn = synth_learner(opt_func=fused_adamw).to_mixed(torch.float16)
    with lagging_flags(lag): extra = syncs_of(learn, epochs=8) - fp32 # 64 steps
    assert extra == waits and len(learn.master_mixed_precision.scaler.history) == 64

@pytest.mark.parametrize('lag', [0, 2])
def test_skips_under_a_fused_optimizer_add_no_host_sync(lag):
    "The skipped step's loss comes to the host with its flag: the fit says whether it was finite with no read of its own"
    fp32 = syncs_of(synth_learner(opt_func=fused_adamw), epochs=8)
    learn = synth_learner(opt_func=fused_adamw).to_mixed(torch.float16, init_scale=2.**10)
    with lagging_flags(lag): extra = syncs_of(learn, epochs=8, cbs=InjectNonFinite(at=[5, 40])) - fp32
    assert learn.master_mixed_precision.skipped == 2
    assert extra == (1 if lag else 0) # (a device behind the host: one wait, at the fit's end)
    assert math.isfinite(learn.master_mixed_precision.mixed_fit.skip_loss) # the first skip's loss, known on the host (finite: the inf was in a gradient)

def test_flags_that_land_late_record_the_same_steps_and_scale():
    res = []
    for lag in (0, 2, 10**6):
        learn = synth_learner(opt_func=fused_adamw).to_mixed(torch.float16, init_scale=2.**10, growth_interval=10)
        with lagging_flags(lag): learn.fit(8, 1e-3, cbs=InjectNonFinite(at=[5, 40]))
        scaler = learn.master_mixed_precision.scaler
        res.append((list(scaler.history), scaler.scale, scaler.skipped, [p.detach().clone() for p in learn.model.parameters()]))
    assert [i for i,(_,k) in enumerate(res[0][0]) if k] == [5, 40]
    assert res[0][1] == 2.**10 / 2 * 2**3 / 2 * 2**2 # 34 good steps between the skips, 23 after: growths every 10
    for r in res[1:]:
        assert r[:3] == res[0][:3]
        assert all(torch.equal(a, b) for a,b in zip(r[3], res[0][3])) # the same steps taken, bit for bit

@pytest.mark.parametrize('lag', [0, 2])
@pytest.mark.cpu_rules('flags') # (lag 0: a CPU's flags, host memory already)
def test_a_step_the_host_knows_finite_is_taken_with_no_flag_in_the_kernel(lag, monkeypatch):
    "A CPU's flag is read from memory as the step begins: a finite step's kernel needs no flag (nor torch its undo of the step counts); a skip, or a flag still on its way, gives the kernel the flag"
    flagged,step = [],torch.optim.AdamW.step
    def spy(self, *args, **kwargs):
        flagged.append(getattr(self, 'found_inf', None) is not None)
        return step(self, *args, **kwargs)
    monkeypatch.setattr(torch.optim.AdamW, 'step', spy)
    learn = synth_learner(opt_func=fused_adamw).to_mixed(torch.float16, init_scale=2.**10)
    if lag:
        with lagging_flags(lag): learn.fit(2, 1e-3, cbs=InjectNonFinite(at=[5]))
    else: learn.fit(2, 1e-3, cbs=InjectNonFinite(at=[5]))
    assert flagged == ([i == 5 for i in range(16)] if lag == 0 else [True]*16)
    assert [k for _,k in learn.master_mixed_precision.scaler.history] == [i == 5 for i in range(16)]

@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_on_cuda_the_flags_come_back_with_no_wait_per_step():
    def fit(mixed:bool):
        learn = synth_learner(opt_func=fused_adamw)
        learn.dls.cuda(); learn.model.cuda()
        if mixed: learn.to_mixed(torch.float16)
        return syncs_of(learn, epochs=8),learn
    (fp32,_),(n,learn) = fit(False),fit(True)
    assert n - fp32 <= 1 # at most one wait, at the fit's end, for the flags still on their way
    scaler = learn.master_mixed_precision.scaler
    assert len(scaler.history) == 64 and scaler.skipped == 0

def test_a_non_fused_optimizer_reads_the_flag_once_per_step():
    fp32 = syncs_of(synth_learner(opt_func=partial(OptimWrapper, opt=torch.optim.AdamW)))
    extra = syncs_of(synth_learner(opt_func=partial(OptimWrapper, opt=torch.optim.AdamW)).to_mixed(torch.float16)) - fp32
    assert extra == 16

class RecordGrads(Callback):
    "The unscaled gradients each step hands the optimizer, and the scale its backward used"
    order = MasterMixedPrecision.order + 1
    def before_fit(self): self.steps = []
    def before_backward(self): self.scale = float(self.learn.master_mixed_precision.scaler.scale_now())
    def before_step(self): self.steps.append(([p.grad.detach().clone() for p in opt_params(self.learn)], self.scale))

def test_skips_are_bit_identical_to_gradscaler_driving_the_same_fused_optimizer():
    learn = synth_learner(opt_func=fused_adamw, wd=0.)
    init = [p.detach().clone() for p in opt_params(learn.create_opt() or learn)]
    learn.to_mixed(torch.float16, init_scale=2.**10, growth_interval=3)
    rec = RecordGrads()
    learn.fit(2, 1e-2, cbs=[InjectNonFinite(at=[1, 2, 9]), rec])
    hist = list(learn.master_mixed_precision.scaler.history)
    assert [i for i,(_,k) in enumerate(hist) if k] == [1, 2, 9]
    # torch's own recipe on the same gradients: scale, unscale_, step (the fused kernel skips), update
    ps = [torch.nn.Parameter(p.clone()) for p in init]
    opt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0., fused=True)
    gs = torch.amp.GradScaler('cpu', init_scale=2.**10, growth_interval=3)
    for (grads, scale),(s,_) in zip(rec.steps, hist):
        assert gs.scale(torch.ones(())).item() == scale == s
        for p,g in zip(ps, grads): p.grad = g * scale # the gradients as the scaled backward left them
        gs.unscale_(opt); gs.step(opt); gs.update()
    for a,b in zip(opt_params(learn), ps): assert torch.equal(a, b)
    theirs = [opt.state[p] for p in ps]
    ours = [learn.opt.opt.opt.state[p] for p in opt_params(learn)]
    for a,b in zip(ours, theirs):
        for k in ('exp_avg', 'exp_avg_sq', 'step'): assert torch.equal(a[k], b[k]), k
    assert learn.master_mixed_precision.loss_scale == gs.get_scale()

@pytest.mark.parametrize('lag', [0, 1])
def test_a_storm_under_a_fused_optimizer_stops_the_fit(lag):
    learn = synth_learner(opt_func=fused_adamw).to_mixed(torch.bfloat16, max_consecutive_skips=3)
    before = [p.detach().clone() for p in learn.model.parameters()]
    with pytest.raises(NonFiniteGradients, match='optimizer steps in a row'), lagging_flags(lag):
        learn.fit(8, 1e-2, cbs=InjectNonFinite(at=range(1000)))
    assert learn.master_mixed_precision.skipped == 3 + lag # each flag read as it lands: the storm is seen at its third skip's, `lag` steps later
    for a,b in zip(before, learn.model.parameters()): assert torch.equal(a, b) # no step wrote, BatchNorm's weights included

class CancelEveryOtherStep(Callback):
    order = MasterMixedPrecision.order + 1
    def before_fit(self): self.n = 0
    def before_step(self):
        self.n += 1
        if self.n % 2 == 0: raise CancelStepException() # (the last step too: nothing after it would clear a guard left behind)

def test_a_step_another_callback_cancels_leaves_the_optimizer_unguarded():
    learn = synth_learner(opt_func=fused_adamw).to_mixed(torch.float16)
    learn.fit(1, 1e-3, cbs=CancelEveryOtherStep())
    assert isinstance(learn.opt, OptimizerWithScaler) and learn.opt._guard is None
    assert len(learn.master_mixed_precision.scaler.history) == 4 # the steps taken: cancelled ones are not counted

# ---- fastai's Adam and SGD on the fused kernels

@pytest.mark.parametrize('opt_func', [Adam, partial(Adam, decouple_wd=False), partial(SGD, mom=0.9), SGD])
def test_fastai_optimizers_train_as_their_own_step_does(opt_func, monkeypatch):
    learn = synth_learner(opt_func=opt_func).to_mixed(torch.bfloat16)
    learn.fit_one_cycle(2, 1e-2) # lr and mom scheduled at every step
    with monkeypatch.context() as m: # the same fit, fastai's own step
        m.setattr('mpcallbacks.fused.fused_kind', lambda opt: None)
        ref = synth_learner(opt_func=opt_func).to_mixed(torch.bfloat16)
        ref.fit_one_cycle(2, 1e-2)
    # each step agrees to float rounding (the notebook shows 1e-7); 16 steps of bfloat16 forwards amplify it
    for a,b in zip(opt_params(learn), opt_params(ref)): torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-4)
    sa,sb = learn.opt.state_dict()['state'],ref.opt.state_dict()['state']
    assert [sorted(s) for s in sa] == [sorted(s) for s in sb]
    assert all(type(s.get('step', 0)) is int for s in sa)

@pytest.mark.parametrize('skips', [[0], [0, 1, 2]], ids=['first', 'first_three'])
def test_fused_sgd_with_momentum_after_skipped_first_steps_steps_as_the_unfused_one(skips):
    """torch's fused SGD makes its momentum buffers with `empty_like` at its first step and leaves them unwritten when the flag
    skips it (recycled memory on CUDA, emulated here): until they exist, the flag is read on the host. (torch's fused and
    foreach SGD differ in FP32's last bit by themselves: 1.2e-7 after 10 plain FP32 steps, measured; here within 1e-6)"""
    def fit(fused):
        opt = partial(OptimWrapper, opt=partial(torch.optim.SGD, momentum=0.9, fused=fused))
        learn = synth_learner(opt_func=opt).to_mixed(torch.float16, init_scale=2.**10)
        learn.fit(2, 1e-2, cbs=InjectNonFinite(at=skips))
        return learn
    a,b = fit(True),fit(False)
    assert a.master_mixed_precision.skipped == b.master_mixed_precision.skipped == len(skips)
    assert all(torch.isfinite(p).all() for p in a.model.parameters())
    for p,q in zip(a.model.parameters(), b.model.parameters()): torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
