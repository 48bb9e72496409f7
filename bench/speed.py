"""Section 8: whole training steps at realistic widths inside fastai's `fit`, as a user runs them: FP32, `to_mixed()`,
`torch.autocast` and pure 16-bit, with fastai's Adam and torch's fused AdamW, on the device's native 16-bit types.

`python -m bench.speed` prints this section alone; `--models`, `--opts`, `--rounds` pick what it measures, and `--heap kept`
measures with glibc's malloc keeping freed memory in the process (no page faults of memory handed back and taken again)."""
from __future__ import annotations
import argparse, ctypes, os, resource, statistics, sys, time, warnings
warnings.filterwarnings('ignore', category=FutureWarning, message='.*torch.jit.script') # torchvision's, at import
from functools import partial
from typing import Callable, NamedTuple
import torch, torchvision
from torch import nn
from fastai.basics import Learner, Callback, DataLoaders, CrossEntropyLossFlat, CancelValidException, to_float
from mpcallbacks.all import * # Learner.to_mixed
from mpcallbacks.cast import native_16bit_dtypes
from .common import md_table, as_ratio, quiet, batch_timer, synthetic_dls, n_params, cpu_name, DeviceAutocast, adam_optimizers
from .step import StopTrainingAfter, side_by_side_fits

# ---- the models

def wide_mlp(width:int=2048, n_layers:int=4, n_out:int=10) -> nn.Module: # 16.8M parameters
    "Four square Linear layers with ReLU after each, then a small head: matmul-bound"
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(n_layers) for m in (nn.Linear(width, width), nn.ReLU())], nn.Linear(width, n_out))

def resnet18(n_out:int=10) -> nn.Module: # 11.2M parameters, BatchNorm
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None, num_classes=n_out)

class SequenceClassifier(nn.Module):
    "A `TransformerEncoder` over a sequence of feature vectors (post-LN, dropout 0.1: torch's defaults), their mean, a linear head"
    def __init__(self, d:int=512, heads:int=8, layers:int=4, n_out:int=10):
        super().__init__()
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(d, heads, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, n_out)
    def forward(self, x): return self.head(self.encoder(x).mean(1))

def tiny_deep_mlp(width:int=32, n_layers:int=100, n_out:int=10) -> nn.Module: # 0.11M parameters, 202 tensors
    "Many small Linear layers: every step's cost is per-layer and per-tensor overhead, not math"
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(n_layers) for m in (nn.Linear(width, width), nn.ReLU())], nn.Linear(width, n_out))

class Workload(NamedTuple):
    name: str
    make_model: Callable
    sample: tuple # the shape of one input sample
    bs: int # batch size of the timed steps
    steps: int # training batches per short fit
    skip: int # of which the first ones are not timed

workloads = { # key (for --models) -> workload
    'mlp': Workload('wide MLP 4x2048', wide_mlp, (2048,), 128, 6, 2),
    'resnet': Workload('ResNet-18, 96 px', resnet18, (3, 96, 96), 32, 6, 2),
    # ~1.4 s a step on 2 cores: 3 batches per fit, the first untimed, keep the default run near 6 minutes on a quiet machine
    'transformer': Workload('TransformerEncoder 512x4, seq 128', SequenceClassifier, (128, 512), 16, 3, 1),
    'tiny': Workload('100x Linear(32, 32)', tiny_deep_mlp, (32,), 64, 6, 2),
}

# ---- the configs

class Inputs16bit(Callback):
    "Pure 16-bit training's inputs in the model's dtype, and its predictions in FP32 for the loss"
    order = 10
    def __init__(self, dtype:torch.dtype): self.dtype = dtype
    def before_batch(self): self.learn.xb = tuple(x.to(self.dtype) if x.is_floating_point() else x for x in self.xb)
    def after_pred(self): self.learn.pred = to_float(self.pred)

def pure_16bit(learn:Learner, dtype:torch.dtype) -> Learner:
    "The model's parameters in `dtype`: the optimizer steps on them and keeps its state in `dtype`"
    learn.model.to(dtype)
    return learn.add_cb(Inputs16bit(dtype))

configs = { # name -> set-up of a `Learner` in a 16-bit `dtype` (returns it)
    'FP32': lambda learn, dtype: learn,
    'to_mixed': lambda learn, dtype: learn.to_mixed(dtype),
    'autocast': lambda learn, dtype: learn.add_cb(DeviceAutocast(dtype)),
    'pure 16-bit': pure_16bit,
}

