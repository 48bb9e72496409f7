"""Behaviours that sat in the gradient phase and the residency of the model, each as FP32 training has it: a callback
that ends the epoch at `after_step`, a backward of a callback's own between batches, a copy of the model between
forward and backward, gradients written by hand at `before_step`, batches without a target."""
import copy, io, pickle
import pytest, torch
from torch import nn
from fastai.basics import Learner, Callback, DataLoaders, CrossEntropyLossFlat, SGD
from fastai.callback.core import CancelTrainException, CancelEpochException
import fastai.callback.schedule # lr_find
from mpcallbacks.callback import MasterMixedPrecision
from mpcallbacks.test_utils import synth_learner, synth_dls, opt_params
from intact import assert_fp32_and_intact

# ---- a "max steps per epoch" callback ends the epoch at after_step (default order: before ours)

class MaxSteps(Callback):
    def __init__(self, n, exc): self.n,self.exc = n,exc
    def after_step(self):
        if self.iter + 1 >= self.n: raise self.exc()

@pytest.mark.parametrize('exc', [CancelTrainException, CancelEpochException])
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_a_callback_ending_the_epoch_at_after_step_leaves_the_next_epoch_as_in_fp32(exc, dtype):
    learn = synth_learner().to_mixed(dtype)
    steps = []
    class Count(Callback):
        order = 100
        def before_step(self): steps.append(self.epoch)
    learn.fit(3, 1e-2, cbs=[MaxSteps(2, exc), Count()])
    assert steps == [0, 0, 1, 1, 2, 2] # every epoch trained its two steps
    assert len(learn.master_mixed_precision.scaler.history) == 6 # and each step was counted for the scale
    assert_fp32_and_intact(learn)

def test_lr_find_with_a_max_steps_callback_gives_the_users_weights_back(tmp_path):
    learn = synth_learner(path=tmp_path).to_mixed(torch.bfloat16)
    learn.fit(1, 1e-2)
    before = [p.detach().clone() for p in learn.model.parameters()]
    learn.add_cb(MaxSteps(3, CancelEpochException))
    learn.lr_find(num_it=12, show_plot=False, suggest_funcs=())
    learn.remove_cb(MaxSteps)
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, learn.model.parameters()))
    assert_fp32_and_intact(learn)

# ---- a backward a callback runs between batches (an auxiliary loss) feeds the next step, unscaled, as in FP32

class WithSpare(nn.Module):
    "`synth_model` and a parameter its forward never uses: only the auxiliary loss gives it a gradient"
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body,self.spare = nn.Sequential(nn.Flatten(), nn.Linear(64, 2)),nn.Parameter(torch.zeros(3))
    def forward(self, x): return self.body(x)

@pytest.mark.parametrize('order', [MasterMixedPrecision.order - 1, MasterMixedPrecision.order + 1], ids=['before_ours', 'after_ours'])
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_a_backward_between_batches_feeds_the_next_step_as_in_fp32(order, dtype):
    seen = []
    class Aux(Callback):
        def after_batch(self):
            if self.training: (self.learn.model.spare * torch.tensor([1., 2., 3.])).sum().backward()
    Aux.order = order
    class Look(Callback): # what the optimizer is about to step on
        order = MasterMixedPrecision.order + 1
        def before_step(self): seen.append(self.learn.model.spare.grad.clone() if self.learn.model.spare.grad is not None else None)
    def fit(mixed):
        seen.clear()
        learn = Learner(synth_dls(), WithSpare(), loss_func=CrossEntropyLossFlat(), opt_func=SGD)
        if mixed: learn.to_mixed(dtype)
        learn.fit(1, 1e-2, cbs=[Aux(), Look()])
        return list(seen), learn.model.spare.detach().clone()
    (g32, w32), (g16, w16) = fit(False), fit(True)
    assert g16[0] is None and torch.equal(g16[1], torch.tensor([1., 2., 3.])) # the first step: none yet; then exactly it
    assert [g is None for g in g16] == [g is None for g in g32] and all(torch.equal(a, b) for a, b in zip(g16[1:], g32[1:]))
    assert torch.equal(w16, w32)

# ---- a copy of the model between the forward and the backward is a plain FP32 model

