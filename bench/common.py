"Shared pieces of the benchmark: device sync and side-by-side timing, batch timers, sync counting, the models, fastai's comparators, table formatting."
from __future__ import annotations
import platform, time, warnings, statistics
from contextlib import contextmanager
from functools import partial
from pathlib import Path
import torch
from torch import nn
from fastai.basics import Learner, Callback, DataLoaders, CrossEntropyLossFlat, CancelStepException, to_float, Adam, OptimWrapper
from fastai.callback.fp16 import NonNativeMixedPrecision, ModelToHalf, get_master
from fastai.callback.fp16 import _copy_state # the body of `NonNativeMixedPrecision.before_fit` calls it

# ---- timing

def sync(device:torch.device) -> None:
    "Wait for the device: CUDA kernels run asynchronously, so a wall-clock reading needs this on both sides"
    if torch.device(device).type == 'cuda': torch.cuda.synchronize(device)

def median_ms(secs:list) -> float: return 1e3 * statistics.median(secs)

def time_side_by_side(
    fns:dict, # name -> function of no argument, the work to time; or (setup, function): `setup` runs untimed first
    device:torch.device, # Synchronized around each call
    warmup:int=3, # Untimed rounds first (allocations, caches)
    repeats:int=20, # Timed rounds
) -> dict: # name -> list of seconds, one per round
    "Time each of `fns` once per round, round after round, so that background load hits them all alike"
    fns = {k:(f if isinstance(f, tuple) else (None, f)) for k,f in fns.items()}
    for _ in range(warmup):
        for setup,f in fns.values():
            if setup: setup()
            f()
    times = {k:[] for k in fns}
    for _ in range(repeats):
        for k,(setup,f) in fns.items():
            if setup: setup()
            sync(device)
            start = time.perf_counter()
            f()
            sync(device)
            times[k].append(time.perf_counter() - start)
    return times

class BatchStart(Callback):
    "Marks the start of a batch before any other callback's `before_batch` runs (the batch is already loaded)"
    order = -1000
    def __init__(self, device): self.device,self.t0 = torch.device(device),None
    def before_batch(self):
        sync(self.device)
        self.t0 = time.perf_counter()

class TrainBatchTimes(Callback):
    "Wall time of each training batch, up to after every other callback's `after_batch`"
    order = 1000
    def __init__(self, start:BatchStart): self.start,self.times = start,[]
    def after_batch(self):
        if not self.training: return
        sync(self.start.device)
        self.times.append(time.perf_counter() - self.start.t0)

def batch_timer(device) -> tuple: # (callbacks to pass to `fit`, the list the training batch times go into)
    "Callbacks that time each training batch of a `fit`, excluding data loading and validation"
    start = BatchStart(device)
    times = TrainBatchTimes(start)
    return [start, times],times.times

@contextmanager
def quiet(learn:Learner):
    "No progress bar, no printed metrics, no warnings (float16 on CPU warns; fastai's AMP warns without CUDA)"
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        yield

# ---- host syncs: `mpcallbacks.test_utils.count_syncs`, shared with the tests

# ---- models and data

def linear_norm_stack(
    n_blocks:int=50, # Linear + LayerNorm blocks: 4 parameter tensors each
    width:int=512, # Features of every block
    n_out:int=10, # Classes
    seed:int=0,
) -> nn.Module: # 50 blocks: 202 parameter tensors, 13.2M parameters
    "A bookkeeping-bound model: many parameter tensors, little math per sample"
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()) for _ in range(n_blocks)]
    return nn.Sequential(*blocks, nn.Linear(width, n_out))

def digits_mlp(width:int=512, seed:int=0) -> nn.Module:
    "An MLP for 8x8 digits: three linear layers"
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))