optimizers = adam_optimizers # key (for --opts) -> (name, fastai `opt_func`)

class SkipValidation(Callback):
    "Short fits measure training: no validation after the training batches"
    def before_validate(self): raise CancelValidException()

def workload_dls(w:Workload, device, bs:int|None=None, n_batches:int|None=None) -> DataLoaders:
    "Random inputs of `w`'s shape and random labels, made in code; `w.steps` batches of `w.bs` unless told"
    return synthetic_dls(n_in=w.sample, bs=bs or w.bs, n_train_batches=n_batches or w.steps, device=device)

def make_learner(w:Workload, config:str, dtype:torch.dtype, opt_func, dls:DataLoaders) -> Learner:
    "A learner for workload `w` in `config`"
    learn = Learner(dls, w.make_model().to(dls.device), loss_func=CrossEntropyLossFlat(), opt_func=opt_func)
    return configs[config](learn, dtype)

def fit_times(learn:Learner, steps:int, device) -> list:
    "Seconds of each of the first `steps` training batches of a one-epoch `fit`"
    cbs,times = batch_timer(device)
    with quiet(learn): learn.fit(1, 1e-3, cbs=cbs + [StopTrainingAfter(steps), SkipValidation()])
    return times

def _dtype_name(dtype) -> str: return str(dtype).split('.')[1]

def measured_dtypes(device) -> list:
    "bfloat16, and float16 where the device computes it natively"
    native = native_16bit_dtypes(device)
    return [torch.bfloat16] + ([torch.float16] if torch.float16 in native else [])

def spread(secs:list) -> float:
    "The upper quartile of the batch times over the lower: 1.0 on a quiet machine, more where other work took the cores in bursts"
    if len(secs) < 2: return float('nan')
    q1,_,q3 = statistics.quantiles(secs, n=4, method='inclusive')
    return q3 / q1

M_TRIM_THRESHOLD,M_MMAP_MAX = -1,-4 # glibc's `mallopt` parameters (malloc.h)

def keep_freed_memory() -> bool: # Whether it took (glibc only)
    "Ask glibc's malloc to keep freed memory in the process for good: no trimming of the heap's top, no large block mapped and unmapped on its own"
    # With glibc's defaults, the gradients a step frees can end up at the heap's top, which goes back to the system; the
    # next backward faults it in again, page by page (measured: 4.7 ms per 32 MB here). On the wide MLP, each config alone
    # in a process of its own: FP32, autocast and to_mixed 8-22K faults a step, pure 16-bit none; in one process, which
    # learner pays depends on which ran before it (to_mixed: 14-20K faults a step run first, none after an FP32 fit).
    if not sys.platform.startswith('linux'): return False
    try: mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError): return False
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1

def minor_faults() -> int: return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def time_workload(w:Workload, opts:list, dtypes:list, device, rounds:int) -> tuple: # (ms, spread, failed: {(opt, config, dtype): ...}, load, faults)
    """Every (optimizer, config, dtype) of `w` as a learner of its own, fit `rounds` times for `w.steps` batches, the learners
    taking turns in a rotating order; median ms of the timed batches. A learner whose first fit raises is reported as failed."""
    learners,failed = {},{}
    for o in opts:
        for config in configs:
            for dtype in ([None] if config == 'FP32' else dtypes):
                key = (o, config, None if dtype is None else _dtype_name(dtype))
                try:
                    learn = make_learner(w, config, dtype, optimizers[o][1], workload_dls(w, device))
                    fit_times(learn, w.skip, device) # untimed: optimizer state, caches; fails early if the config cannot train
                    learners[key] = learn
                except Exception as e: failed[key] = f"{type(e).__name__}: {' '.join(str(e).split())}"[:160]
    loads,faults = [],{k:[] for k in learners} # the 1-minute load average after each fit (how much other work shared the cores); page faults per batch
    def fit_and_load(key, learn):
        f0 = minor_faults()
        res = fit_times(learn, w.steps, device)
        faults[key].append((minor_faults() - f0) / w.steps)
        loads.append(os.getloadavg()[0])
        return res
    runs,samples = {k:partial(fit_and_load, k, l) for k,l in learners.items()},{}
    ms = side_by_side_fits(runs, rounds, w.skip, samples)
    return (ms,{k:spread(v) for k,v in samples.items()},failed,max(loads, default=float('nan')),
            {k:statistics.median(v) for k,v in faults.items() if v})

