"""The GPU table: what `make bench` cannot measure on a CPU, in one command on a CUDA machine, within about 7 minutes on an H100.

`python -m bench.gpu [--quick] [--out DIR] [--budget-s S]`, from the repository root, runs in this order:

a. Preflight (about 10 s), each check printed PASS, FAIL (with the error) or SKIP, the run going on whatever they say:
   FP32 `nn.LayerNorm` and `nn.GroupNorm` getting 16-bit CUDA input under `to_mixed`'s forward (float16 and bfloat16);
   one float16 LSTM training step under `to_mixed`; float16 steps with fused AdamW under
   `torch.cuda.set_sync_debug_mode('error')`, from each batch's start to the end of its optimizer step (fastai's own
   copy of the loss to the host in `after_batch`, and the fit's start and end, outside the mode).
b. The CUDA-only tests (those `skipif(not torch.cuda.is_available(), ...)`, found in tests/), in a pytest subprocess with a
   time limit.
c. The throughput table: ResNet-50 at 224 px and a small GPT (6 layers, d_model 512, 8 heads, sequence 512, vocabulary
   32,000, `nn.LayerNorm`, causal `F.scaled_dot_product_attention`) on synthetic data already on the GPU, in FP32, fastai's
   `to_fp16()`, fastai's `to_bf16()` (autocast in bfloat16, no scaler), `to_mixed(torch.float16)` and
   `to_mixed(torch.bfloat16)`, all with torch's fused AdamW, plus fastai's own Adam for `to_fp16()` and
   `to_mixed(torch.float16)`. For each: images or tokens per second (the median of the timed windows, after a
   warm-up, of `--passes` fits, 2 by default: the configs in order, then in reverse; synchronized at the window ends),
   the peak memory at one batch size, the largest batch that fits (predicted by a line through the peaks at two batch
   sizes against the memory the allocator can reach, confirmed by at most two probes), host syncs per training step beyond FP32's (CUDA's sync debug mode, and `count_syncs`' rule), and the energy per
   1,000 images or 100,000 tokens from NVML's total energy counter. FP32 runs with TF32 off (every config does).
   Then the targets: to_mixed at least as fast as `to_fp16()` and autocast with the same optimizer, a largest batch at
   least theirs, at least 2x FP32's throughput on ResNet-50, and no host sync per step beyond fastai's own.

Writes DIR/gpu.md (a markdown section, as bench/results/results.md) and DIR/gpu.json (every raw row) and prints both;
DIR is bench/results unless `--out` says. `--quick`: fewer timed windows. `--budget-s`: the seconds the whole run may
take (default 400); a row or phase that would not fit in what is left is skipped and the table says so.
`--smoke`: tiny models and a couple of steps per config, on the CPU where there is no CUDA (the test suite runs it).

On this workplace's GPU machine, which has no fastai and reaches no package registry: `make gpu-wheels` (or
`tools/gpu_wheels.sh`) here, the wheels into .whl/; then one device call with `carry: [".whl"]` and a `timeout_s` of
about 540 (the default budget is 400 s; installing the wheels takes seconds), from the repository root:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; set -o pipefail; PYTHONUNBUFFERED=1 python3 -m bench.gpu --out $OUT 2>&1 | tee $OUT/gpu_log.txt
"""
from __future__ import annotations
import time
_started = time.perf_counter() # (the budget counts the imports below too)
import argparse, ast, gc, json, os, platform, statistics, subprocess, sys, tempfile, traceback, warnings
warnings.filterwarnings('ignore', category=FutureWarning, message='.*torch.jit.script') # torchvision's, at import
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, NamedTuple
import torch, torchvision
import torch.nn.functional as F
from torch import nn
import fastai
from functools import partial
from fastai.basics import OptimWrapper, Learner, Callback, DataLoader, DataLoaders, CrossEntropyLossFlat, CancelTrainException, CancelValidException
import fastai.callback.fp16 # to_fp16, to_bf16
from mpcallbacks.all import * # Learner.to_mixed
from mpcallbacks.test_utils import count_syncs
from .common import md_table, as_ratio, quiet, sync, adam_optimizers, cpu_name

repo_root = Path(__file__).resolve().parent.parent
results_dir = Path(__file__).resolve().parent / 'results'
LR = 1e-4 # small: random data and labels, so that no config diverges into skipped steps
MiB = 2**20

# ---- the models and their data

class CausalBlock(nn.Module):
    "A pre-LN transformer block: causal self-attention through `F.scaled_dot_product_attention`, then a 4x GELU MLP"
    def __init__(self, d:int, heads:int):
        super().__init__()
        self.heads = heads
        self.ln1,self.qkv,self.proj = nn.LayerNorm(d),nn.Linear(d, 3 * d),nn.Linear(d, d)
        self.ln2,self.mlp = nn.LayerNorm(d),nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
    def forward(self, x):
        b,t,d = x.shape
        q,k,v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))

class GPT(nn.Module):
    "A small GPT: token and learned position embeddings, `layers` causal blocks, a final LayerNorm, an untied head"
    def __init__(self, vocab:int=32000, d:int=512, heads:int=8, layers:int=6, seq:int=512):
        super().__init__()
        torch.manual_seed(0)
        self.tok,self.pos = nn.Embedding(vocab, d),nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[CausalBlock(d, heads) for _ in range(layers)])
        self.ln,self.head = nn.LayerNorm(d),nn.Linear(d, vocab, bias=False)
        self.register_buffer('positions', torch.arange(seq), persistent=False) # (no arange per step)
    def forward(self, idx): return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(self.positions[:idx.shape[1]]))))

def resnet50() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet50(weights=None)

def tiny_resnet(n_out:int=10) -> nn.Module:
    "A ResNet in miniature for the smoke run: a stem, two torchvision `BasicBlock`s of 8 channels, pooling, a head"
    from torchvision.models.resnet import BasicBlock
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), BasicBlock(8, 8), BasicBlock(8, 8),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, n_out))

def image_batch(px:int, n_classes:int) -> Callable:
    def make(bs:int, device) -> tuple:
        torch.manual_seed(0)
        return torch.randn(bs, 3, px, px, device=device),torch.randint(0, n_classes, (bs,), device=device)
    return make

def token_batch(seq:int, vocab:int) -> Callable:
    def make(bs:int, device) -> tuple:
        torch.manual_seed(0)
        return torch.randint(0, vocab, (bs, seq), device=device),torch.randint(0, vocab, (bs, seq), device=device)
    return make

class Workload(NamedTuple):
    name: str
    unit: str # what the throughput counts: 'images' or 'tokens'
    per: int # energy per this many units
    make_model: Callable
    make_batch: Callable # (bs, device) -> (inputs, targets), on the device
    units_per_sample: int
    bs: int # batch size of the timed windows and of the first peak
    bs_small: int # the second peak's batch size (the line through the two predicts the largest batch)
    bs_syncs: int # batch size of the fits whose host syncs are counted (a count does not depend on it)
    cap: int # no probe above this batch size

