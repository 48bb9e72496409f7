"""Section 9: how close one batch's gradients come to FP32's, `to_mixed()` against `torch.autocast`, on a small BERT-like
transformer (token, token-type and position embeddings, LayerNorm, attention) at realistic rows per batch.

The same weights and the same batch in three runs: FP32; `torch.autocast` around the forward (with `torch.amp.GradScaler`'s
start of 2**16 for float16, unscaled after the backward); and `to_mixed()` through fastai's `fit`, its gradients read right
after its `after_backward` (unscaled and checked), with no step taken. The error of each parameter's gradient is
`|g - g_FP32| / |g_FP32|`; overall, over every gradient at once. `python -m bench.accuracy` prints this section alone."""
from __future__ import annotations
import argparse, math
import torch
from torch import nn
from fastai.basics import Learner, DataLoaders, Callback, CancelBatchException, CrossEntropyLossFlat
import mpcallbacks.all # noqa: F401 (`Learner.to_mixed`)
from .common import md_table, as_ratio, quiet

class TinyBert(nn.Module):
    "Token, token-type and position embeddings summed into a LayerNorm, `n_layers` post-norm encoder layers, a pooler and a classifier"
    def __init__(self, vocab:int=1000, d:int=128, n_layers:int=2, heads:int=4, seq:int=128):
        super().__init__()
        self.tok,self.typ,self.pos = nn.Embedding(vocab, d),nn.Embedding(2, d),nn.Embedding(seq, d)
        self.norm = nn.LayerNorm(d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0., batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.pool,self.head = nn.Linear(d, d),nn.Linear(d, 2)
    def forward(self, x):
        types = (torch.arange(x.shape[1], device=x.device) >= x.shape[1] // 2).long().expand_as(x)
        h = self.norm(self.tok(x) + self.typ(types) + self.pos(torch.arange(x.shape[1], device=x.device)))
        h = self.encoder(h)
        return self.head(torch.tanh(self.pool(h[:, 0])))

def _data(bs:int, seq:int, vocab:int, seed:int=0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (bs, seq), generator=g)
    return x,(x[:, :seq//2].float().mean(1) > vocab / 2).long()

def _grads(model) -> dict: return {n:p.grad.detach().float().clone() for n,p in model.named_parameters() if p.grad is not None}

def _reference(model, x, y, dtype=None, scale:float=1.) -> dict:
    "One batch's gradients: FP32, or under `torch.autocast` to `dtype` with the loss scaled by `scale` and the gradients unscaled"
    model.zero_grad(set_to_none=True)
    with torch.autocast(x.device.type, dtype or torch.bfloat16, enabled=dtype is not None): out = model(x)
    (nn.functional.cross_entropy(out.float(), y) * scale).backward()
    return {n:g / scale for n,g in _grads(model).items()}

class _Grab(Callback):
    "The gradients right after `to_mixed`'s `after_backward` (unscaled and checked); the batch then ends with no step"
    order = 20
    def after_backward(self):
        self.grads = _grads(self.learn.model)
        raise CancelBatchException()

def _to_mixed(model, x, y, dtype) -> dict:
    model.zero_grad(set_to_none=True)
    dls = DataLoaders.from_dsets(list(zip(x, y)), list(zip(x[:2], y[:2])), bs=len(x), shuffle=False, num_workers=0, device=x.device)
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat()).to_mixed(dtype)
    grab = _Grab()
    with quiet(learn): learn.fit(1, 0., cbs=[grab])
    learn.to_unmixed()
    return grab.grads

def _errors(g:dict, ref:dict) -> tuple: # (overall relative error, {name: relative error})
    num = math.sqrt(sum(float((g[n] - r).pow(2).sum()) for n,r in ref.items()))
    den = math.sqrt(sum(float(r.pow(2).sum()) for r in ref.values()))
    per = {n:float((g[n] - r).norm() / r.norm().clamp_min(1e-30)) for n,r in ref.items()}
    return num / den,per

def run_accuracy(device='cpu', bs:int=32, seq:int=128, d:int=128, n_layers:int=2, dtypes=(torch.bfloat16, torch.float16)) -> list:
    "One row per 16-bit type: the overall and per-parameter gradient errors of autocast and of `to_mixed` against FP32"
    device = torch.device(device)
    torch.manual_seed(0)
    model = TinyBert(d=d, n_layers=n_layers, seq=seq).to(device)
    x,y = (t.to(device) for t in _data(bs, seq, 1000))
    ref,rows = _reference(model, x, y),[]
    for dt in dtypes:
        scale = 2.**16 if dt == torch.float16 else 1. # (`to_mixed`'s and `GradScaler`'s start for float16; none for bfloat16)
        ac,ac_per = _errors(_reference(model, x, y, dt, scale), ref)
        tm,tm_per = _errors(_to_mixed(model, x, y, dt), ref)
        worst = max(tm_per, key=lambda n: tm_per[n] / max(ac_per[n], 1e-30))
        rows.append(dict(dtype=str(dt).split('.')[1], rows=bs * seq, autocast=ac, to_mixed=tm, ratio=tm / ac,
                         worst_param=worst, worst_ratio=tm_per[worst] / max(ac_per[worst], 1e-30),
                         ln_autocast=max(v for n,v in ac_per.items() if 'norm' in n), ln_to_mixed=max(v for n,v in tm_per.items() if 'norm' in n),
                         emb_autocast=max(ac_per[n] for n in ac_per if n.startswith(('tok', 'typ', 'pos'))),
                         emb_to_mixed=max(tm_per[n] for n in tm_per if n.startswith(('tok', 'typ', 'pos')))))
    return rows

def accuracy_section(rows:list) -> str:
    cols = ['dtype', 'rows', 'autocast: error', 'to_mixed: error', 'to_mixed / autocast', 'LayerNorm (autocast / to_mixed)',
            'embeddings (autocast / to_mixed)', 'worst parameter: to_mixed / autocast']
    body = [[r['dtype'], r['rows'], f"{r['autocast']:.2e}", f"{r['to_mixed']:.2e}", as_ratio(r['ratio']),
             f"{r['ln_autocast']:.2e} / {r['ln_to_mixed']:.2e}", f"{r['emb_autocast']:.2e} / {r['emb_to_mixed']:.2e}",
             f"{as_ratio(r['worst_ratio'])} ({r['worst_param']})"] for r in rows]
    return ('### 9. Gradient accuracy against FP32 (one batch, a small BERT-like transformer)\n\n'
            'Relative error `|g - g_FP32| / |g_FP32|` of one batch\'s gradients: overall, the largest among the LayerNorm and among '
            'the embedding parameters, and the parameter where `to_mixed` is farthest from autocast\'s error. Same weights, same '
            'batch; `to_mixed` through fastai\'s `fit`, autocast around the forward (float16 with a scale of 2**16, as both start).\n\n'
            + md_table(cols, body))

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument('--device', default='cpu')
    print(accuracy_section(run_accuracy(ap.parse_args().device)))
