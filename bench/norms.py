"Section 6: what keeping LayerNorm in FP32 (the default) costs and changes on a transformer, against LayerNorm cast to 16 bits."
from __future__ import annotations
import statistics, warnings
import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from fastai.basics import Learner, Callback, DataLoaders, CrossEntropyLossFlat, Adam, set_seed
from mpcallbacks.all import * # Learner.to_mixed, MasterMixedPrecision
from .common import md_table, as_ratio, quiet, batch_timer
from .step import StopTrainingAfter

VOCAB = 32

class Encoder(nn.Module):
    "Embedding, a torch `TransformerEncoder` (pre-LN off: LayerNorm after each sublayer, as BERT) and a linear head"
    def __init__(self, d:int, layers:int, seed:int=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 2)
    def forward(self, x): return self.head(self.encoder(self.emb(x)).mean(1))

def token_dls(n_train_batches:int, bs:int, seq:int, device, seed:int=0) -> DataLoaders:
    "Random tokens; the label says whether most of them are in the lower half of the vocabulary (learnable in a few steps)"
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, VOCAB, (bs * (n_train_batches + 1), seq), generator=g)
    y = ((t < VOCAB // 2).float().mean(1) > 0.5).long()
    ds = list(zip(t, y))
    return DataLoaders.from_dsets(ds[:-bs], ds[-bs:], bs=bs, num_workers=0, device=device)

CONFIGS = ('FP32', 'to_mixed (LayerNorm FP32, the default)', 'to_mixed, LayerNorm cast to 16 bits')

def learner(config:str, make_dls, d:int, layers:int, dtype) -> Learner:
    "A learner in `config`; the same seed, so the same weights and batch order, in every config"
    set_seed(0, reproducible=True)
    learn = Learner(make_dls(), Encoder(d, layers), loss_func=CrossEntropyLossFlat(), opt_func=Adam)
    if config == 'FP32': return learn
    learn.to_mixed(dtype)
    if 'cast to 16' in config: # the earlier default: only BatchNorm/InstanceNorm kept in FP32
        next(cb for cb in learn.cbs if isinstance(cb, MasterMixedPrecision)).keep = (_NormBase,)
    return learn

def ln_dtype_in_forward(learn:Learner) -> str:
    "The dtype the first LayerNorm's weight has while the model runs forward"
    seen = []
    h = learn.model.encoder.layers[0].norm1.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype) if not seen else None)
    try:
        with quiet(learn): learn.fit(1, 1e-3, cbs=StopTrainingAfter(1))
    finally: h.remove()
    return str(seen[0]).split('.')[1]

class LossLog(Callback):
    order = 100
    def __init__(self): self.losses = []
    def after_batch(self):
        if self.training: self.losses.append(float(self.learn.loss.detach()))

def flat_params(learn:Learner) -> torch.Tensor: return torch.cat([p.detach().flatten().double() for p in learn.model.parameters()])

def closeness_to_fp32(device, dtype, seeds:int=3) -> dict: # config -> [(relative final-loss difference, update cosine)] per seed
    "The tests' small transformer (d=32, 2 layers) fit 3 epochs per seed in each config, each mixed one compared with FP32's fit"
    acc = {c:[] for c in CONFIGS[1:]}
    for seed in range(seeds):
        fits = {}
        for c in CONFIGS:
            learn,log = learner(c, lambda: token_dls(5, 32, 12, device, seed=seed), 32, 2, dtype),LossLog()
            before = flat_params(learn)
            with quiet(learn): learn.fit(3, 1e-3, cbs=log)
            fits[c] = (sum(log.losses[-4:]) / 4, flat_params(learn) - before)
        end32,upd32 = fits['FP32']
        for c in CONFIGS[1:]:
            end,upd = fits[c]
            acc[c].append(((end - end32) / end32, float(nn.functional.cosine_similarity(upd, upd32, dim=0))))
    return acc

def run_norms(device, dtype=torch.bfloat16, rounds:int=7) -> dict:
    """Speed: ms per training step of each config in `dtype`, short fits taking turns (d=128, 4 layers, seq 64, bs 32).
    Closeness to FP32, in bfloat16 and float16: `closeness_to_fp32`"""
    steps, skip = 6, 1
    learns = {c:learner(c, lambda: token_dls(steps, 32, 64, device), 128, 4, dtype) for c in CONFIGS}
    ln = {c:ln_dtype_in_forward(l) for c,l in learns.items()}
    times = {c:[] for c in CONFIGS}
    for r in range(rounds):
        for c in (CONFIGS if r % 2 == 0 else CONFIGS[::-1]):
            cbs,t = batch_timer(device)
            with quiet(learns[c]): learns[c].fit(1, 1e-3, cbs=cbs + [StopTrainingAfter(steps)])
            times[c] += t[skip:]
    ms = {c:1e3 * statistics.median(v) for c,v in times.items()}
    acc = {str(dt).split('.')[1]:closeness_to_fp32(device, dt) for dt in (torch.bfloat16, torch.float16)}
    return dict(model=f'TransformerEncoder d=128 x4 layers, seq 64, bs 32, {str(dtype).split(".")[1]}', rounds=rounds, steps=steps,
                skip=skip, ms=ms, ln=ln, acc=acc, dtype=str(dtype).split('.')[1])

def norms_section(r:dict) -> str:
    fp32,ln32,ln16 = (r['ms'][c] for c in r['ms'])
    c32,c16 = list(r['ms'])[1:]
    rows = [[c, r['ln'][c], f"{ms:.1f}", as_ratio(ms / fp32)] for c,ms in r['ms'].items()]
    speed = md_table(['config', 'LayerNorm weight in forward', 'ms per training step', '/ FP32'], rows)
    def worst(dt, c):
        res = r['acc'][dt][c]
        return (f"{max(abs(d) for d,_ in res):.2%}", f"{min(cos for _,cos in res):.5f}")
    acc = md_table(['dtype', 'config', 'final loss vs FP32: largest relative difference over 3 seeds', 'update cosine with FP32: lowest'],
                   [[dt, c, *worst(dt, c)] for dt in r['acc'] for c in (c32, c16)])
    return ('### 6. Normalization layers in FP32: LayerNorm kept FP32 against LayerNorm cast to 16 bits\n\n'
            f"Speed: {r['model']}; {r['rounds']} rounds of short fits ({r['steps']} training steps, the first {r['skip']} not "
            'timed), the configs taking turns. Kept in FP32, each LayerNorm computes in FP32 on its input cast up and hands its output '
            'back in 16 bits.\n\n' + speed + f"\n\nLayerNorm FP32 / LayerNorm 16-bit: **{as_ratio(ln32 / ln16)}** per step.\n\n"
            "Closeness to FP32: the tests' small transformer (d=32, 2 layers, 3 epochs), 3 seeds, each mixed fit against FP32's on "
            'the same seed.\n\n' + acc)