@pytest.mark.parametrize('how', ['deepcopy', 'torch.save'])
def test_a_copy_of_the_model_taken_at_after_pred_is_a_plain_fp32_model(how):
    learn = synth_learner().to_mixed(torch.bfloat16)
    copies = []
    class Copy(Callback):
        order = MasterMixedPrecision.order + 1
        def after_pred(self):
            if not self.training or copies: return
            if how == 'deepcopy': copies.append(copy.deepcopy(self.learn.model))
            else:
                f = io.BytesIO(); torch.save(self.learn.model, f); f.seek(0)
                copies.append(torch.load(f, weights_only=False))
            self.masters = [p.detach().clone() for p in opt_params(self.learn)]
    cb = Copy()
    learn.fit(1, 1e-2, cbs=cb)
    m = copies[0]
    assert {p.dtype for p in m.parameters()} == {torch.float32}
    assert all(torch.equal(a.detach(), b) for a, b in zip(m.parameters(), cb.masters)) # the masters of that moment
    assert not any(len(getattr(mod, d)) for mod in m.modules() for d in ('_forward_pre_hooks', '_forward_hooks'))
    x = learn.dls.valid.one_batch()[0]
    with torch.no_grad(): assert m(x).dtype == torch.float32
    assert b'mpcallbacks' not in pickle.dumps(m) # loads without the package

# ---- gradients written by hand at before_step (fastai's own `_PutGrad` test callback, default order)

@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_gradients_written_at_before_step_are_stepped_as_written(dtype):
    learn = synth_learner(opt_func=SGD).to_mixed(dtype)
    class PutGrad(Callback):
        def before_step(self):
            for p in self.learn.model.parameters(): p.grad = torch.ones_like(p)
    class OneStep(Callback):
        order = 100
        def after_step(self): raise CancelTrainException()
    w0 = [p.detach().clone() for p in learn.model.parameters()]
    learn.fit(1, 0.1, cbs=[PutGrad(), OneStep()])
    assert all(torch.allclose(p.detach(), w - 0.1) for p, w in zip(learn.model.parameters(), w0)) # lr * 1, unscaled
    assert learn.master_mixed_precision.skipped == 0

# ---- batches without a target

def input_only_dls():
    torch.manual_seed(0)
    x = [(t,) for t in torch.randn(64, 1, 8, 8)]
    return DataLoaders.from_dsets(x, x, bs=16, num_workers=0, device='cpu')

@pytest.mark.parametrize('mixed_inference', [False, True])
def test_batches_without_a_target_predict_and_fit(mixed_inference):
    learn = synth_learner().to_mixed(torch.bfloat16, mixed_inference=mixed_inference) # fresh: no loss of an earlier fit
    test_dl = input_only_dls().valid
    preds, targs = learn.get_preds(dl=test_dl)
    assert preds.shape == (64, 2) and preds.dtype == torch.float32 and targs is None
    learn.dls = input_only_dls()
    learn.fit(1, 1e-2) # fastai runs the forward of input-only batches without a loss
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}

class CancelsFirstBackward(Callback):
    "Cancels the first batch's backward from inside it (a hook raising fastai's `CancelBackwardException`), and records what `before_step` sees"
    order = 5
    def before_fit(self): self.seen,self.cancelled = [],False
    def before_backward(self):
        if self.cancelled: return
        self.cancelled = True
        def cancel(g):
            from fastai.callback.core import CancelBackwardException
            raise CancelBackwardException()
        self.learn.loss_grad.register_hook(cancel)
    def before_step(self):
        ps = list(self.learn.model.parameters())
        self.seen.append(({p.dtype for p in ps}, all(any(p is q for q in opt_params(self.learn)) for p in ps),
                          {p.grad.dtype for p in ps if p.grad is not None}))

@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_a_cancelled_backward_leaves_the_masters_in_the_slots_at_before_step(dtype):
    # (GradientClip at before_step clips the masters' own FP32 gradients, as in FP32, also after a cancelled backward)
    learn = synth_learner().to_mixed(dtype)
    cb = CancelsFirstBackward()
    learn.fit(1, 1e-3, cbs=cb)
    assert cb.seen[0] == ({torch.float32}, True, set()) # the cancelled batch: the masters, and no gradient half made
    assert all(s == ({torch.float32}, True, {torch.float32}) for s in cb.seen[1:]), cb.seen
    assert_fp32_and_intact(learn)
