"Section 3: bytes of parameters, gradients and optimizer state during `fit`, and peak memory, each config in its own process."
from __future__ import annotations
import json, os, resource, subprocess, sys
from pathlib import Path
import torch
from fastai.basics import Learner, Callback, CrossEntropyLossFlat

configs = ('FP32', 'fastai to_fp16', 'to_mixed float16', 'to_mixed bfloat16')

def _storage_key(t:torch.Tensor) -> tuple: return (t.device, t.untyped_storage().data_ptr())

def training_state_bytes(learn:Learner) -> dict:
    "Bytes of the model's parameters and gradients, the optimizer's other parameters (masters) and theirs, and optimizer state"
    seen,res = set(),{}
    def add(name, ts):
        # Each storage once: views (e.g. masters carved from one flat buffer) and tied weights are not counted twice.
        n = 0
        for t in ts:
            if t is None or _storage_key(t) in seen: continue
            seen.add(_storage_key(t))
            n += t.untyped_storage().nbytes()
        res[name] = n
    model_params = list(learn.model.parameters())
    opt_params = [p for pg in learn.opt.param_lists for p in pg]
    add('model params', model_params)
    add('model grads', [p.grad for p in model_params])
    add('optimizer params (masters)', opt_params)
    add('optimizer params grads', [p.grad for p in opt_params])
    add('optimizer state', [v for p in opt_params for v in learn.opt.state.get(p, {}).values() if isinstance(v, torch.Tensor)])
    res['total'] = sum(res.values())
    return res

class TrainingStateBytes(Callback):
    "The largest `training_state_bytes` seen at `after_step`, once the mixed-precision callbacks are done"
    order = 100
    def __init__(self): self.peak = None
    def after_step(self):
        b = training_state_bytes(self.learn)
        if self.peak is None or b['total'] > self.peak['total']: self.peak = b

def _rss_bytes() -> int:
    import psutil
    return psutil.Process().memory_info().rss

def _reset_peak_rss() -> bool:
    "Make the kernel's peak RSS (VmHWM) restart from the current RSS (Linux >= 4.0); False where that is not possible"
    try: Path('/proc/self/clear_refs').write_text('5')
    except OSError: return False
    return True

def _peak_rss_bytes() -> int:
    "VmHWM: peak RSS of this process's memory map. (`ru_maxrss` is no good in a child: it starts at the parent's RSS.)"
    status = Path('/proc/self/status')
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith('VmHWM:'): return int(line.split()[1]) * 1024 # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 # KiB on Linux, bytes on macOS: a fallback only

def measure(config:str, device:str, n_batches:int=8, bs:int=4) -> dict:
    "In this process: fit the 202-tensor model with Adam under `config`; bytes during fit and peak memory"
    import warnings
    import fastai.callback.fp16 # to_fp16
    from mpcallbacks.all import MasterMixedPrecision # Learner.to_mixed
    from .common import linear_norm_stack, synthetic_dls, quiet
    dls = synthetic_dls(bs=bs, n_train_batches=n_batches, device=device)
    learn = Learner(dls, linear_norm_stack().to(device), loss_func=CrossEntropyLossFlat())
    if config == 'fastai to_fp16': learn.to_fp16()
    elif config.startswith('to_mixed'): learn.to_mixed(getattr(torch, config.split()[1]))
    elif config != 'FP32': raise ValueError(f"Unknown config {config!r}")
    probe = TrainingStateBytes()
    cuda = torch.device(device).type == 'cuda'
    if cuda: torch.cuda.reset_peak_memory_stats(device)
    rss_before = _rss_bytes()
    peak_is_fit = _reset_peak_rss() # else the peak is the whole process's, imports included
    with quiet(learn): learn.fit(1, 1e-3, cbs=probe)
    return dict(config=config, **probe.peak, rss_before_fit=rss_before, peak_rss=_peak_rss_bytes(), peak_rss_is_fit=peak_is_fit,
                peak_cuda=torch.cuda.max_memory_allocated(device) if cuda else None)

def run_memory(device) -> list:
    "One row per config, each measured in a fresh process so that its peak RSS is its own"
    root = Path(__file__).resolve().parent.parent
    rows = []
    for config in configs:
        out = subprocess.run([sys.executable, '-m', 'bench.memory', config, str(device)], cwd=root,
                             capture_output=True, text=True, env={**os.environ, 'PYTHONWARNINGS': 'ignore'})
        if out.returncode != 0: raise RuntimeError(f"memory child for {config!r} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows

if __name__ == '__main__':
    config,device = sys.argv[1],sys.argv[2]
    torch.set_num_threads(int(os.environ.get('BENCH_THREADS', torch.get_num_threads())))
    print(json.dumps(measure(config, device)))
