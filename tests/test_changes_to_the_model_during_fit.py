"""What a callback does to the model during a fit reaches the FP32 model as in FP32 training:
`requires_grad` switched mid-fit, and weight constraints written in place (clamp, max-norm).

Each test fits `synth_model` twice on the same seed, in FP32 and under `to_mixed()`, with the same callback."""
import pytest, torch
from torch import nn
from fastai.basics import Callback, SGD, Adam, CancelEpochException, CancelTrainException, CancelStepException
from fastai.callback.training import ShortEpochCallback
from mpcallbacks.test_utils import synth_learner
from like_fp32 import fit_once, assert_like_fp32, update_cosine

BF16, FP16 = dict(dtype=torch.bfloat16), dict(dtype=torch.float16)
CONV, BN, LIN = 0, 1, 4 # layers of synth_model: Conv2d, BatchNorm2d, ReLU, Flatten, Linear

def all_params(m): return [list(m.parameters())] # the optimizer holds frozen parameters too, as after `learn.freeze()`
def two_groups(m): return [list(m[:2].parameters()), list(m[2:].parameters())]

# ---- requires_grad switched during a fit

class AtBatch(Callback):
    "Call `f(learn)` after training batch `at` of epoch 0"
    order = 50
    def __init__(self, f, at=3): self.f,self.at = f,at
    def after_batch(self):
        if self.training and self.epoch == 0 and self.iter == self.at: self.f(self.learn)

def frozen_conv(splitter, freeze):
    def make():
        learn = synth_learner(splitter=splitter)
        freeze(learn)
        return learn
    return make

UNFREEZES = {
    # fastai's way: `learn.freeze()` before the fit, `learn.unfreeze()` mid-epoch (the optimizer switches its own tensors)
    'learn.unfreeze': (two_groups, lambda l: l.freeze(), lambda l: l.unfreeze()),
    # by hand: the layer's parameters, as the model holds them now, get requires_grad back
    'layer.requires_grad_': (all_params, lambda l: l.model[CONV].requires_grad_(False),
                             lambda l: l.model[CONV].requires_grad_(True)),
}

@pytest.mark.parametrize('how', list(UNFREEZES))
def test_cast_layer_unfrozen_mid_epoch_then_trains_as_in_fp32(how):
    splitter, freeze, unfreeze = UNFREEZES[how]
    make = frozen_conv(splitter, freeze)
    # one epoch (8 batches), unfrozen after batch 3: a layer that only starts training at the next `before_train` fails
    ref = fit_once(make, None, 1, 1e-2, cbs=[AtBatch(unfreeze)])
    mix = fit_once(make, BF16, 1, 1e-2, cbs=[AtBatch(unfreeze)])
    conv = [f'{CONV}.weight', f'{CONV}.bias']
    assert all(not torch.equal(ref.after[n], ref.before[n]) for n in conv), "FP32 itself did not train the unfrozen conv"
    still = [n for n in conv if torch.equal(mix.after[n], mix.before[n])]
    assert not still, f"unfrozen mid-epoch, yet never trained: {still}"
    assert_like_fp32(ref, mix, cos_min=0.9)

class FreezeAt(Callback):
    "Freeze the conv, through the model, at each `event`"
    def __init__(self, event, order):
        self.order = order
        setattr(self, event, lambda: self.learn.model[CONV].requires_grad_(False))

@pytest.mark.parametrize('order', [0, 50], ids=['before_ours', 'after_ours'])
@pytest.mark.parametrize('event', ['before_train', 'before_batch'])
def test_cast_layer_frozen_at_before_train_stays_bit_identical(event, order):
    "A callback freezes the conv at each `event` (before or after ours runs): FP32 leaves it bit-identical"
    make = lambda: synth_learner(splitter=all_params)
    ref = fit_once(make, None, 2, 1e-2, cbs=[FreezeAt(event, order)])
    mix = fit_once(make, BF16, 2, 1e-2, cbs=[FreezeAt(event, order)])
    for run in (ref, mix):
        moved = [n for n in (f'{CONV}.weight', f'{CONV}.bias') if not torch.equal(run.after[n], run.before[n])]
        assert not moved, f"frozen at before_train, yet changed: {moved}"
    assert_like_fp32(ref, mix, cos_min=0.9)

class FreezeThenUnfreeze(Callback):
    "Through the model: freeze the conv at `before_batch` of batch 3 (after ours), unfreeze it at `after_pred` of the same batch"
    order = 50
    def before_batch(self):
        if self.training and self.epoch == 0 and self.iter == 3: self.learn.model[CONV].requires_grad_(False)
    def after_pred(self):
        if self.training and self.epoch == 0 and self.iter == 3: self.learn.model[CONV].requires_grad_(True)

