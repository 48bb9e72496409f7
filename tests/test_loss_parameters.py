"Parameters the optimizer steps outside `learn.model` (a learnable temperature in the loss, added by a splitter) get the true gradient: unscaled, checked, clipped as in FP32."
from functools import partial
import pytest, torch
from torch import nn
import torch.nn.functional as F
from fastai.basics import Learner, Callback, SGD
from fastai.callback.core import CancelFitException
from fastai.callback.progress import ProgressCallback
from fastai.callback.training import GradientClip
from mpcallbacks.all import MasterMixedPrecision, NonFiniteGradients
from mpcallbacks.test_utils import synth_dls, synth_model
from intact import assert_fp32_and_intact, hook_ids

class TemperatureLoss(nn.Module):
    "Cross-entropy of the logits divided by a learnable temperature"
    def __init__(self): super().__init__(); self.t = nn.Parameter(torch.tensor(2.))
    def forward(self, pred, y): return F.cross_entropy(pred / self.t, y)

class OneStep(Callback):
    order = 100
    def after_step(self): raise CancelFitException()

class InfInTemperatureGrad(Callback):
    "An inf in the loss parameter's own gradient, before the mixed-precision callback looks at the gradients"
    order = MasterMixedPrecision.order - 1
    def after_backward(self): self.learn.loss_func.t.grad.fill_(float('inf'))

def temperature_learner():
    loss = TemperatureLoss()
    learn = Learner(synth_dls(), synth_model(), loss_func=loss, opt_func=partial(SGD, mom=0.), wd=0.,
                    splitter=lambda m: [list(m.parameters()), list(loss.parameters())])
    learn.remove_cb(ProgressCallback)
    return learn

def one_step_change(mixed, cbs=()):
    learn = temperature_learner()
    if mixed: learn.to_mixed(torch.float16, init_scale=2.**12)
    hooks = hook_ids(learn.model)
    t0 = learn.loss_func.t.detach().clone()
    learn.fit(1, 0.1, cbs=[OneStep(), *cbs])
    return learn, hooks, (learn.loss_func.t.detach() - t0).item()

@pytest.mark.parametrize('clip', [False, True], ids=['no_clip', 'GradientClip'])
def test_loss_parameter_steps_like_fp32(clip):
    cbs = lambda: [GradientClip(max_norm=0.01)] if clip else []
    _, _, d32 = one_step_change(False, cbs())
    learn, hooks, d16 = one_step_change(True, cbs())
    assert learn.master_mixed_precision.skipped == 0 # a real step
    assert d32 != 0 and abs(d16 - d32) <= 0.05 * abs(d32), f"temperature moved {d16:.3g} in float16, {d32:.3g} in FP32 ({d16/d32:.3g}x)"
    assert_fp32_and_intact(learn, hooks)

def test_inf_in_a_loss_parameter_gradient_skips_the_step():
    learn = temperature_learner().to_mixed(torch.float16, init_scale=2.**12)
    hooks = hook_ids(learn.model)
    t0 = learn.loss_func.t.detach().clone()
    w0 = [p.detach().clone() for p in learn.model.parameters()]
    with pytest.raises(NonFiniteGradients, match='All 1 optimizer steps of this fit'): # its one step skipped: nothing learned
        learn.fit(1, 0.1, cbs=[OneStep(), InfInTemperatureGrad()])
    assert torch.equal(learn.loss_func.t.detach(), t0), f"the temperature moved to {learn.loss_func.t.item()}"
    assert all(torch.equal(a, b.detach()) for a, b in zip(w0, learn.model.parameters()))
    assert learn.master_mixed_precision.skipped == 1
    assert_fp32_and_intact(learn, hooks)
