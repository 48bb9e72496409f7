"""`nn.Embedding(sparse=True)` with an optimizer that takes sparse gradients trains under `to_mixed()` as in FP32
(refusing it at `to_mixed()` would have been the weaker choice)."""
from functools import partial
import pytest, torch
from torch import nn
from fastai.basics import Learner, DataLoaders, CrossEntropyLossFlat, OptimWrapper
from like_fp32 import fit_once, assert_like_fp32

VOCAB, SEQ = 64, 8

class SparseBag(nn.Module):
    "A sparse embedding, averaged over the sequence, then a dense classifier"
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, 16, sparse=True), nn.Linear(16, 2)
    def forward(self, x): return self.head(self.emb(x).mean(1))

def sgd(params, **kw): return torch.optim.SGD(params, **kw)           # takes sparse and dense gradients alike

def sparse_adam(params, **kw):
    "SparseAdam for the embedding, Adam for the rest: the usual pairing (SparseAdam refuses dense gradients)"
    return _Both([torch.optim.SparseAdam([p for p in params if p.dim() == 2 and p.shape[0] == VOCAB], **kw),
                  torch.optim.Adam([p for p in params if not (p.dim() == 2 and p.shape[0] == VOCAB)], **kw)])

class _Both(torch.optim.Optimizer):
    "Two torch optimizers stepped as one (what OptimWrapper wraps)"
    def __init__(self, opts):
        self.opts = opts
        super().__init__([p for o in opts for g in o.param_groups for p in g['params']], {})
        self.param_groups = [g for o in opts for g in o.param_groups]
    def step(self, closure=None):
        for o in self.opts: o.step()
    def zero_grad(self, set_to_none=True):
        for o in self.opts: o.zero_grad(set_to_none=set_to_none)

def make_learner(opt):
    def make():
        t = torch.randint(0, VOCAB, (256, SEQ))
        y = ((t < VOCAB // 2).float().mean(1) > 0.5).long()
        ds = list(zip(t, y))
        dls = DataLoaders.from_dsets(ds[:224], ds[224:], bs=16, num_workers=0, device='cpu')
        return Learner(dls, SparseBag(), loss_func=CrossEntropyLossFlat(), opt_func=partial(OptimWrapper, opt=opt))
    return make

@pytest.mark.parametrize('opt,lr', [(sgd, 0.5), (sparse_adam, 1e-2)], ids=['SGD', 'SparseAdam+Adam'])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_sparse_embedding_trains_as_in_fp32(opt, lr, dtype):
    "Final loss within 15% (+0.05) of FP32's, the embedding's rows move as FP32's do (update cosine >= 0.9)"
    ref = fit_once(make_learner(opt), None, 2, lr)
    mix = fit_once(make_learner(opt), dict(dtype=dtype), 2, lr)
    assert_like_fp32(ref, mix, cos_min=0.9)