def workloads(smoke:bool=False) -> dict: # key -> Workload
    "ResNet-50 and the small GPT; `smoke`: a tiny ResNet-like and a tiny GPT, for a CPU"
    if smoke: return {
        'resnet': Workload('tiny ResNet (2 BasicBlocks of 8), 16 px', 'images', 1000, tiny_resnet, image_batch(16, 10), 1, 4, 2, 2, 64),
        'gpt': Workload('tiny GPT 2x32, 2 heads, seq 16, vocab 64', 'tokens', 100_000, lambda: GPT(64, 32, 2, 2, 16),
                        token_batch(16, 64), 16, 2, 1, 1, 64)}
    return {
        'resnet': Workload('ResNet-50, 224 px', 'images', 1000, resnet50, image_batch(224, 1000), 1, 128, 64, 8, 4096),
        'gpt': Workload('GPT 6x512, 8 heads, seq 512, vocab 32k', 'tokens', 100_000, GPT, token_batch(512, 32000), 512, 32, 16, 2, 1024)}

class SameBatch(DataLoader):
    "One batch, `n_batches` times, already on the device: measures the model and the training step, not data loading"
    def __init__(self, xb, yb, n_batches:int):
        super().__init__(bs=len(xb), n=len(xb) * n_batches, num_workers=0, device=xb.device)
        self.xb,self.yb = xb,yb
    def create_batches(self, samps):
        for _ in range(len(self)): yield self.xb,self.yb

def same_batch_dls(xb, yb, n_batches:int) -> DataLoaders: return DataLoaders(SameBatch(xb, yb, n_batches), SameBatch(xb, yb, 1))

class SkipValidation(Callback):
    "Training batches only: no validation after them"
    def before_validate(self): raise CancelValidException()

# ---- the configs

configs = ('FP32', 'fastai to_fp16()', 'fastai to_bf16()', 'to_mixed(float16)', 'to_mixed(bfloat16)')
rows_order = [(c, 'fused') for c in configs] + [('fastai to_fp16()', 'adam'), ('to_mixed(float16)', 'adam')] # (config, optimizer key)

def setup_config(learn:Learner, config:str, init_scale:float|None=None) -> Learner:
    "`learn` in `config`, one of `configs`; a float16 config's loss scale starts at `init_scale` (None: its default, 2^16)"
    kw = {} if init_scale is None else dict(init_scale=init_scale)
    if config == 'FP32': return learn
    if config == 'fastai to_fp16()': return learn.to_fp16(**kw)
    if config == 'fastai to_bf16()': return learn.to_bf16()
    if config == 'to_mixed(float16)': return learn.to_mixed(torch.float16, **kw)
    if config == 'to_mixed(bfloat16)': return learn.to_mixed(torch.bfloat16)
    raise ValueError(f"config must be one of {configs}, got {config!r}")

def make_learner(w:Workload, config:str, opt:str, bs:int, n_batches:int, device, init_scale:float|None=None) -> Learner:
    "A learner of `w` in `config` (float16's loss scale from `init_scale`) with the optimizer `opt` (a key of `adam_optimizers`), on `n_batches` copies of one batch of `bs`"
    if opt not in adam_optimizers: raise ValueError(f"opt must be one of {list(adam_optimizers)}, got {opt!r}")
    xb,yb = w.make_batch(bs, device)
    learn = Learner(same_batch_dls(xb, yb, n_batches), w.make_model().to(device), loss_func=CrossEntropyLossFlat(),
                    opt_func=adam_optimizers[opt][1], cbs=SkipValidation())
    return setup_config(learn, config, init_scale)

def loss_scale_of(learn:Learner) -> float|None:
    "The loss scale `learn`'s float16 config has reached inside a fit: `to_mixed`'s, or the `GradScaler` of fastai's `to_fp16()`; None: no loss scaling"
    cb = getattr(learn, 'master_mixed_precision', None)
    if cb is not None: return cb.loss_scale if cb.dtype == torch.float16 else None
    scaler = getattr(learn, 'scaler', None) # (fastai's, during a fit)
    return scaler.get_scale() if scaler is not None and scaler.is_enabled() else None

# ---- the device's state between measurements

def tf32_settings() -> dict:
    "Whether FP32 matmuls and convolutions may use TF32, as torch's flags say"
    res = dict(matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32, cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
               float32_matmul_precision=torch.get_float32_matmul_precision())
    for name,obj in (('matmul_fp32_precision', torch.backends.cuda.matmul), ('cudnn_fp32_precision', torch.backends.cudnn)):
        try: # (torch 2.9's newer flags, where they exist)
            if hasattr(obj, 'fp32_precision'): res[name] = obj.fp32_precision
        except Exception as e: res[name] = f'unreadable ({type(e).__name__})'
    return res

@contextmanager
def tf32_off():
    "While inside, FP32 matmuls and convolutions compute in FP32 (no TF32 in cuBLAS or cuDNN); the settings as found after"
    mm,cd,prec = torch.backends.cuda.matmul.allow_tf32,torch.backends.cudnn.allow_tf32,torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision('highest')
    torch.backends.cuda.matmul.allow_tf32,torch.backends.cudnn.allow_tf32 = False,False
    try: yield tf32_settings()
    finally:
        torch.set_float32_matmul_precision(prec)
        torch.backends.cuda.matmul.allow_tf32,torch.backends.cudnn.allow_tf32 = mm,cd

def leave_autocast() -> None:
    "Exit whatever autocast state a fit that raised left entered (fastai's `MixedPrecision` exits its autocast in `after_loss` only)"
    for dev in ('cuda', 'cpu'): torch.set_autocast_enabled(dev, False)
    depth = torch.autocast_decrement_nesting()
    while depth > 0: depth = torch.autocast_decrement_nesting()
    while depth < 0: depth = torch.autocast_increment_nesting() # (back to 0 where it was 0 already)
    torch.clear_autocast_cache()
    torch.set_autocast_cache_enabled(True)
    torch.set_autocast_dtype('cuda', torch.float16)
    torch.set_autocast_dtype('cpu', torch.bfloat16)

def release(device) -> None:
    "Before the next measurement: no autocast, no sync debug mode, gradients on; on CUDA the learner's memory back and the peak reset"
    leave_autocast()
    torch.set_grad_enabled(True)
    gc.collect() # (a learner is a reference cycle, its callbacks pointing back at it: its memory waits for the collector)
    if torch.device(device).type == 'cuda':
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

@contextmanager
def frozen_heap():
    "While inside, the objects alive at entry (torch's, fastai's: most of the heap) are left out of garbage collection: a collection between measurements takes microseconds, not 0.4 s"
    outer = gc.get_freeze_count() > 0
    gc.freeze()
    try: yield
    finally:
        if not outer: gc.unfreeze()

def is_allocation_error(e:BaseException) -> bool:
    "Whether `e`, or an exception it was raised from, says that memory ran out: CUDA's, cuDNN's or cuBLAS's allocation failed"
    while e is not None:
        if isinstance(e, torch.cuda.OutOfMemoryError): return True
        msg = str(e).lower()
        if isinstance(e, (RuntimeError, MemoryError)) and ('out of memory' in msg or ('alloc' in msg and any(k in msg for k in ('cuda', 'cudnn', 'cublas')))):
            return True
        e = e.__cause__ or e.__context__
    return False

def short(e:BaseException, n:int=200) -> str: return f"{type(e).__name__}: {' '.join(str(e).split())}"[:n]

def raised_at(e:BaseException, n:int=3) -> str:
    "The last `n` Python frames `e` passed through (file:line function), innermost first, each called from the next: where a sync or an error came from"
    frames = traceback.extract_tb(e.__traceback__)[-n:]
    return ' < '.join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))

def peak_bytes(device) -> int|None: return torch.cuda.max_memory_allocated(device) if torch.device(device).type == 'cuda' else None

# ---- measuring