def test_frozen_at_rest_then_unfrozen_in_the_forward_trains_on():
    "The last change wins, on whichever side the model held at the time (the freeze stuck)"
    make = lambda: synth_learner(opt_func=SGD)
    ref = fit_once(make, None, 1, 1e-1, cbs=[FreezeThenUnfreeze()])
    mix = fit_once(make, BF16, 1, 1e-1, cbs=[FreezeThenUnfreeze()])
    assert ref.learn.model[CONV].weight.requires_grad and mix.learn.model[CONV].weight.requires_grad
    assert_like_fp32(ref, mix, cos_min=0.9)

def test_fp32_norm_layer_unfrozen_mid_epoch_steps_as_in_fp32_in_float16():
    """BatchNorm stays FP32 and is frozen; unfrozen mid-epoch, its SGD step (plain SGD: the step is proportional to the
    gradient) equals FP32's within 5%, not the loss scale (65,536) times it"""
    def make():
        learn = synth_learner(splitter=all_params, opt_func=SGD)
        learn.model[BN].requires_grad_(False)
        return learn
    unfreeze = lambda l: l.model[BN].requires_grad_(True)
    ref = fit_once(make, None, 1, 1e-2, cbs=[AtBatch(unfreeze)])
    mix = fit_once(make, FP16, 1, 1e-2, cbs=[AtBatch(unfreeze)])
    for n in (f'{BN}.weight', f'{BN}.bias'):
        step32 = (ref.after[n] - ref.before[n]).norm().item()
        step16 = (mix.after[n] - mix.before[n]).norm().item()
        assert step32 > 0, f"FP32 did not step {n}"
        assert abs(step16 / step32 - 1) <= 0.05, f"{n}: step {step16:.3g}, FP32 {step32:.3g} ({step16/step32:.4g}x)"
    assert_like_fp32(ref, mix, cos_min=0.9)

# ---- weight constraints written by a callback, in place, into the model's weights

class Constrain(Callback):
    "Keep the Linear layer's weights within `c` (clamp: each |w|; max_norm: each row's 2-norm) at `event`, counting the hits"
    order = 50
    def __init__(self, event, how, c):
        self.how,self.c,self.hits = how,c,0
        setattr(self, event, self._constrain)
    def _constrain(self):
        if not self.training: return
        w = self.learn.model[LIN].weight
        with torch.no_grad():
            if self.how.startswith('clamp'):
                self.hits += int((w.abs() > self.c).any())
                (w.data if self.how == 'clamp.data' else w).clamp_(-self.c, self.c) # `.data`: as WGAN's clip writes
            else:
                self.hits += int((w.float().norm(dim=1) > self.c).any())
                w.copy_(torch.renorm(w, 2, 0, self.c))

def worst(how, w): return (w.abs().max() if how.startswith('clamp') else w.norm(dim=1).max()).item()

# `before_batch` at order 50 runs after ours: the model must still hold the masters then, up to the forward
@pytest.mark.parametrize('event', ['after_step', 'after_batch', 'before_batch'])
@pytest.mark.parametrize('how,c', [('clamp', 0.03), ('clamp.data', 0.03), ('max_norm', 0.5)])
def test_weight_constraint_written_by_a_callback_holds_on_the_fp32_model_after_fit(event, how, c):
    make = lambda: synth_learner(opt_func=Adam)
    cb32, cb16 = Constrain(event, how, c), Constrain(event, how, c)
    ref = fit_once(make, None, 2, 1e-2, cbs=[cb32])
    mix = fit_once(make, BF16, 2, 1e-2, cbs=[cb16])
    assert cb32.hits > 3 and cb16.hits > 3, f"the constraint never bound (hits: FP32 {cb32.hits}, mixed {cb16.hits})"
    w32, w16 = ref.after[f'{LIN}.weight'], mix.after[f'{LIN}.weight']
    if event != 'before_batch': # (before_batch: the last batch steps after the constraint, in FP32 too)
        assert worst(how, w32) <= c * (1 + 1e-6), f"FP32 itself breaks the constraint: {worst(how, w32)}"
    if event == 'before_batch': # the last batch stepped after the constraint, in FP32 as in mixed: compare with FP32's
        assert worst(how, w16) <= worst(how, w32) * 1.2, f"{how} {c}: the FP32 model after fit has {worst(how, w16):.4f} (FP32: {worst(how, w32):.4f})"
    else: # written into the masters themselves, between batches: it holds exactly, as in FP32
        assert worst(how, w16) <= c * (1 + 1e-6), f"{how} {c}: the FP32 model after fit has {worst(how, w16):.4f} (FP32: {worst(how, w32):.4f})"
    assert_like_fp32(ref, mix, cos_min=0.9)