def run_speed(device, models=tuple(workloads), opts=tuple(optimizers), rounds:int=5, threads:int|None=None,
              heap:str='glibc', # 'glibc': its defaults, as a user runs; 'kept': glibc keeps freed memory for the rest of the process (`keep_freed_memory`)
             ) -> dict:
    "Each workload's configs side by side, with every thread of the machine (restored after)"
    device = torch.device(device)
    if heap not in ('kept', 'glibc'): raise ValueError(f"heap must be 'kept' or 'glibc', got {heap!r}")
    kept = heap == 'kept' and device.type == 'cpu' and keep_freed_memory()
    before = torch.get_num_threads()
    if device.type == 'cpu': torch.set_num_threads(threads or os.cpu_count())
    try:
        dtypes = measured_dtypes(device)
        start,rows = time.perf_counter(),[]
        for m in models:
            w = workloads[m]
            t0 = time.perf_counter()
            ms,spreads,failed,load,faults = time_workload(w, list(opts), dtypes, device, rounds)
            rows.append(dict(key=m, model=w.name, params_M=n_params(w.make_model()) / 1e6, bs=w.bs, steps=w.steps, skip=w.skip,
                             ms=ms, spread=spreads, failed=failed, load=load, faults=faults,
                             secs=time.perf_counter() - t0))
        return dict(device=torch.cuda.get_device_name(device) if device.type == 'cuda' else f'CPU: {cpu_name()}',
                    threads=torch.get_num_threads(), native=sorted(_dtype_name(d) for d in native_16bit_dtypes(device)),
                    dtypes=[_dtype_name(d) for d in dtypes], opts=list(opts), rounds=rounds, rows=rows, heap_kept=kept,
                    secs=time.perf_counter() - start)
    finally: torch.set_num_threads(before)

# ---- the tables

