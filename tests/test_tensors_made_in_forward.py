"""Models that make FP32 tensors inside `forward` (an LSTM's explicit zero state, a positional signal built with `.float()`,
noise from `torch.randn`) train under `to_mixed()` as in FP32."""
import sys
import math
import pytest, torch
from torch import nn
from fastai.basics import Learner, DataLoaders, CrossEntropyLossFlat
from like_fp32 import fit_once, assert_like_fp32

VOCAB, SEQ, D = 16, 12, 16

class LSTMFromZeroState(nn.Module):
    "The initial state is made here with `torch.zeros` (FP32) and handed to the LSTM"
    def __init__(self):
        super().__init__()
        self.emb, self.lstm, self.head = nn.Embedding(VOCAB, D), nn.LSTM(D, 32, batch_first=True), nn.Linear(32, 2)
    def forward(self, x):
        h0 = torch.zeros(1, x.shape[0], 32)
        out, _ = self.lstm(self.emb(x), (h0, torch.zeros_like(h0)))
        return self.head(out[:, -1])

class PositionalSignal(nn.Module):
    "A sinusoidal position signal built with `.float()` and added to the embeddings"
    def __init__(self):
        super().__init__()
        self.emb, self.mix, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, D), nn.Linear(D, 2)
    def forward(self, x):
        pos = torch.arange(x.shape[1]).float()[:, None] * torch.exp(torch.arange(D).float() * -math.log(100.) / D)
        h = torch.relu(self.mix(self.emb(x) + torch.sin(pos)))
        return self.head(h.mean(1))

class NoiseInForward(nn.Module):
    "Gaussian noise from `torch.randn`, added to the hidden activations while training"
    def __init__(self):
        super().__init__()
        self.emb, self.hidden, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, 32), nn.Linear(32, 2)
    def forward(self, x):
        h = torch.relu(self.hidden(self.emb(x).mean(1)))
        if self.training: h = h + 0.05 * torch.randn(h.shape)
        return self.head(h)

class PositionsTimesOwnWeight(nn.Module):
    "A module that multiplies an FP32 tensor it makes by its own weight (a learned projection of positions)"
    def __init__(self):
        super().__init__()
        self.emb, self.pos_proj, self.head = nn.Embedding(VOCAB, D), nn.Parameter(torch.randn(1, D) * 0.1), nn.Linear(D, 2)
    def forward(self, x):
        pos = torch.linspace(0, 1, x.shape[1])[:, None] @ self.pos_proj # (SEQ, 1) @ (1, D)
        return self.head((self.emb(x) + pos).mean(1))

class SumsIntoZeros(nn.Module):
    "Sums the hidden activations of each half of the batch into a tensor made with `torch.zeros` (FP32), by `index_add_`"
    def __init__(self):
        super().__init__()
        self.emb, self.hidden, self.head = nn.Embedding(VOCAB, D), nn.Linear(D, D), nn.Linear(D, 2)
    def forward(self, x):
        h = self.hidden(self.emb(x).mean(1))
        idx = torch.arange(x.shape[0]) % 2
        return self.head(h + torch.zeros(2, D).index_add_(0, idx, h)[idx])

MODELS = [LSTMFromZeroState, PositionalSignal, NoiseInForward, PositionsTimesOwnWeight]

def make_learner(model_cls):
    def make():
        t = torch.randint(0, VOCAB, (192, SEQ))
        y = ((t[:, :SEQ//2] < VOCAB // 2).float().mean(1) > 0.5).long() # most of the first half in the lower half of the vocabulary
        ds = list(zip(t, y))
        dls = DataLoaders.from_dsets(ds[:160], ds[160:], bs=16, num_workers=0, device='cpu')
        return Learner(dls, model_cls(), loss_func=CrossEntropyLossFlat())
    return make

@pytest.mark.parametrize('model_cls', MODELS, ids=[m.__name__ for m in MODELS])
def test_fp32_tensors_made_in_forward_train_as_in_fp32(model_cls):
    ref = fit_once(make_learner(model_cls), None, 2, 1e-2)
    mix = fit_once(make_learner(model_cls), dict(dtype=torch.bfloat16), 2, 1e-2)
    assert_like_fp32(ref, mix, loss_rtol=0.15, cos_min=0.9)

@pytest.mark.skipif(sys.version_info < (3, 11), reason='exception notes are new in Python 3.11')
def test_a_dtype_clash_in_forward_says_what_to_do():
    "What still fails (a tensor made in forward, written into by an op that neither promotes nor autocasts): torch's error gets a note"
    learn = make_learner(SumsIntoZeros)().to_mixed(torch.bfloat16)
    learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ == 'ProgressCallback'])
    with pytest.raises(RuntimeError) as e: learn.fit(1, 1e-2)
    note = ' '.join(getattr(e.value, '__notes__', []))
    assert ".to(x.dtype)" in note and "keep_fp32" in note, note
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}
    with pytest.raises(RuntimeError) as e: torch.ones(2, 2) @ torch.ones(2, 2, dtype=torch.bfloat16) # not through a learner: no note
    assert not getattr(e.value, '__notes__', None)