class Energy:
    "NVML's total energy counter of the device (millijoules since the driver loaded), read in joules; `why`: why it cannot be"
    def __init__(self, device):
        self.handle,self.why = None,None
        device = torch.device(device)
        if device.type != 'cuda':
            self.why = 'not measured: not a CUDA device'
            return
        try:
            import pynvml
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self._nvml_index(device))
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) # (raises where unsupported)
            self.nvml,self.handle = pynvml,handle
        except Exception as e: self.why = f"not measured: NVML's total energy counter unsupported here ({short(e, 120)})"

    @staticmethod
    def _nvml_index(device) -> int:
        "NVML counts every GPU of the machine; CUDA_VISIBLE_DEVICES may hide some from torch"
        index = device.index if device.index is not None else torch.cuda.current_device()
        visible = [v.strip() for v in os.environ.get('CUDA_VISIBLE_DEVICES', '').split(',') if v.strip()]
        return int(visible[index]) if index < len(visible) and visible[index].isdigit() else index

    def read(self) -> float|None: return None if self.handle is None else self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1e3

class Windows(Callback):
    "Times `n_windows` windows of `window` training batches after `warmup` batches, synchronized at each window's end; the energy counter read there too"
    order = 1001 # after every other callback's `after_batch`
    def __init__(self, warmup:int, window:int, n_windows:int, energy:Energy):
        if warmup < 1 or window < 1 or n_windows < 1: raise ValueError(f"warmup, window and n_windows must be >= 1, got {warmup}, {window}, {n_windows}")
        self.warmup,self.window,self.n_windows,self.energy = warmup,window,n_windows,energy
        self.marks,self.joules,self.scale = [],[],None
    def after_batch(self):
        if not self.training: return
        done = self.iter + 1 - self.warmup
        if done < 0 or done % self.window: return
        sync(self.dls.device)
        self.marks.append(time.perf_counter())
        self.joules.append(self.energy.read())
        if len(self.marks) == self.n_windows + 1:
            self.scale = loss_scale_of(self.learn) # (where float16's loss scale came to: the short fits start there)
            raise CancelTrainException()

class Sizes(NamedTuple):
    warmup: int # untimed batches first
    window: int # batches per timed window
    n_windows: int
    sync_steps: tuple # the two fits' training steps whose host syncs are counted: per step is their difference
    probes: int # at most this many probes of the largest batch
    passes: int = 2 # throughput fits per config, the configs in order then in reverse (A B C, C B A), their windows pooled

# default: on an H100 about 45 training batches of ResNet-50 per config (13 s in FP32 without TF32, 3 s in 16 bits)
sizes_for = {'default': Sizes(5, 8, 5, (2, 5), 2), 'quick': Sizes(3, 4, 3, (2, 4), 2), 'smoke': Sizes(1, 1, 2, (1, 2), 2)}

def measure_throughput(w:Workload, config:str, opt:str, device, sizes:Sizes, energy:Energy) -> dict:
    "Units per second in each timed window of one fit at batch `w.bs`, the peak memory of that fit, the energy of its windows"
    release(device)
    learn = make_learner(w, config, opt, w.bs, sizes.warmup + sizes.window * sizes.n_windows, device)
    meter = Windows(sizes.warmup, sizes.window, sizes.n_windows, energy)
    with quiet(learn): learn.fit(1, LR, cbs=meter)
    units = sizes.window * w.bs * w.units_per_sample
    rates = [units / (b - a) for a,b in zip(meter.marks, meter.marks[1:])]
    joules = None if meter.joules[0] is None else meter.joules[-1] - meter.joules[0]
    res = dict(rate=statistics.median(rates), windows=rates, timed_s=meter.marks[-1] - meter.marks[0],
               peak_MiB=None if peak_bytes(device) is None else peak_bytes(device) / MiB,
               energy_per=None if joules is None else joules / (units * len(rates)) * w.per, scale_after=meter.scale)
    del learn
    release(device)
    return res

def pool_passes(passes:list) -> dict:
    "One row's throughput from its fits: the median of all their windows, the largest peak, the mean energy, the last loss scale"
    windows = [x for p in passes for x in p['windows']]
    energies = [p['energy_per'] for p in passes if p['energy_per'] is not None]
    peaks = [p['peak_MiB'] for p in passes if p['peak_MiB'] is not None]
    return dict(rate=statistics.median(windows), windows=windows, pass_rates=[p['rate'] for p in passes], timed_s=sum(p['timed_s'] for p in passes),
                peak_MiB=max(peaks) if peaks else None, energy_per=statistics.mean(energies) if energies else None,
                scale_after=passes[-1]['scale_after'])

def measure_peak(w:Workload, config:str, opt:str, bs:int, device, init_scale:float|None=None) -> float|None:
    "The peak memory (MiB) of two training steps at batch `bs` (the second has the optimizer's state); None: not a CUDA device"
    release(device)
    learn = make_learner(w, config, opt, bs, 2, device, init_scale)
    with quiet(learn): learn.fit(1, LR)
    res = None if peak_bytes(device) is None else peak_bytes(device) / MiB
    del learn
    release(device)
    return res

@contextmanager
def cuda_sync_warnings(device):
    "Count the syncs CUDA's sync debug mode ('warn') reports while inside (on the main thread): `box['n']` after; None where not CUDA"
    box = dict(n=None)
    if torch.device(device).type != 'cuda':
        yield box
        return
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        torch.cuda.set_sync_debug_mode('warn')
        try: yield box
        finally:
            torch.cuda.set_sync_debug_mode(before)
            box['n'] = sum('synchroniz' in str(c.message) for c in caught)

def count_fit_syncs(w:Workload, config:str, opt:str, steps:int, device, init_scale:float|None=None) -> dict:
    "Host syncs of one fit of `steps` training batches: by `count_syncs`' rule, and by CUDA's sync debug mode where CUDA"
    release(device)
    learn = make_learner(w, config, opt, w.bs_syncs, steps, device, init_scale)
    with quiet(learn), count_syncs() as counts, cuda_sync_warnings(device) as cuda:
        learn.fit(1, LR)
    del learn
    release(device)
    return dict(rule=sum(counts.values()), cuda=cuda['n'])

def syncs_per_step(w:Workload, config:str, opt:str, device, steps:tuple, init_scale:float|None=None) -> dict:
    "Per training step and per fit, from two fits of `steps[0]` and `steps[1]` batches: per step is the difference over the steps between"
    (n1,n2),res = steps,{}
    a,b = count_fit_syncs(w, config, opt, n1, device, init_scale),count_fit_syncs(w, config, opt, n2, device, init_scale)
    for k in ('rule', 'cuda'):
        if a[k] is None: res[k] = None; continue
        per_step = (b[k] - a[k]) / (n2 - n1)
        res[k] = dict(per_step=per_step, per_fit=a[k] - per_step * n1, fits={n1:a[k], n2:b[k]})
    return res