def speed_section(r:dict) -> str:
    names = {k:n for k,(n,_) in optimizers.items()}
    def ms_of(row, o, config, dt):
        key = (o, config, None if config == 'FP32' else dt)
        if key in row['failed']: return None,f"failed ({row['failed'][key]})"
        return row['ms'][key],f"{row['ms'][key]:.1f}"
    ratio = lambda a, b: '-' if a is None or b is None else as_ratio(a / b)
    cfgs = list(configs)
    body = []
    for row in r['rows']:
        for o in r['opts']:
            for dt in r['dtypes']:
                v = {c:ms_of(row, o, c, dt) for c in cfgs}
                mixed = v['to_mixed'][0]
                keys = [(o, c, None if c == 'FP32' else dt) for c in cfgs]
                worst = max((row['spread'][k] for k in keys if k in row['spread']), default=float('nan'))
                flt = ' / '.join(f"{row['faults'][k]:.0f}" if k in row['faults'] else '-' for k in keys)
                body.append([f"{row['model']} ({row['params_M']:.3g}M, bs {row['bs']})", names[o], dt,
                             f"**{ratio(mixed, v['FP32'][0])}**", f"**{ratio(mixed, v['autocast'][0])}**", f"**{ratio(mixed, v['pure 16-bit'][0])}**"]
                            + [v[c][1] for c in cfgs] + ['-' if worst != worst else f'{worst:.2f}', flt])
    cols = (['model', 'optimizer', 'dtype', 'to_mixed / FP32', 'to_mixed / autocast', 'to_mixed / pure 16-bit'] + [f'{c} ms (context)' for c in cfgs]
            + ['spread (largest q3/q1)', 'page faults per batch (' + ' / '.join(cfgs) + ')'])
    opt_rows = []
    if set(r['opts']) >= {'adam', 'fused'}:
        for row in r['rows']:
            for dt in r['dtypes']:
                a,f = ms_of(row, 'adam', 'to_mixed', dt)[0],ms_of(row, 'fused', 'to_mixed', dt)[0]
                a32,f32 = ms_of(row, 'adam', 'FP32', dt)[0],ms_of(row, 'fused', 'FP32', dt)[0]
                opt_rows.append([row['model'], dt, f'**{ratio(a, f)}**', ratio(a32, f32),
                                 '-' if a is None else f'{a:.1f}', '-' if f is None else f'{f:.1f}'])
    steps = ', '.join(f"{row['model']} {row['steps']} ({row['skip']} untimed; load {row['load']:.1f})" for row in r['rows'])
    not_measured = [d for d in ('bfloat16', 'float16') if d not in r['dtypes']]
    native = ', '.join(r['native']) or 'none'
    return ('### 8. Whole training steps at realistic widths (median ms per training batch inside `fit`)\n\n'
            f"{r['device']}, {r['threads']} torch threads. 16-bit types computed natively here: {native}"
            + (f" ({', '.join(not_measured)} emulated: not measured)" if not_measured else '') + '. '
            'Synthetic data made in code, `num_workers=0`. Each (config, optimizer, dtype) is a learner of its own, fit again and '
            f"again for a few batches, the learners taking turns in a rotating order, {r['rounds']} fit{'s' if r['rounds'] != 1 else ''} each; the median of the "
            f'timed batches (data loading and validation excluded). Batches per fit, and the highest 1-minute load average '
            f"after a fit (this section's own threads make about {r['threads']}; more: other work shared the cores): {steps}. "
            'to_mixed = `learn.to_mixed(dtype)`; autocast = the forward and the loss under `torch.autocast(device, dtype)`, as '
            "fastai's `MixedPrecision` does (with a `GradScaler` for float16); pure 16-bit = "
            '`model.to(dtype)`, the inputs cast, the loss in FP32, the optimizer stepping on the 16-bit parameters. fastai Adam = '
            "the Learner's default `opt_func`; fused AdamW = `partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True))`. "
            "A ratio below 1.00x: to_mixed is faster. Spread: the upper quartile of a config's batch times over its lower "
            'quartile, the largest of the row: near 1.0 the ratios can be trusted; well above it, other work took the cores '
            'during part of the run. '
            + ("Memory: glibc's malloc kept freed memory in the process (`--heap kept`: `mallopt`, the heap's top never "
               "trimmed, no large block mapped on its own), as jemalloc and tcmalloc do. " if r['heap_kept'] else
               "Memory: the allocator as it comes (glibc's defaults on Linux): where the gradients a step frees go back to the "
               "system, the next backward faults them in again, page by page (FP32, autocast and to_mixed alike; pure 16-bit's "
               "smaller blocks stay), and in a run that interleaves them which learner pays depends on which ran before it; "
               "`--heap kept` measures with freed memory kept. ")
            + "Page faults: a fit's minor page faults over its batches, the median over fits, for each config in the order of the "
              "time columns.\n\n"
            + md_table(cols, body)
            + ('\n\n#### The optimizer under to_mixed: fastai Adam against fused AdamW\n\n'
               + md_table(['model', 'dtype', 'to_mixed: fastai Adam / fused AdamW', 'FP32: fastai Adam / fused AdamW',
                           'to_mixed fastai Adam ms (context)', 'to_mixed fused AdamW ms (context)'], opt_rows) if opt_rows else ''))

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--device', default=None, help="'cpu' or 'cuda'; default: cuda if present")
    ap.add_argument('--models', default=','.join(workloads), help=f"comma-separated, of: {', '.join(workloads)}")
    ap.add_argument('--opts', default=','.join(optimizers), help=f"comma-separated, of: {', '.join(optimizers)}")
    ap.add_argument('--rounds', type=int, default=5, help='fits of each learner (default 5)')
    ap.add_argument('--threads', type=int, default=None, help='torch threads on a CPU (default: all cores)')
    ap.add_argument('--heap', choices=('glibc', 'kept'), default='glibc',
                    help="on a CPU with glibc: 'glibc' (default) measures with its defaults, 'kept' keeps freed memory in the process")
    args = ap.parse_args()
    pick = lambda s, known: [k for k in s.split(',') if k] if all(k in known for k in s.split(',') if k) else ap.error(
        f"unknown in {s!r}; known: {', '.join(known)}")
    device = args.device or ('cuda' if torch.cuda.is_available() else 'cpu')
    r = run_speed(device, pick(args.models, workloads), pick(args.opts, optimizers), args.rounds, args.threads, args.heap)
    print(speed_section(r))
    print(f"\n({r['secs']:.0f} s: " + ', '.join(f"{row['model']} {row['secs']:.0f} s" for row in r['rows']) + ')')

if __name__ == '__main__': main()
