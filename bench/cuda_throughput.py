"Section 5 (CUDA only): images/s of ResNet-18/34 at 224 px on synthetic data, FP32 vs fastai `to_fp16()` vs `to_mixed()`, and the largest batch that fits."
from __future__ import annotations
import gc, statistics, time
import torch, torchvision
from fastai.basics import Learner, Callback, DataLoader, DataLoaders, CrossEntropyLossFlat
import fastai.callback.fp16 # to_fp16
from mpcallbacks.all import * # Learner.to_mixed
from .common import md_table, sync, quiet

configs = ('FP32', 'fastai to_fp16', 'to_mixed')
archs = {'ResNet-18': torchvision.models.resnet18, 'ResNet-34': torchvision.models.resnet34}

class SyntheticImages(DataLoader):
    "The same random batch, `n_batches` times, already on the device: measures the model, not data loading"
    def __init__(self, bs:int, n_batches:int, size:int=224, n_classes:int=1000, device='cuda'):
        super().__init__(bs=bs, n=bs*n_batches, num_workers=0, device=device)
        self.xb = torch.randn(bs, 3, size, size, device=device)
        self.yb = torch.randint(0, n_classes, (bs,), device=device)
    def create_batches(self, samps):
        for _ in range(len(self)): yield self.xb,self.yb

class TrainThroughput(Callback):
    "Images per second over the training batches after the first `warmup`, synchronized at both ends"
    order = 1000
    def __init__(self, warmup:int): self.warmup,self.start,self.n_images,self.value = warmup,None,0,None
    def before_batch(self):
        if self.training and self.iter == self.warmup:
            sync(self.dls.device)
            self.start = time.perf_counter()
    def after_batch(self):
        if self.training and self.iter >= self.warmup: self.n_images += self.xb[0].shape[0]
    def after_train(self):
        sync(self.dls.device)
        self.value = self.n_images / (time.perf_counter() - self.start)

def _learner(arch:str, config:str, bs:int, n_batches:int, size:int, device) -> Learner:
    dls = DataLoaders(SyntheticImages(bs, n_batches, size, device=device), SyntheticImages(bs, 1, size, device=device))
    learn = Learner(dls, archs[arch](weights=None).to(device), loss_func=CrossEntropyLossFlat())
    if config == 'fastai to_fp16': learn.to_fp16()
    elif config == 'to_mixed': learn.to_mixed(torch.float16)
    elif config != 'FP32': raise ValueError(f"Unknown config {config!r}")
    return learn

def images_per_second(arch:str, config:str, bs:int, device, n_batches:int=25, warmup:int=5, size:int=224, repeats:int=3) -> float:
    "Median over `repeats` fits of the training throughput"
    res = []
    for _ in range(repeats):
        learn = _learner(arch, config, bs, n_batches, size, device)
        meter = TrainThroughput(warmup)
        with quiet(learn): learn.fit(1, 1e-3, cbs=meter)
        res.append(meter.value)
    return statistics.median(res)

def largest_true(fits, start:int=16, cap:int=4096, granularity:int=8) -> int|None:
    "The largest n in [start, cap] (to `granularity`) with `fits(n)`, assuming fits is monotone: doubling, then bisection"
    if not fits(start): return None
    good,bad = start,None
    while bad is None and good < cap:
        n = min(good * 2, cap)
        if fits(n): good = n
        else: bad = n
    if bad is None: return good
    while bad - good > granularity:
        mid = (good + bad) // 2 // granularity * granularity
        if mid <= good: break
        if fits(mid): good = mid
        else: bad = mid
    return good

def fits_in_memory(arch:str, config:str, bs:int, device, size:int=224) -> bool:
    "Whether two training steps at batch size `bs` run without a CUDA out-of-memory error"
    learn = None
    try:
        learn = _learner(arch, config, bs, 2, size, device)
        with quiet(learn): learn.fit(1, 1e-3)
        return True
    except torch.cuda.OutOfMemoryError: return False
    finally: # let the failed batch's tensors go before the next try
        del learn
        gc.collect()
        torch.cuda.empty_cache()

def run_cuda_throughput(device, bs:int=64, cap:int=4096) -> list:
    "One row per (arch, config): images/s at batch `bs`, and the largest batch that fits"
    rows = []
    for arch in archs:
        for config in configs:
            rows.append(dict(arch=arch, config=config, bs=bs, images_per_s=images_per_second(arch, config, bs, device),
                             largest_batch=largest_true(lambda n: fits_in_memory(arch, config, n, device), cap=cap)))
    return rows

def cuda_section(rows:list|None) -> str:
    if rows is None: return '### 5. CUDA throughput\n\nSkipped: no CUDA device here.'
    cols = ['arch', 'config', 'bs', 'images/s', 'largest batch']
    body = [[r['arch'], r['config'], r['bs'], f"{r['images_per_s']:.0f}", r['largest_batch']] for r in rows]
    return '### 5. CUDA throughput, 224 px synthetic data\n\n' + md_table(cols, body)