def synthetic_dls(
    n_in:int|tuple=512, # Features per sample, or the shape of a sample
    bs:int=4, # Batch size
    n_train_batches:int=16,
    n_valid_batches:int=1,
    n_out:int=10, # Classes
    device='cpu',
    seed:int=0,
) -> DataLoaders:
    "Random features and labels, for models whose cost does not depend on the data"
    g = torch.Generator().manual_seed(seed)
    n = bs * (n_train_batches + n_valid_batches)
    x,y = torch.randn(n, *((n_in,) if isinstance(n_in, int) else n_in), generator=g),torch.randint(0, n_out, (n,), generator=g)
    ds = list(zip(x, y))
    n_train = bs * n_train_batches
    return DataLoaders.from_dsets(ds[:n_train], ds[n_train:], bs=bs, num_workers=0, device=device)

def n_tensors(model:nn.Module) -> int: return len(list(model.parameters()))
def n_params(model:nn.Module) -> int: return sum(p.numel() for p in model.parameters())

# ---- fastai's comparators

class NonNativeMixedPrecisionAnyDevice(NonNativeMixedPrecision):
    "fastai's `NonNativeMixedPrecision` with only its CUDA assert removed, so that it runs on a CPU too"
    def before_fit(self): # fastai 2.8's body, minus `assert self.dls.device.type == 'cuda'`
        if self.learn.opt is None: self.learn.create_opt()
        self.model_pgs,self.master_pgs = get_master(self.opt, self.flat_master)
        self.old_pgs = self.opt.param_lists
        _copy_state(self.learn.opt, self.model_pgs, self.master_pgs)
        if self.dynamic: self.count = 0

def to_non_native_fp16_any_device(learn:Learner, **kwargs) -> Learner:
    "`learn.to_non_native_fp16(**kwargs)` with the CUDA assert removed"
    return learn.add_cbs([ModelToHalf(), NonNativeMixedPrecisionAnyDevice(**kwargs)])

class DeviceAutocast(Callback):
    "`torch.autocast` around the forward pass and the loss, as fastai's `MixedPrecision` does, but on the model's device"
    order = 10
    def __init__(self, dtype:torch.dtype): self.dtype = dtype
    # float16 with torch's `GradScaler`, as fastai's; bfloat16 has FP32's range and no scaler
    def before_fit(self): self.scaler = torch.amp.GradScaler(self.dls.device.type) if self.dtype == torch.float16 else None
    def before_batch(self):
        self.ctx = torch.autocast(self.dls.device.type, dtype=self.dtype)
        self.ctx.__enter__()
    def after_pred(self): self.learn.pred = to_float(self.pred)
    def after_loss(self): self.ctx.__exit__(None, None, None)
    def before_backward(self):
        if self.scaler: self.learn.loss_grad = self.scaler.scale(self.loss_grad)
    def before_step(self): # as fastai's: the scaler unscales, then steps this stand-in, unless a gradient is inf/NaN
        if not self.scaler: return
        self.skipped = True
        self.scaler.step(self)
        if self.skipped: raise CancelStepException()
    def after_step(self):
        if self.scaler: self.scaler.update()
    @property
    def param_groups(self): return self.opt.param_groups # `GradScaler` unscales the optimizer's gradients through these
    def step(self, *args, **kwargs): self.skipped = False

# ---- the optimizers a user picks: fastai's default, and torch's fused AdamW through fastai's wrapper

adam_optimizers = { # key (for command lines) -> (name, fastai `opt_func`)
    'adam': ('fastai Adam', Adam), # the Learner's default
    'fused': ('fused AdamW', partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True))),
}

# ---- formatting: every section prints markdown tables

def md_table(headers:list, rows:list) -> str:
    "A markdown table; floats get 3 significant digits"
    fmt = lambda v: f'{v:.3g}' if isinstance(v, float) else str(v)
    lines = ['| ' + ' | '.join(headers) + ' |', '|' + '|'.join('---' for _ in headers) + '|']
    return '\n'.join(lines + ['| ' + ' | '.join(fmt(v) for v in r) + ' |' for r in rows])

def as_ratio(v:float) -> str: return f'{v:.2f}x'
def as_bpp(v:float) -> str: return f'{v:.2f}' # bytes per parameter

def cpu_name() -> str:
    "The CPU's model name, as /proc/cpuinfo gives it"
    if not Path('/proc/cpuinfo').exists(): return platform.processor()
    return next((l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name')), platform.processor())