# ---- weights swapped for validation (an EMA), and a forward run by a callback between batches

class SwapForValidation(Callback):
    "Keep an average of the weights; validate on it: load it at `before_validate`, put the trained weights back after"
    order = 0 # before ours, at `after_validate` too: the trained weights must go back into the masters
    def before_fit(self): self.avg = None
    def after_step(self):
        sd = {k:v.detach().clone() for k,v in self.learn.model.state_dict().items()}
        self.avg = sd if self.avg is None else {k:(a.lerp_(sd[k], 0.5) if a.is_floating_point() else sd[k]) for k,a in self.avg.items()}
    def before_validate(self):
        if self.avg is None: return
        self.trained = {k:v.detach().clone() for k,v in self.learn.model.state_dict().items()}
        with torch.no_grad():
            for k,p in self.learn.model.named_parameters(): p.copy_(self.avg[k])
    def after_validate(self):
        if self.avg is None: return
        with torch.no_grad():
            for k,p in self.learn.model.named_parameters(): p.copy_(self.trained[k])

def test_weights_swapped_for_validation_and_put_back_leave_the_trained_masters():
    make = lambda: synth_learner(opt_func=Adam)
    ref = fit_once(make, None, 3, 1e-2, cbs=[SwapForValidation()])
    mix = fit_once(make, BF16, 3, 1e-2, cbs=[SwapForValidation()])
    plain = fit_once(make, BF16, 3, 1e-2)
    # validating on the average changes nothing about training: the weights after fit are those of a plain fit
    assert all(torch.equal(mix.after[n], plain.after[n]) for n in plain.after)
    assert_like_fp32(ref, mix, cos_min=0.9)

class SampleThenConstrain(Callback):
    "At the end of each epoch: run the model on a batch (samples for a report), then clamp the linear layer"
    order = 50
    def __init__(self, grad=False): self.grad = grad
    def after_epoch(self):
        with torch.set_grad_enabled(self.grad): self.learn.model(self.learn.dls.valid.one_batch()[0])
        w = self.learn.model[LIN].weight
        with torch.no_grad(): w.clamp_(-0.02, 0.02)

@pytest.mark.parametrize('grad', [False, True], ids=['no_grad', 'with_grad'])
def test_a_forward_between_batches_then_a_write_reaches_the_masters(grad):
    "With gradients on too (a callback that forgets `torch.no_grad()`): the model rests as soon as the call returns"
    make = lambda: synth_learner(opt_func=Adam)
    ref = fit_once(make, None, 2, 1e-2, cbs=[SampleThenConstrain(grad)])
    mix = fit_once(make, BF16, 2, 1e-2, cbs=[SampleThenConstrain(grad)])
    assert worst('clamp', ref.after[f'{LIN}.weight']) <= 0.02
    assert worst('clamp', mix.after[f'{LIN}.weight']) <= 0.02 * (1 + 1e-6)

# ---- cancels, reads and calls between batches: the model rests, and the result is FP32's

class StopAt(Callback):
    "Raise `exc` from `after_pred` of the 4th training batch (a time budget)"
    def __init__(self, exc): self.exc = exc
    def after_pred(self):
        if self.training and self.iter == 3: raise self.exc()

class ClampLin(Callback):
    "Clamp the linear layer's weight to 0.02 at `event`"
    order = 50
    def __init__(self, event): setattr(self, event, self._clamp)
    def _clamp(self):
        with torch.no_grad(): self.learn.model[LIN].weight.clamp_(-0.02, 0.02)

@pytest.mark.parametrize('exc,event', [(CancelEpochException, 'after_epoch'), (CancelTrainException, 'after_train'),
                                       (CancelTrainException, 'before_validate')], ids=['epoch', 'train', 'train-validate'])
def test_a_write_after_a_phase_cancelled_mid_batch_reaches_the_masters(exc, event):
    make = lambda: synth_learner(opt_func=Adam)
    ref = fit_once(make, None, 1, 1e-2, cbs=[StopAt(exc), ClampLin(event)])
    mix = fit_once(make, BF16, 1, 1e-2, cbs=[StopAt(exc), ClampLin(event)])
    assert worst('clamp', ref.after[f'{LIN}.weight']) <= 0.02 * (1 + 1e-6)
    assert worst('clamp', mix.after[f'{LIN}.weight']) <= 0.02 * (1 + 1e-6)

