"""Section 8b: the peak memory of a whole training step (forward, backward and optimizer step) at a realistic batch: ResNet-18
and the transformer of section 8, FP32 against `to_mixed()` and `torch.autocast`, with fastai's Adam.

Counted as section 3 counts (`bench.memory`): the profiler (`profile_memory=True`) records the CPU allocator's running
total, which counts only what was allocated while profiling; the data set is made before profiling starts and the
model, learner, batches, activations and optimizer state inside, so the total is what training holds beyond its data.
Each (model, config) runs in a process of its own. `python -m bench.step_peak` prints this section alone."""
from __future__ import annotations
import gc, json, os, subprocess, sys
from pathlib import Path
import torch
from torch.profiler import profile, ProfilerActivity
from fastai.basics import Adam
from .common import md_table, as_ratio, quiet, n_params
from .memory import Marks, EarlyMarks, allocator_timeline, total_at, max_total_between
from .speed import workloads, workload_dls, make_learner, measured_dtypes, SkipValidation, _dtype_name

cases = {'resnet': 64, 'transformer': 16} # workload -> batch size
configs = ('FP32', 'to_mixed', 'autocast') # (as `bench.speed.configs` sets them up)

def measure_peak(model:str, config:str, dtype:str, device='cpu', n_batches:int=3) -> dict:
    "Fit `model` in `config` for `n_batches` in a profiled region; the allocator's highest total over batches 2 on"
    device,w,bs = torch.device(device),workloads[model],cases[model]
    dtype = getattr(torch, dtype)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == 'cuda' else [])
    dls = workload_dls(w, device, bs=bs, n_batches=n_batches) # made before profiling: not counted
    gc.collect()
    with profile(activities=acts, profile_memory=True) as prof:
        learn = make_learner(w, config, dtype, Adam, dls)
        late,early = Marks(set(), count_at=()),EarlyMarks(set())
        with quiet(learn): learn.fit(1, 1e-3, cbs=[late, early, SkipValidation()])
        n = n_params(learn.model)
        del learn
        gc.collect()
    allocs,mk = allocator_timeline(prof, device)
    at = {name:t for t,name in mk}
    peaks,between = [],[]
    for i in range(1, n_batches): # the first batch creates the optimizer state
        t = {k.split(':', 1)[1]:v for k,v in at.items() if k.startswith(f'{i}:')}
        peaks.append(max_total_between(allocs, t['before_batch'], t['after_batch']))
        between.append(total_at(allocs, t['after_batch']))
    return dict(model=model, name=w.name, bs=bs, params=n, config=config, dtype=_dtype_name(dtype) if config != 'FP32' else '-',
                peak_MiB=max(peaks) / 2**20, between_MiB=max(between) / 2**20, threads=torch.get_num_threads())

def run_step_peak(device, threads:int|None=None) -> list:
    "One row per (model, config, dtype), each measured in a process of its own, with as many torch threads as section 8"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, 'PYTHONWARNINGS': 'ignore', 'BENCH_THREADS': str(threads or os.cpu_count())}
    rows = []
    for model in cases:
        for config in configs:
            for dtype in (['float32'] if config == 'FP32' else [_dtype_name(d) for d in measured_dtypes(device)]):
                out = subprocess.run([sys.executable, '-m', 'bench.step_peak', model, config, dtype, str(device)], cwd=root,
                                     capture_output=True, text=True, env=env)
                if out.returncode != 0: raise RuntimeError(f"step peak child ({model}, {config}, {dtype}) failed:\n{out.stderr[-3000:]}")
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows

def step_peak_section(rows:list) -> str:
    by = {(r['model'], r['config'], r['dtype']):r for r in rows}
    body = []
    for model,dtype in dict.fromkeys((r['model'], r['dtype']) for r in rows if r['config'] != 'FP32'):
        fp32,mixed,auto = by[(model, 'FP32', '-')],by[(model, 'to_mixed', dtype)],by[(model, 'autocast', dtype)]
        body.append([f"{mixed['name']} ({mixed['params'] / 1e6:.3g}M), bs {mixed['bs']}", dtype,
                     *(f"{r['peak_MiB']:.0f}" for r in (fp32, mixed, auto)),
                     f"**{as_ratio(mixed['peak_MiB'] / fp32['peak_MiB'])}**", f"**{as_ratio(mixed['peak_MiB'] / auto['peak_MiB'])}**",
                     ' / '.join(f"{r['between_MiB']:.0f}" for r in (fp32, mixed, auto))])
    cols = ['model', 'dtype', 'FP32 peak MiB', 'to_mixed peak MiB', 'autocast peak MiB', 'to_mixed / FP32', 'to_mixed / autocast',
            'between steps MiB: FP32 / to_mixed / autocast']
    return ('#### 8b. Peak memory of a whole training step (forward, backward and optimizer step), fastai Adam\n\n'
            "The allocator's total, as section 3 reads it (the profiler's running total with `profile_memory=True`): the "
            'model, learner, batches, activations and optimizer state, made while profiling; the data set, made before, is not '
            'counted. The highest total from the start to the end of a training batch, over batches 2 and 3 (the first creates '
            f"the optimizer state); each (model, config) in a process of its own, {rows[0]['threads']} torch threads. "
            'Between steps: the total at the end of a batch.\n\n' + md_table(cols, body))

if __name__ == '__main__':
    torch.set_num_threads(int(os.environ.get('BENCH_THREADS', os.cpu_count())))
    if len(sys.argv) == 5: # a child of `run_step_peak`
        print(json.dumps(measure_peak(*sys.argv[1:])))
    else: # `python -m bench.step_peak [device]`: this section alone, printed
        print(step_peak_section(run_step_peak(sys.argv[1] if len(sys.argv) > 1 else 'cpu')))
