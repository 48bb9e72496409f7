"The masters get their gradients in FP32, straight from autograd, and no gradient outlives its step."
from functools import partial
import pytest, torch
from torch import nn
from fastai.basics import Learner, Callback, CrossEntropyLossFlat, Adam, OptimWrapper
from fastai.callback.progress import ProgressCallback
from mpcallbacks.all import MasterMixedPrecision
from mpcallbacks.digits import digits_dls, digits_cnn
from mpcallbacks.test_utils import InjectNonFinite

def cnn(): torch.manual_seed(0); return digits_cnn(8)

class Between(Callback):
    "The masters' gradient dtypes after each backward, and how many gradients are alive after each training batch"
    order = 100
    def __init__(self): self.alive,self.grad_dtypes,self.is_master = [],set(),[]
    def after_backward(self):
        self.grad_dtypes |= {p.grad.dtype for p in self.model.parameters() if p.grad is not None}
        self.is_master.append(all(a is b for a, b in zip(self.model.parameters(), [p for pg in self.opt.param_lists for p in pg])))
    def after_batch(self):
        if self.training: self.alive.append(sum(p.grad is not None for p in self.model.parameters()))

@pytest.mark.parametrize('opt', ['Adam', 'AdamW'])
def test_no_gradient_is_alive_between_steps_and_the_masters_get_fp32_gradients(opt):
    opt_func = Adam if opt == 'Adam' else partial(OptimWrapper, opt=torch.optim.AdamW)
    learn = Learner(digits_dls(bs=64), cnn(), loss_func=CrossEntropyLossFlat(), opt_func=opt_func).to_mixed(torch.bfloat16)
    learn.remove_cb(ProgressCallback)
    between = Between()
    learn.fit(1, 1e-2, cbs=[between, InjectNonFinite(at=[3])])
    assert len(between.alive) > 5 and set(between.alive) == {0} # after stepped and skipped steps alike
    assert between.grad_dtypes == {torch.float32} # autograd wrote FP32 gradients into the masters
    assert all(between.is_master) # the model's parameters are the optimizer's own tensors, also right after backward
    assert learn.master_mixed_precision.skipped == 1
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}
