"""torch's transformers with their defaults and a padding mask train under `to_mixed` as in FP32: in eval mode
`nn.TransformerEncoder` packs a padded batch into a nested tensor unless it sees autocast on, and its check reads CUDA's
autocast only (on a CPU its nested-tensor kernels then meet 16-bit casts and fail, under `torch.autocast` too)."""
import warnings
import pytest, torch
from torch import nn
from fastai.basics import Learner, DataLoaders, CrossEntropyLossFlat, noop
from mpcallbacks.all import *

V, T = 40, 12

def padded_dls(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, V, (384, T), generator=g)
    lens = torch.randint(3, T + 1, (384,), generator=g)
    x[torch.arange(T)[None] >= lens[:, None]] = 0 # right padding, token 0
    y = (x[:, 0] < V // 2).long()
    ds = list(zip(x, y))
    return DataLoaders.from_dsets(ds[:320], ds[320:], bs=32, num_workers=0, device='cpu')

class Classifier(nn.Module):
    def __init__(self, full:bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.full = nn.Embedding(V, 32), full
        if full: self.body = nn.Transformer(32, 4, 1, 1, 64, dropout=0., batch_first=True) # its encoder nests by default too
        else: self.body = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0., batch_first=True), 2)
        self.head = nn.Linear(32, 2)
    def forward(self, x):
        pad, e = x == 0, self.emb(x)
        h = (self.body(e, e, src_key_padding_mask=pad, tgt_key_padding_mask=pad, memory_key_padding_mask=pad) if self.full
             else self.body(e, src_key_padding_mask=pad))
        return self.head(h[:, 0])

def fit(full, dtype=None):
    learn = Learner(padded_dls(), Classifier(full), loss_func=CrossEntropyLossFlat())
    learn.logger = noop
    if dtype: learn.to_mixed(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore') # (torch's prototype warning for nested tensors, the emulated-type warning)
        learn.fit(2, 1e-3)
    assert learn.model.body.encoder.use_nested_tensor if full else learn.model.body.use_nested_tensor # the user's setting, as it was
    return list(learn.recorder.values[-1])

@pytest.mark.cpu_rules() # the CPU's own behaviour: no torch-function mode (which itself turns torch's fast paths off)
@pytest.mark.parametrize('full', [False, True], ids=['TransformerEncoder', 'Transformer'])
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_padded_transformer_trains_as_fp32(full, dtype):
    assert fit(full, dtype) == pytest.approx(fit(full), abs=0.03) # train and valid loss

@pytest.mark.parametrize('full', [False, True], ids=['TransformerEncoder', 'Transformer'])
def test_padded_transformer_under_cuda_rules(full):
    train, valid = fit(full, torch.bfloat16)
    assert valid == valid and valid < 0.75