def round_down(n:float, multiple:int=8) -> int: return max(multiple, int(n) // multiple * multiple)

def largest_batch(
    fits:Callable, # bs -> (True: fits, False: memory ran out, None: another error; a note)
    points:list, # [(bs, peak MiB)], two or more: the line through them predicts
    capacity_MiB:float, # What the allocator can reach
    cap:int, # No probe above this batch size
    probes:int=2, # At most this many probes
) -> dict: # predicted (None: not predictable), largest (the largest probe that fit, None: none did), probes [(bs, fit, note)]
    "The largest batch that fits: a line through the peaks at two batch sizes, against the memory there is; then probes at 95% of it and at it (or at 80% if 95% did not fit)"
    (b1,p1),(b2,p2) = points[0],points[-1]
    slope = (p1 - p2) / (b1 - b2) if b1 != b2 else 0.
    predicted = (capacity_MiB - (p1 - slope * b1)) / slope if slope > 0 else None
    res = dict(predicted=None if predicted is None else int(predicted), largest=None, probes=[], slope_MiB=slope, capacity_MiB=capacity_MiB)
    if predicted is None or probes < 1: return res
    plan = [min(round_down(0.95 * predicted), cap)]
    for n in plan:
        fit,note = fits(n)
        res['probes'].append((n, fit, note))
        if fit: res['largest'] = max(res['largest'] or 0, n)
        if len(res['probes']) >= probes or fit is None: break
        nxt = min(round_down(predicted), cap) if fit else round_down(0.8 * predicted)
        if fit and nxt <= n: break # (at the cap, or the prediction itself rounds down to the probe)
        plan.append(nxt)
    return res

def fits_in_memory(w:Workload, config:str, opt:str, bs:int, device, init_scale:float|None=None) -> tuple: # (True/False/None, note)
    "Whether two training steps at batch `bs` run: any allocation error (CUDA's, cuDNN's, cuBLAS's) is 'does not fit'"
    release(device)
    learn,outcome = None,None
    try:
        learn = make_learner(w, config, opt, bs, 2, device, init_scale)
        with quiet(learn): learn.fit(1, LR)
        outcome = (True, f"peak {peak_bytes(device) / MiB:.0f} MiB" if peak_bytes(device) is not None else '')
    except Exception as e: outcome = (False, short(e, 120)) if is_allocation_error(e) else (None, short(e))
    learn = None
    release(device) # (whatever the failed fit left: autocast entered, its tensors, the peak)
    return outcome

def capacity_MiB(device) -> float:
    "What the allocator can reach now: free memory plus what it holds already"
    free,total = torch.cuda.mem_get_info(device)
    return (free + torch.cuda.memory_reserved(device)) / MiB

# ---- the budget

class Budget:
    "The seconds a run may take from `start`; a kind of work is started only if the longest of its kind so far fits in what is left"
    def __init__(self, seconds:float, start:float, reserve:float=5.):
        self.seconds,self.start,self.reserve,self.longest = seconds,start,reserve,{}
    def elapsed(self) -> float: return time.perf_counter() - self.start
    def left(self) -> float: return self.seconds - self.elapsed()
    def allows(self, kind:str) -> bool: return self.left() - self.reserve > self.longest.get(kind, 0.)
    @contextmanager
    def timed(self, kind:str):
        t0 = time.perf_counter()
        try: yield
        finally: self.longest[kind] = max(self.longest.get(kind, 0.), time.perf_counter() - t0)

def log(msg:str) -> None: print(f"[{time.perf_counter() - _started:6.1f} s] {msg}", flush=True)

# ---- a. preflight

class NormInputs(Callback):
    "The dtypes each LayerNorm and GroupNorm sees during the training batches: (input, weight, output)"
    def before_fit(self):
        self.seen,self.hooks = set(),[m.register_forward_hook(self._hook) for m in self.model.modules() if isinstance(m, (nn.LayerNorm, nn.GroupNorm))]
    def _hook(self, m, inp, out):
        if self.training: self.seen.add((type(m).__name__, str(inp[0].dtype), str(m.weight.dtype), str(out.dtype)))
    def after_fit(self):
        for h in self.hooks: h.remove()

class SyncDebugOn(Callback):
    "CUDA's sync debug mode 'error' from the start of each training batch after the first `skip`"
    order = -1000 # before every other callback's `before_batch`
    def __init__(self, skip:int=1): self.skip = skip
    def before_batch(self):
        if self.training and self.iter >= self.skip: torch.cuda.set_sync_debug_mode('error')

class SyncDebugOff(Callback):
    "... and off again after the optimizer step, after every other callback's `after_step`: fastai's own `Recorder` copies the loss to the host in `after_batch`"
    order = 1000
    def after_step(self): torch.cuda.set_sync_debug_mode(0)
    def after_batch(self): torch.cuda.set_sync_debug_mode(0) # (a batch whose step did not run)

def _norm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 32),
                         nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))