def test_weights_swapped_for_a_validation_cut_short_are_put_back_into_the_masters():
    "`ShortEpochCallback(short_valid=True)` cancels the validation from `after_batch`: the EMA swap still leaves the fit alone"
    make = lambda: synth_learner(opt_func=Adam)
    short = lambda: ShortEpochCallback(pct=0.4, short_valid=True)
    mix = fit_once(make, BF16, 3, 1e-2, cbs=[SwapForValidation(), short()])
    plain = fit_once(make, BF16, 3, 1e-2, cbs=[short()])
    assert all(torch.equal(mix.after[n], plain.after[n]) for n in plain.after)

def test_reading_a_parametrized_weight_between_batches_wakes_nothing():
    "A parametrization runs when its weight is read; between batches it computes from the masters, and a write after it holds"
    def make():
        learn = synth_learner(opt_func=Adam)
        learn.model[LIN] = nn.utils.parametrizations.weight_norm(learn.model[LIN])
        return learn
    class ReadThenCap(Callback):
        order = 50
        def after_step(self):
            self.dtype = self.learn.model[LIN].weight.dtype # as a logger reads it
            with torch.no_grad(): self.learn.model[LIN].parametrizations.weight.original0.clamp_(max=0.05)
    cb32, cb16 = ReadThenCap(), ReadThenCap()
    ref, mix = fit_once(make, None, 1, 1e-2, cbs=[cb32]), fit_once(make, BF16, 1, 1e-2, cbs=[cb16])
    g = f'{LIN}.parametrizations.weight.original0'
    assert ref.after[g].max() <= 0.05 and mix.after[g].max() <= 0.05, (ref.after[g].max(), mix.after[g].max())
    assert cb16.dtype == torch.float32

@pytest.mark.parametrize('call', ['model', 'layer'])
def test_a_call_outside_a_batch_returns_fp32_and_a_write_after_it_holds(call):
    class SampleThenClamp(Callback):
        order = 50
        def after_epoch(self):
            x = self.learn.dls.valid.one_batch()[0]
            with torch.no_grad(): out = self.learn.model(x) if call == 'model' else self.learn.model[CONV](x)
            self.dtype, self.arr = out.dtype, out.float().numpy()
            with torch.no_grad(): self.learn.model[LIN].weight.clamp_(-0.02, 0.02)
    cb = SampleThenClamp()
    mix = fit_once(lambda: synth_learner(opt_func=Adam), BF16, 2, 1e-2, cbs=[cb])
    assert cb.dtype == torch.float32
    assert worst('clamp', mix.after[f'{LIN}.weight']) <= 0.02 * (1 + 1e-6)

def test_a_backward_outside_a_batch_fills_the_models_gradients_and_leaves_training_alone():
    "A diagnostic at the end of each epoch: forward, backward, read the gradients, zero them"
    class GradNorms(Callback):
        order = 50
        def after_epoch(self):
            x, y = self.learn.dls.valid.one_batch()
            self.learn.model.zero_grad()
            self.learn.loss_func(self.learn.model(x), y).backward()
            self.norms = [None if p.grad is None else p.grad.float().norm().item() for p in self.learn.model.parameters()]
            self.learn.model.zero_grad()
    cb = GradNorms()
    make = lambda: synth_learner(opt_func=SGD)
    mix = fit_once(make, BF16, 2, 1e-1, cbs=[cb])
    plain = fit_once(make, BF16, 2, 1e-1)
    assert None not in cb.norms and all(n > 0 for n in cb.norms), cb.norms
    assert all(torch.equal(mix.after[n], plain.after[n]) for n in plain.after)

def test_a_step_cancelled_before_ours_drops_its_gradients_as_fp32_does():
    "fastai zeroes the gradients after a cancelled step: the next step must not add them up"
    class SkipOddSteps(Callback):
        order = 0
        def before_step(self):
            if self.iter % 2 == 1: raise CancelStepException()
    make = lambda: synth_learner(opt_func=SGD)
    ref = fit_once(make, None, 1, 1e-1, cbs=[SkipOddSteps()])
    mix = fit_once(make, BF16, 1, 1e-1, cbs=[SkipOddSteps()])
    norm = lambda r: sum((r.after[n] - r.before[n]).norm()**2 for n in r.after)**.5
    assert abs(norm(mix) / norm(ref) - 1) < 0.02, (norm(mix), norm(ref)) # adding up the dropped gradients: 1.7x
    assert update_cosine(ref, mix) > 0.99
