"FP32 gradients from autograd (`Tensor.grad_dtype`) give bit for bit the masters of the 16-bit gradient path, and no gradient outlives its step."
import hashlib
from functools import partial
import pytest, torch
from torch import nn
from fastai.basics import Learner, Callback, CrossEntropyLossFlat, Adam, OptimWrapper
from fastai.callback.training import GradientClip, GradientAccumulation
from fastai.callback.progress import ProgressCallback
import mpcallbacks.master
from mpcallbacks.all import MasterMixedPrecision
from mpcallbacks.digits import digits_dls, digits_cnn
from mpcallbacks.test_utils import InjectNonFinite

pytestmark = pytest.mark.skipif(not mpcallbacks.master.HAS_GRAD_DTYPE, reason='this torch has no Tensor.grad_dtype')

def digest(ts) -> str:
    h = hashlib.sha256()
    for t in ts: h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

class Hashes(Callback):
    "A hash of the 16-bit weights each training forward used, and of the masters (the optimizer's tensors) after the batch"
    order = 100
    def __init__(self): self.seen,self.grad_dtypes = [],set()
    def after_pred(self):
        if self.training: self.used = digest(self.model.parameters())
    def after_backward(self): # the model holds the 16-bit copies from the forward to the end of backward
        self.grad_dtypes |= {p.grad_dtype for p in self.model.parameters() if p.dtype != torch.float32}
    def after_batch(self):
        if self.training: self.seen.append((digest([p for pg in self.opt.param_lists for p in pg]), self.used))

def mlp(): torch.manual_seed(0); return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 10))
def cnn(): torch.manual_seed(0); return digits_cnn(8)

def run(make_model, dtype, extra, opt_func, fp32_grads, monkeypatch):
    monkeypatch.setattr(mpcallbacks.master, 'HAS_GRAD_DTYPE', fp32_grads)
    dls = digits_dls(bs=64)
    learn = Learner(dls, make_model(), loss_func=CrossEntropyLossFlat(), opt_func=opt_func)
    learn.remove_cb(ProgressCallback)
    hashes = Hashes()
    learn.to_mixed(dtype, loss_scale='dynamic', init_scale=2.**12).fit(1, 1e-2, cbs=[hashes] + extra())
    assert hashes.grad_dtypes == ({torch.float32} if fp32_grads else {dtype}) # the path asked for is the path taken
    return hashes.seen, learn.master_mixed_precision.skipped

extras = {'plain': lambda: [], 'clip': lambda: [GradientClip(0.1)], 'accumulation': lambda: [GradientAccumulation(192)],
          'skips': lambda: [InjectNonFinite(at=[2, 3, 9])],
          'all': lambda: [GradientClip(0.1), GradientAccumulation(128), InjectNonFinite(at=[1, 4])]}
cases = [(m, torch.bfloat16, e, o) for m in ('mlp', 'cnn') for e in extras for o in ('Adam', 'AdamW')] + \
        [(m, torch.float16, e, 'Adam') for m in ('mlp', 'cnn') for e in ('plain', 'all')]

@pytest.mark.parametrize('model,dtype,extra,opt', cases, ids=[f'{m}-{str(d)[6:]}-{e}-{o}' for m, d, e, o in cases])
def test_fp32_gradients_give_the_same_masters_after_every_batch(model, dtype, extra, opt, monkeypatch):
    opt_func = Adam if opt == 'Adam' else partial(OptimWrapper, opt=torch.optim.AdamW)
    make = {'mlp': mlp, 'cnn': cnn}[model]
    ref, ref_skipped = run(make, dtype, extras[extra], opt_func, False, monkeypatch) # 16-bit gradients, converted
    got, skipped = run(make, dtype, extras[extra], opt_func, True, monkeypatch)      # FP32 gradients from autograd
    assert len(got) == len(ref) > 5
    assert got == ref, f"first differing batch: {next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)}"
    assert skipped == ref_skipped == (3 if extra == 'skips' else 2 if extra == 'all' else 0)

class Between(Callback):
    "After every training batch that ended a step: which gradients are still alive, and the copies' grad_dtype"
    order = 100
    def __init__(self): self.alive,self.copies,self.grad_dtypes = [],[],set()
    def after_batch(self):
        if not self.training: return
        self.copies = [c.copy for c in self.learn.master_mixed_precision.fit_state.cast.pairs] # out of the model, which rests
        self.grad_dtypes |= {p.grad_dtype for p in self.copies}
        self.alive.append(sum(p.grad is not None for p in [*self.copies, *self.model.parameters(), *self.learn.parameters()]))

@pytest.mark.parametrize('opt', ['Adam', 'AdamW'])
def test_no_gradient_is_alive_between_steps_and_grad_dtype_is_restored(opt):
    opt_func = Adam if opt == 'Adam' else partial(OptimWrapper, opt=torch.optim.AdamW)
    learn = Learner(digits_dls(bs=64), cnn(), loss_func=CrossEntropyLossFlat(), opt_func=opt_func).to_mixed(torch.bfloat16)
    learn.remove_cb(ProgressCallback)
    between = Between()
    learn.fit(1, 1e-2, cbs=[between, InjectNonFinite(at=[3])])
    assert len(between.alive) > 5 and set(between.alive) == {0} # after stepped and skipped steps alike
    assert between.grad_dtypes == {torch.float32} # during the fit, autograd wrote FP32 gradients
    assert {p.grad_dtype for p in between.copies} == {torch.bfloat16} # restored when the fit ended
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}