class LSTMHead(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lstm,self.fc = nn.LSTM(16, 32, batch_first=True),nn.Linear(32, 4)
    def forward(self, x): return self.fc(self.lstm(x)[0][:, -1])

def _small_fit(model, x, y, dtype, device, n_batches:int=2, opt:str='adam', cbs=()) -> Learner:
    learn = Learner(same_batch_dls(x, y, n_batches), model.to(device), loss_func=CrossEntropyLossFlat(),
                    opt_func=adam_optimizers[opt][1], cbs=SkipValidation()).to_mixed(dtype)
    with quiet(learn): learn.fit(1, 1e-3, cbs=list(cbs))
    return learn

def _losses_finite(learn:Learner) -> bool: return bool(torch.isfinite(torch.stack([torch.as_tensor(l).float().cpu() for l in learn.recorder.losses])).all())

def check_norms(device, dtype) -> str:
    "FP32 GroupNorm and LayerNorm get 16-bit input under to_mixed's forward: a fit of 2 batches trains, their weights stay FP32"
    torch.manual_seed(0)
    x,y = torch.randn(16, 3, 8, 8, device=device),torch.randint(0, 4, (16,), device=device)
    seen = NormInputs()
    learn = _small_fit(_norm_model(), x, y, dtype, device, cbs=[seen])
    norms = [m for m in learn.model.modules() if isinstance(m, (nn.LayerNorm, nn.GroupNorm))]
    detail = '; '.join(f"{n}: {i} in, weight {wt}, {o} out" for n,i,wt,o in sorted(seen.seen)).replace('torch.', '')
    if not _losses_finite(learn): raise AssertionError(f"a loss was not finite ({detail})")
    if any(m.weight.dtype != torch.float32 for m in norms): raise AssertionError(f"a norm's weight is not FP32 after the fit ({detail})")
    if {i for _,i,_,_ in seen.seen} != {str(dtype)}: raise AssertionError(f"the norms did not all get {dtype} input: not what this checks ({detail})")
    return detail

def check_lstm(device) -> str:
    "One float16 training step of an LSTM under to_mixed"
    torch.manual_seed(0)
    x,y = torch.randn(16, 10, 16, device=device),torch.randint(0, 4, (16,), device=device)
    learn = _small_fit(LSTMHead(), x, y, torch.float16, device, n_batches=1)
    if not _losses_finite(learn): raise AssertionError('the loss was not finite')
    return f"1 step; LSTM weights {str(learn.model.lstm.weight_ih_l0.dtype).replace('torch.', '')} after it"

def check_fused_step_no_sync(device) -> str:
    "float16 steps with fused AdamW under `set_sync_debug_mode('error')`: batches 2 and 3 of 3 inside the mode from their start to the end of their optimizer step; fastai's per-batch loss copy and the fit's start and end outside"
    torch.manual_seed(0)
    x,y = torch.randn(16, 3, 8, 8, device=device),torch.randint(0, 4, (16,), device=device)
    try: learn = _small_fit(_norm_model(), x, y, torch.float16, device, n_batches=3, opt='fused', cbs=[SyncDebugOn(skip=1), SyncDebugOff()])
    finally: torch.cuda.set_sync_debug_mode(0)
    steps = len(learn.master_mixed_precision.scaler.history)
    if steps != 3: raise AssertionError(f"{steps} steps recorded, not 3")
    return "batches 2-3 of 3, before_batch to after_step (forward, loss, backward, fused step), in mode 'error': no sync"

def check_fused_sgd_after_skips(device) -> str:
    "torch's fused SGD with momentum, float16 from a loss scale whose first steps overflow: the weights its foreach step reaches, finite"
    x,y = torch.randn(16, 3, 8, 8, device=device, generator=torch.Generator(device).manual_seed(0)),torch.arange(16, device=device) % 4
    got = {}
    for kind in ('fused', 'foreach'):
        opt_func = partial(OptimWrapper, opt=partial(torch.optim.SGD, momentum=0.9, **{kind: True}))
        learn = Learner(same_batch_dls(x, y, 12), _norm_model().to(device), loss_func=CrossEntropyLossFlat(), opt_func=opt_func,
                        cbs=SkipValidation()).to_mixed(torch.float16, init_scale=2.**24)
        with quiet(learn): learn.fit(1, 1e-2)
        got[kind] = (torch.cat([p.detach().float().flatten() for p in learn.model.parameters()]), learn.master_mixed_precision.skipped)
    (a,skipped),(b,_) = got['fused'],got['foreach']
    if not skipped: raise AssertionError('no step was skipped: not what this checks')
    if not torch.isfinite(a).all(): raise AssertionError(f"non-finite weights after {skipped} skipped steps of 12")
    diff = (a - b).abs().max().item()
    if diff > 1e-5: raise AssertionError(f"fused and foreach SGD differ by up to {diff:.2e} after {skipped} skipped steps of 12")
    return f"{skipped} of 12 steps skipped; weights finite, max |fused - foreach| = {diff:.1e}"

def run_preflight(device) -> list:
    "Every check, each PASS, FAIL (with its error) or SKIP; none stops the run"
    device = torch.device(device)
    checks = [('LayerNorm and GroupNorm in FP32, float16 input', lambda: check_norms(device, torch.float16)),
              ('LayerNorm and GroupNorm in FP32, bfloat16 input', lambda: check_norms(device, torch.bfloat16)),
              ('LSTM, one float16 step', lambda: check_lstm(device)),
              ('fused SGD with momentum after skipped float16 steps', lambda: check_fused_sgd_after_skips(device)),
              ("fused AdamW float16 steps under set_sync_debug_mode('error')",
               (lambda: check_fused_step_no_sync(device)) if device.type == 'cuda' else None)]
    rows = []
    for name,check in checks:
        t0 = time.perf_counter()
        if check is None: status,detail = 'SKIP','needs CUDA'
        else:
            try: status,detail = 'PASS',check()
            except Exception as e: status,detail = 'FAIL',f"{short(e, 400)} (at {raised_at(e)})"
        release(device)
        rows.append(dict(check=name, status=status, detail=detail, secs=time.perf_counter() - t0))
        log(f"preflight {status}: {name}: {detail}")
    return rows

# ---- b. the CUDA-only tests

def _needs_cuda(node) -> bool:
    "Whether a decorator or a `pytestmark` value is a `skipif` on `torch.cuda.is_available()`"
    src = ast.unparse(node)
    return 'skipif' in src and 'cuda.is_available' in src

def cuda_only_tests(tests_dir:Path=repo_root / 'tests') -> list:
    "pytest node ids of the tests skipped without CUDA: a test function or class with such a `skipif`, or a whole file with such a `pytestmark`"
    ids,tests_dir = [],Path(tests_dir)
    for path in sorted(tests_dir.glob('test_*.py')):
        tree,rel = ast.parse(path.read_text()),path.relative_to(tests_dir.parent).as_posix() # (as pytest names it from the repository root)
        marked = any(isinstance(n, ast.Assign) and any(getattr(t, 'id', None) == 'pytestmark' for t in n.targets) and _needs_cuda(n.value)
                     for n in tree.body)
        if marked:
            ids.append(rel)
            continue
        for n in tree.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name.startswith(('test', 'Test')):
                if any(_needs_cuda(d) for d in n.decorator_list): ids.append(f"{rel}::{n.name}")
    return ids

def run_cuda_tests(timeout_s:float=180., ids:list|None=None) -> dict:
    "Run the CUDA-only tests in a pytest subprocess: PASS (all passed), SKIP (all skipped: no CUDA there), FAIL (a failure, an error, or the time limit)"
    ids = cuda_only_tests() if ids is None else ids
    cmd = [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-rfEs', *ids]
    res = dict(ids=ids, cmd=' '.join(['python'] + cmd[1:]), timeout_s=timeout_s)
    if not ids: return dict(res, status='SKIP', summary='no CUDA-only test found', secs=0., tail='')
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=repo_root, capture_output=True, text=True, timeout=timeout_s)
        text,rc = out.stdout + out.stderr,out.returncode
    except subprocess.TimeoutExpired as e: # (its output can come as bytes, whatever `text` says)
        got = [o.decode(errors='replace') if isinstance(o, bytes) else o or '' for o in (e.stdout, e.stderr)]
        text,rc = f"{got[0]}{got[1]}\nstopped after {timeout_s:.0f} s",None
    lines = [l for l in text.splitlines() if l.strip()]
    summary = next((l.strip('= ') for l in reversed(lines) if ' in ' in l and ('passed' in l or 'failed' in l or 'skipped' in l or 'error' in l)),
                   lines[-1] if lines else '')
    status = ('FAIL' if rc != 0 else 'SKIP' if 'skipped' in summary and 'passed' not in summary else
              'PASS' if 'skipped' not in summary else 'FAIL') # (a skip on a CUDA machine: the test did not see CUDA)
    return dict(res, status=status, rc=rc, summary=summary, secs=time.perf_counter() - t0, tail='\n'.join(lines[-30:]))

# ---- c. the throughput table

def run_table(device, smoke:bool=False, sizes:Sizes|None=None, budget:Budget|None=None, models:tuple=('resnet', 'gpt'),
              rows:list|None=None, # The list the rows go into (a new one: None), as they are measured
              progress:Callable|None=None, # Called with no argument after each row's measurement
             ) -> list:
    """One row per (model, config, optimizer) of `rows_order`: throughput, peaks, syncs per step beyond FP32's, energy, the largest batch.
    All throughputs, peaks and syncs first, model by model; then the largest batches: the budget cuts the probes first."""
    sizes = sizes or sizes_for['smoke' if smoke else 'default']
    budget = budget or Budget(float('inf'), time.perf_counter())
    rows = [] if rows is None else rows
    with frozen_heap(): _run_table(torch.device(device), smoke, sizes, budget, models, rows, progress or (lambda: None))
    return rows

def _run_table(device, smoke:bool, sizes:Sizes, budget:Budget, models:tuple, rows:list, progress:Callable) -> None:
    ws,energy = workloads(smoke),Energy(device)
    for key in models:
        w = ws[key]
        baseline = {} # optimizer -> FP32's syncs
        for opt in dict.fromkeys(o for _,o in rows_order): # FP32 with each optimizer: the syncs to subtract
            if not budget.allows(f'syncs {key}'): continue
            with budget.timed(f'syncs {key}'):
                try: baseline[opt] = syncs_per_step(w, 'FP32', opt, device, sizes.sync_steps)
                except Exception as e: log(f"{w.name}: FP32 syncs with {opt}: {short(e)}")
        group = [dict(model=w.name, key=key, unit=w.unit, per=w.per, config=config, opt=adam_optimizers[opt][0], opt_key=opt,
                     bs=w.bs, bs_small=w.bs_small, bs_syncs=w.bs_syncs, units_per_sample=w.units_per_sample, errors={}, skipped=[],
                     energy_note=energy.why, passes=[]) for config,opt in rows_order]
        rows.extend(group)
        for i in range(sizes.passes): # the throughputs, interleaved: in order, then in reverse, ...
            for row in (group if i % 2 == 0 else group[::-1]):
                kind = f"throughput {key}"
                if 'throughput' in row['errors']: continue
                if not budget.allows(kind):
                    if 'throughput' not in row['skipped'] and not row['passes']: row['skipped'].append('throughput')
                    continue
                try:
                    with budget.timed(kind): row['passes'].append(measure_throughput(w, row['config'], row['opt_key'], device, sizes, energy))
                except Exception as e:
                    row['errors']['throughput'] = ('does not fit at batch size: ' if is_allocation_error(e) else '') + f"{short(e)} (at {raised_at(e)})"
                    release(device)
        for row in group:
            passes = row.pop('passes')
            if passes: row.update(pool_passes(passes))
            config,opt = row['config'],row['opt_key']
            for phase,kind in (('peak_small', f'peak {key}'), ('syncs', f'syncs {key}')):
                if phase == 'peak_small' and device.type != 'cuda': continue
                if not budget.allows(kind):
                    row['skipped'].append(phase)
                    continue
                try:
                    with budget.timed(kind):
                        if phase == 'peak_small': row['peak_small_MiB'] = measure_peak(w, config, opt, w.bs_small, device, row.get('scale_after'))
                        else:
                            mine = syncs_per_step(w, config, opt, device, sizes.sync_steps, row.get('scale_after'))
                            row['syncs'] = mine
                            row['syncs_extra'] = {k:None if mine[k] is None or baseline.get(opt, {}).get(k) is None else
                                                  dict(per_step=mine[k]['per_step'] - baseline[opt][k]['per_step'],
                                                       per_fit=mine[k]['per_fit'] - baseline[opt][k]['per_fit']) for k in mine}
                except Exception as e:
                    row['errors'][phase] = ('does not fit at batch size: ' if is_allocation_error(e) else '') + f"{short(e)} (at {raised_at(e)})"
                    release(device)
            log(f"{w.name} | {config} | {row['opt']}: " + (f"{row['rate']:.0f} {w.unit}/s" if 'rate' in row else 'no throughput')
                + (f", peak {row['peak_MiB']:.0f} MiB at {w.bs}" if row.get('peak_MiB') is not None else '')
                + (f", {row['peak_small_MiB']:.0f} at {w.bs_small}" if row.get('peak_small_MiB') is not None else '')
                + ''.join(f", {phase}: {msg}" for phase,msg in row['errors'].items())
                + (f", skipped (budget): {', '.join(row['skipped'])}" if row['skipped'] else ''))
            progress()
    for row in rows: # the largest batches, last
        w = ws[row['key']]
        if device.type != 'cuda':
            row['largest'] = dict(note='not measured: no CUDA memory statistics on this device')
            continue
        if row.get('peak_MiB') is None or row.get('peak_small_MiB') is None:
            row['largest'] = dict(note='not measured: a peak is missing')
            continue
        kind = f"largest {row['key']}"
        if not budget.allows(kind):
            row['largest'] = dict(note='skipped: not within the time budget')
            row['skipped'].append('largest batch')
            continue
        release(device)
        fits = lambda n, row=row, w=w: fits_in_memory(w, row['config'], row['opt_key'], n, device, row.get('scale_after'))
        try:
            with budget.timed(kind):
                row['largest'] = largest_batch(fits, [(w.bs, row['peak_MiB']), (w.bs_small, row['peak_small_MiB'])], capacity_MiB(device),
                                               w.cap, sizes.probes)
        except Exception as e:
            row['largest'] = dict(note=f'not measured: {short(e)}')
            release(device)
            continue
        lb = row['largest']
        log(f"{row['model']} | {row['config']} | {row['opt']}: largest batch predicted {lb['predicted']}, probes "
            + ', '.join(f"{n} {'fits' if ok else 'does not fit' if ok is False else 'error'}" + (f' ({note})' if not ok else '') for n,ok,note in lb['probes']))
        progress()

# ---- targets and tables

def find_row(rows:list, key:str, config:str, opt:str='fused') -> dict|None:
    return next((r for r in rows if r['key'] == key and r['config'] == config and r['opt_key'] == opt), None)

def _extra_per_step(r:dict|None) -> float|None:
    "Syncs per step beyond FP32's: CUDA's own count where it ran, else the rule's"
    if r is None or not r.get('syncs_extra'): return None
    e = r['syncs_extra'].get('cuda') or r['syncs_extra'].get('rule')
    return None if e is None else e['per_step']

def table_targets(rows:list) -> list:
    "(target, measured, met): met is None where nothing was measured"
    keys = list(dict.fromkeys(r['key'] for r in rows))
    name = {r['key']:r['model'].split(',')[0] for r in rows}
    resnet = name.get('resnet', 'ResNet-50')
    def ratio_target(title, a, b, field, opt='fused', keys=keys, limit=1.0):
        got = []
        for k in keys:
            ra,rb = find_row(rows, k, a, opt),find_row(rows, k, b, opt)
            va,vb = (ra or {}).get(field),(rb or {}).get(field)
            if isinstance(va, dict): va,vb = va.get('predicted'),(vb or {}).get('predicted')
            if va is not None and vb: got.append((va / vb, name[k]))
        return (title, ', '.join(f"{as_ratio(x)} ({n})" for x,n in got) or 'not measured', all(round(x, 2) >= limit for x,_ in got) if got else None)
    tgt = [
        ratio_target('to_mixed(float16) throughput >= fastai to_fp16(), fused AdamW', 'to_mixed(float16)', 'fastai to_fp16()', 'rate'),
        ratio_target("to_mixed(float16) throughput >= fastai to_fp16(), fastai's Adam", 'to_mixed(float16)', 'fastai to_fp16()', 'rate', 'adam'),
        ratio_target('to_mixed(bfloat16) throughput >= autocast bfloat16 (fastai to_bf16()), fused AdamW', 'to_mixed(bfloat16)', 'fastai to_bf16()', 'rate'),
        ratio_target('to_mixed(float16) largest batch (predicted) >= fastai to_fp16(), fused AdamW', 'to_mixed(float16)', 'fastai to_fp16()', 'largest'),
        ratio_target('to_mixed(bfloat16) largest batch (predicted) >= fastai to_bf16(), fused AdamW', 'to_mixed(bfloat16)', 'fastai to_bf16()', 'largest'),
        ratio_target(f'{resnet}: to_mixed(float16) >= 2x FP32 (TF32 off), fused AdamW', 'to_mixed(float16)', 'FP32', 'rate', keys=['resnet'], limit=2.0),
        ratio_target(f'{resnet}: to_mixed(bfloat16) >= 2x FP32 (TF32 off), fused AdamW', 'to_mixed(bfloat16)', 'FP32', 'rate', keys=['resnet'], limit=2.0),
    ]
    fused = [(_extra_per_step(find_row(rows, k, c)), f"{name[k]}, {c}") for k in keys for c in ('to_mixed(float16)', 'to_mixed(bfloat16)')]
    fused = [(x, n) for x,n in fused if x is not None]
    tgt.append(('host syncs per step beyond FP32: to_mixed with fused AdamW adds none', ', '.join(f"{x:+.2f} ({n})" for x,n in fused) or 'not measured',
                all(x <= 0 for x,_ in fused) if fused else None))
    adam = [(_extra_per_step(find_row(rows, k, 'to_mixed(float16)', 'adam')), _extra_per_step(find_row(rows, k, 'fastai to_fp16()', 'adam')), name[k])
            for k in keys]
    adam = [(m, f, n) for m,f,n in adam if m is not None and f is not None]
    tgt.append(("host syncs per step beyond FP32 with fastai's Adam: to_mixed(float16) <= fastai to_fp16()'s",
                ', '.join(f"{m:+.2f} vs {f:+.2f} ({n})" for m,f,n in adam) or 'not measured', all(m <= f for m,f,_ in adam) if adam else None))
    return tgt

def _largest_cell(lb:dict|None) -> str:
    if not lb: return '-'
    if 'predicted' not in lb: return lb.get('note', '-')
    probes = ', '.join(f"{n} {'fits' if ok else 'OOM' if ok is False else 'error'}" for n,ok,_ in lb['probes'])
    return f"{lb['largest'] if lb['largest'] else '-'} (predicted {lb['predicted']}; {probes or 'no probe'})"

def _syncs_cell(r:dict, k:str) -> str:
    e = (r.get('syncs_extra') or {}).get(k)
    return '-' if e is None else f"{e['per_step']:+.2f} / {e['per_fit']:+.1f}"

def throughput_section(rows:list, heading:str='#### c. Throughput, memory, host syncs, energy') -> str:
    "The table of `run_table`'s rows, one per model, and the targets"
    parts = [heading, (
        "Synthetic data already on the device: one batch, repeated. Every config steps with torch's fused AdamW "
        "(`partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True))`), and `fastai to_fp16()` and `to_mixed(float16)` "
        "with fastai's `Adam` too: with it `to_mixed` steps through torch's fused kernel on fastai's state, while FP32 and "
        "`to_fp16()` run fastai's per-parameter loop, so the fused AdamW rows are the like-for-like comparison. Throughput: the fits per config the first paragraph gives, "
        "the configs of a model in order, then in reverse, and so on; the median of all their timed windows after each fit's warm-up batches, the device "
        "synchronized at each window's end. A target on a ratio is met when the ratio, rounded to two decimals, reaches it. Peak: "
        "`torch.cuda.max_memory_allocated` over a fit at the batch size shown, from `reset_peak_memory_stats`. Largest batch: "
        "the line through the peaks at two batch sizes against the memory the allocator can reach (free plus held), "
        "then probes of two training steps at 95% of the prediction and at it (80% if 95% did not fit); any allocation "
        "error (CUDA's, cuDNN's, cuBLAS's) counts as 'does not fit', and the device's state is reset after each. "
        "Syncs beyond FP32 (same optimizer): per training step / per fit, from two fits of different lengths; CUDA = "
        "the syncs `torch.cuda.set_sync_debug_mode('warn')` reports on the main thread; rule = "
        "`mpcallbacks.test_utils.count_syncs` (which counts a read of pinned host memory as a sync). Energy: NVML's "
        "total energy counter read at the first and last window's end. The short fits (the peak at the smaller batch, the "
        "syncs' fits, the probes) of a float16 config start its loss scale where its timed fit's had come to (`scale_after` "
        "in the JSON), so that their steps are taken as in a run past its first steps: from 2^16, a two-step ResNet-50 "
        "fit skips both.")]
    for key in dict.fromkeys(r['key'] for r in rows):
        rs = [r for r in rows if r['key'] == key]
        w0 = rs[0]
        fp32 = find_row(rows, key, 'FP32')
        unit = f"{w0['unit']}/s"
        cols = ['config', 'optimizer', unit, '/ FP32 (fused AdamW)', f"peak MiB at bs {w0['bs']} / {w0['bs_small']}",
                'largest batch', 'syncs beyond FP32, CUDA: per step / per fit', 'rule: per step / per fit',
                f"J per {w0['per']:,} {w0['unit']}", 'notes']
        body = []
        for r in rs:
            rate = r.get('rate')
            notes = [f"{p}: {m}" for p,m in r['errors'].items()] + ([f"skipped (budget): {', '.join(r['skipped'])}"] if r['skipped'] else [])
            body.append([r['config'], r['opt'], '-' if rate is None else f"{rate:,.0f}",
                         '-' if rate is None or not (fp32 or {}).get('rate') else f"**{as_ratio(rate / fp32['rate'])}**",
                         ' / '.join('-' if r.get(k) is None else f"{r[k]:,.0f}" for k in ('peak_MiB', 'peak_small_MiB')),
                         _largest_cell(r.get('largest')), _syncs_cell(r, 'cuda'), _syncs_cell(r, 'rule'),
                         '-' if r.get('energy_per') is None else f"{r['energy_per']:.1f}",
                         '; '.join(notes) or ''])
        energy = w0.get('energy_note')
        parts.append(f"**{w0['model']}** (batch size {w0['bs']}; syncs counted at {w0['bs_syncs']})"
                     + (f". Energy {energy}." if energy else '') + '\n\n' + md_table(cols, body))
    tgt = table_targets(rows)
    parts.append('#### Targets\n\n' + md_table(['target', 'measured', 'met'], [[t, m, '-' if ok is None else 'yes' if ok else '**no**'] for t,m,ok in tgt]))
    return '\n\n'.join(parts)

# ---- the whole run

def environment(device) -> dict:
    device = torch.device(device)
    env = dict(torch=torch.__version__, cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
               fastai=fastai.__version__, python=platform.python_version(), cudnn_benchmark=torch.backends.cudnn.benchmark,
               date=f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", device=device.type)
    if device.type == 'cuda':
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_GiB=props.total_memory / 2**30, sms=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
        try:
            import pynvml
            pynvml.nvmlInit()
            env['driver'] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as e: env['driver'] = f'unknown ({short(e, 80)})'
    else: env.update(gpu=None, cpu=cpu_name(), threads=torch.get_num_threads())
    return env

def run_gpu(device, smoke:bool=False, quick:bool=False, budget_s:float=400., tests:bool=True, models:tuple=('resnet', 'gpt'),
            start:float|None=None, # When the budget's time began (`time.perf_counter()`); None: now
            out_dir:Path|None=None, # Where the results so far are written after each phase and row (a run stopped from outside leaves them)
            passes:int|None=None, # Throughput fits per config (None: the sizes' own)
            windows:int|None=None, # Timed windows per throughput fit (None: the sizes' own)
           ) -> dict:
    "Preflight, the CUDA-only tests, the throughput table, the targets: everything `main` writes"
    device = torch.device(device)
    budget = Budget(budget_s, time.perf_counter() if start is None else start)
    sizes = sizes_for['smoke' if smoke else 'quick' if quick else 'default']
    sizes = sizes._replace(**{k:v for k,v in (('passes', passes), ('n_windows', windows)) if v is not None})
    phases = {}
    env = environment(device)
    env['tf32_found'] = tf32_settings()
    res = dict(env=env, sizes=sizes._asdict(), smoke=smoke, quick=quick, budget_s=budget_s, complete=False, preflight=[], tests=None,
               rows=[], targets=[], phases=phases)
    def save():
        phases['total'] = budget.elapsed()
        res['targets'] = [dict(target=t, measured=m, met=ok) for t,m,ok in table_targets(res['rows'])]
        if out_dir is not None: write_results(res, out_dir)
    log(f"{env.get('gpu') or env.get('cpu')}; torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']}), fastai {env['fastai']}, "
        f"Python {env['python']}; TF32 as found: {env['tf32_found']}")
    with tf32_off() as used, frozen_heap():
        env['tf32_used'] = used
        log(f"TF32 off for every config: {used}")
        t0 = time.perf_counter()
        res['preflight'] = run_preflight(device)
        phases['preflight'] = time.perf_counter() - t0
        release(device)
        save()
        t0 = time.perf_counter()
        if not tests: test_res = dict(status='SKIP', summary='not run (tests=False)', ids=cuda_only_tests(), secs=0.)
        elif budget.left() < 60: test_res = dict(status='SKIP', summary='skipped: not within the time budget', ids=cuda_only_tests(), secs=0.)
        else:
            log(f"CUDA-only tests: {' '.join(cuda_only_tests())}")
            test_res = run_cuda_tests(timeout_s=min(180., budget.left() - 45))
        phases['tests'] = time.perf_counter() - t0
        res['tests'] = test_res
        log(f"tests {test_res['status']}: {test_res['summary']}")
        save()
        t0 = time.perf_counter()
        run_table(device, smoke, sizes, budget, models, rows=res['rows'], progress=save)
        phases['table'] = time.perf_counter() - t0
    res['complete'] = True
    save()
    return res

def gpu_markdown(res:dict) -> str:
    "The markdown section of a `run_gpu` result, in the style of bench/results/results.md"
    env,s,ph = res['env'],res['sizes'],res['phases']
    secs = lambda k: f"{ph[k]:.0f} s" if k in ph else 'not run'
    where = (f"{env['gpu']} ({env['gpu_memory_GiB']:.0f} GiB, {env['sms']} SMs, compute capability {env['capability']}, driver {env['driver']})"
             if env.get('gpu') else f"CPU: {env['cpu']}, {env['threads']} torch threads (smoke run: no CUDA)")
    head = (f"### GPU: whole training steps{' (smoke run, tiny models)' if res['smoke'] else ''}\n\n"
            f"{where}; torch {env['torch']} (CUDA {env['cuda']}, cuDNN {env['cudnn']}), fastai {env['fastai']}, Python {env['python']}; {env['date']}. "
            f"TF32 as found: {', '.join(f'{k}={v}' for k,v in env['tf32_found'].items())}; **every config ran with TF32 off** "
            f"({', '.join(f'{k}={v}' for k,v in env['tf32_used'].items())}), so FP32 is true FP32. cudnn.benchmark={env['cudnn_benchmark']}. "
            f"{s['warmup']} warm-up batches, then {s['n_windows']} timed windows of {s['window']} batches, in each of {s['passes']} fits per config"
            f"{' (--quick)' if res['quick'] else ''}. Run time {ph['total']:.0f} s of a {res['budget_s']:.0f} s budget "
            f"(preflight {secs('preflight')}, tests {secs('tests')}, table {secs('table')})."
            + ('' if res['complete'] else " **Incomplete: the run had not reached its end when this was written; what follows is what it had measured.**")
            + (" A smoke run checks that everything runs and the table is whole: its numbers and targets say nothing of a GPU." if res['smoke'] else ''))
    pre = ('#### a. Preflight\n\n' + md_table(['check', 'result', 'detail', 's'],
           [[p['check'], p['status'] if p['status'] != 'FAIL' else '**FAIL**', p['detail'], f"{p['secs']:.1f}"] for p in res['preflight']]))
    t = res['tests'] or dict(status='not run yet', summary='-', secs=0., ids=[])
    tests = (f"#### b. CUDA-only tests\n\n**{t['status']}**: {t['summary']} ({t['secs']:.0f} s). "
             + (f"`{t['cmd']}`" if t.get('cmd') else '') + '\n\n' + '\n'.join(f"- `{i}`" for i in t['ids']))
    if t['status'] == 'FAIL' and t.get('tail'): tests += '\n\n```\n' + t['tail'] + '\n```'
    return '\n\n'.join([head, pre, tests, throughput_section(res['rows'])])

def write_results(res:dict, out_dir:Path) -> tuple: # (markdown path, json path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md,js = out_dir / 'gpu.md',out_dir / 'gpu.json'
    md.write_text(gpu_markdown(res) + '\n')
    js.write_text(json.dumps(res, indent=1, default=str) + '\n')
    return md,js

def main(argv:list|None=None, start:float|None=None) -> dict: # start: when the budget's time began; None: now
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--quick', action='store_true', help='fewer timed windows')
    ap.add_argument('--smoke', action='store_true', help='tiny models, a couple of steps per config; runs on a CPU')
    ap.add_argument('--out', default=None, help='folder for gpu.md and gpu.json (default: bench/results; --smoke: a new temporary folder)')
    ap.add_argument('--budget-s', type=float, default=400., help='seconds the whole run may take (default 400); what would not fit is skipped, and said')
    ap.add_argument('--no-tests', action='store_true', help='leave out the CUDA-only tests (b)')
    ap.add_argument('--device', default=None, help="'cuda', 'cuda:N' or (with --smoke) 'cpu'; default: cuda if present, else cpu for --smoke")
    ap.add_argument('--models', default='resnet,gpt', help="comma-separated, of: resnet, gpt")
    ap.add_argument('--passes', type=int, default=None, help='throughput fits per config, interleaved: in order, in reverse, ... (default 2)')
    ap.add_argument('--windows', type=int, default=None, help='timed windows per throughput fit (default 5; --quick 3)')
    args = ap.parse_args(argv)
    for k in ('passes', 'windows'):
        if getattr(args, k) is not None and getattr(args, k) < 1: ap.error(f"--{k} must be a positive whole number, got {getattr(args, k)}")
    if not args.budget_s > 0: ap.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    models = tuple(m for m in args.models.split(',') if m)
    if not models or set(models) - {'resnet', 'gpt'}: ap.error(f"--models takes resnet and/or gpt, comma-separated, got {args.models!r}")
    try: device = torch.device(args.device or ('cuda' if torch.cuda.is_available() else 'cpu'))
    except RuntimeError: device = None
    if device is None or device.type not in ('cuda', 'cpu'): ap.error(f"--device takes 'cuda', 'cuda:N' or 'cpu', got {args.device!r}")
    if device.type == 'cuda' and not torch.cuda.is_available():
        sys.exit(f"bench.gpu: --device {args.device} but torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)")
    if device.type != 'cuda' and not args.smoke:
        sys.exit(f"bench.gpu needs a CUDA device: torch {torch.__version__} sees none here (torch.cuda.is_available() is "
                 f"{torch.cuda.is_available()}, --device {args.device}). `python -m bench.gpu --smoke` runs its tiny sizes on the CPU.")
    out_dir = Path(args.out) if args.out else results_dir if not args.smoke else Path(tempfile.mkdtemp(prefix='bench-gpu-smoke-'))
    res = run_gpu(device, smoke=args.smoke, quick=args.quick, budget_s=args.budget_s, tests=not args.no_tests, models=models, start=start,
                  out_dir=out_dir, passes=args.passes, windows=args.windows)
    md,js = write_results(res, out_dir)
    print(js.read_text(), flush=True)
    print('\n' + md.read_text(), flush=True) # (last: the end of the output is what a short log shows)
    log(f"wrote {md} and {js}")
    return res

if __name__ == '__main__': main(start=_started) # (the budget counts the imports too)
