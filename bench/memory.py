"""Section 3: bytes per parameter of training state, between steps and at the peak of a step, per precision mode and optimizer.

Measured with torch's allocator: the profiler (`profile_memory=True`) records every allocation and free with the
allocator's running total. On a CPU that total ("Total Allocated", c10's `ProfiledCPUMemoryReporter`) counts only what
was allocated while the profiler ran and is still alive, so the learner, its data and its model are built inside the
profiled region: the total is then exactly the bytes the training holds, the FP32 model included. Marks at the fit's
events (zero-length `record_function` ranges) cut the timeline into phases. Cross-check: at the same marks, every live
tensor found by `gc` (and its `.grad`) is counted once per storage (`untyped_storage().data_ptr()`).

`modes` is a dict of name -> function that sets up a `Learner`: a new mode is one more entry. A mode whose set-up raises
`TypeError` (an argument this version of `to_mixed` does not take) is reported as not available."""
from __future__ import annotations
import gc, json, os, subprocess, sys, warnings
from functools import partial
from pathlib import Path
import torch
from torch.profiler import profile, ProfilerActivity, record_function
from fastai.basics import Learner, Callback, CrossEntropyLossFlat, Adam, OptimWrapper
from .common import md_table, as_bpp, DeviceAutocast

def _to_fp16(learn):
    import fastai.callback.fp16 # Learner.to_fp16
    return learn.to_fp16()

def _to_mixed(learn, dtype, **kwargs):
    import mpcallbacks.all # Learner.to_mixed
    return learn.to_mixed(dtype, **kwargs)

modes = { # name -> set-up of a `Learner` (returns it)
    'FP32': lambda learn: learn,
    'autocast bfloat16': lambda learn: learn.add_cb(DeviceAutocast(torch.bfloat16)),
    'fastai to_fp16()': _to_fp16,
    'to_mixed float16': partial(_to_mixed, dtype=torch.float16),
    'to_mixed bfloat16': partial(_to_mixed, dtype=torch.bfloat16),
}

optimizers = { # name -> fastai `opt_func`
    'fastai Adam': Adam,
    'OptimWrapper(AdamW)': partial(OptimWrapper, opt=torch.optim.AdamW),
}

# ---- the two ways of counting

def live_storage_bytes(exclude:set=frozenset(), device_type:str='cpu') -> tuple: # (bytes, {storage key})
    "Bytes of every storage on `device_type` reachable from a live tensor (or its `.grad`) that `gc` sees, each storage once"
    seen,n = set(),0
    with warnings.catch_warnings():
        warnings.simplefilter('ignore') # `isinstance` on some deprecated module attributes warns
        objs = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for o in objs:
        for t in (o, o.grad if o.is_leaf else None): # `.grad` of a non-leaf warns and is always None
            if t is None or t.device.type != device_type: continue
            s = t.untyped_storage()
            key = (t.device, s.data_ptr())
            if s.data_ptr() == 0 or key in seen or key in exclude: continue
            seen.add(key)
            n += s.nbytes()
    return n,seen

def _walk(events):
    for e in events:
        yield e
        yield from _walk(e.children)

def allocator_timeline(prof, device:torch.device) -> tuple: # (allocation events [(ns, total bytes)], marks [(ns, name)])
    "The allocator's running total after each allocation or free on `device`, and the marks, in time order"
    allocs,marks = [],[]
    for e in _walk(prof.profiler.kineto_results.experimental_event_tree()):
        if e.tag == torch._C._profiler._EventType.Allocation:
            f = e.extra_fields
            if f.device.type == device.type: allocs.append((e.start_time_ns, f.total_allocated, f.alloc_size))
        elif e.name.startswith('mark:'): marks.append((e.start_time_ns, e.name[5:]))
    allocs.sort()
    # The total counts what this process allocated in any profiled region and has not freed in one: start from zero.
    base = allocs[0][1] - allocs[0][2] if allocs else 0
    return [(t, b - base) for t,b,_ in allocs],sorted(marks)

# ---- marks at the fit's events

class Marks(Callback):
    "Zero-length profiler ranges at a training batch's events, and the live-storage count at some of them"
    order = 1000 # after every other callback's event: a mark sees what they left
    def __init__(self, exclude:set, count_at=('after_batch',)):
        self.exclude,self.count_at,self.gc_bytes,self.first_linear_out = exclude,count_at,[],None
    def _mark(self, name):
        if not self.training: return
        with record_function(f'mark:{self.iter}:{name}'): pass
        if name in self.count_at:
            self.gc_bytes.append((self.iter, name, live_storage_bytes(self.exclude, self.dls.device.type)[0]))
    def before_fit(self):
        lin = next(m for m in self.learn.model.modules() if isinstance(m, torch.nn.Linear))
        self.hook = lin.register_forward_hook(lambda m,i,o: setattr(self, 'first_linear_out', o.dtype))
    def after_fit(self): self.hook.remove()
    def after_loss(self): self._mark('after_loss')
    def after_batch(self): self._mark('after_batch')

class EarlyMarks(Marks):
    "Marks before any other callback's event: the start of a batch, the end of backward"
    order = -1000
    def __init__(self, exclude:set): super().__init__(exclude, count_at=('after_backward',))
    def before_fit(self): pass
    def after_fit(self): pass
    def after_loss(self): pass
    def after_batch(self): pass
    def before_batch(self): self._mark('before_batch')
    def after_backward(self): self._mark('after_backward')

def total_at(allocs:list, t:int) -> int:
    "The allocator's total at time `t`"
    import bisect
    i = bisect.bisect_right(allocs, (t, float('inf'))) - 1
    return allocs[i][1] if i >= 0 else 0

def max_total_between(allocs:list, t0:int, t1:int) -> int:
    "The allocator's highest total from time `t0` to `t1`"
    return max([total_at(allocs, t0)] + [b for t,b in allocs if t0 <= t <= t1])

def measure(mode:str, opt:str, device='cpu', n_batches:int=4, bs:int=4) -> dict:
    "Fit the 202-tensor model with `mode` and `opt` in a profiled region; bytes per parameter from the allocator and from gc"
    from .common import linear_norm_stack, synthetic_dls, quiet, n_params, n_tensors
    device = torch.device(device)
    gc.collect()
    _,before = live_storage_bytes(device_type=device.type)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == 'cuda' else [])
    with profile(activities=acts, profile_memory=True) as prof:
        dls = synthetic_dls(bs=bs, n_train_batches=n_batches, device=device)
        learn = Learner(dls, linear_norm_stack().to(device), loss_func=CrossEntropyLossFlat(), opt_func=optimizers[opt])
        n,tensors = n_params(learn.model),n_tensors(learn.model)
        try: modes[mode](learn)
        except TypeError as e: return dict(mode=mode, opt=opt, available=False, reason=str(e).splitlines()[0])
        marks,early = Marks(before),EarlyMarks(before)
        with quiet(learn): learn.fit(1, 1e-3, cbs=[marks, early])
        opt_params = [p for g in learn.opt.param_lists for p in g]
        opt_dtypes = sorted({str(v.dtype).split('.')[1] for p in opt_params for v in learn.opt.state.get(p, {}).values()
                             if isinstance(v, torch.Tensor) and v.numel() > 1} if not isinstance(learn.opt, OptimWrapper) else
                            {str(v.dtype).split('.')[1] for s in learn.opt.opt.state.values() for v in s.values() if v.numel() > 1})
        del learn, dls
        gc.collect() # free the learner's cycles while the profiler still sees the frees
    allocs,mk = allocator_timeline(prof, device)
    at = {name:t for t,name in mk}
    per = lambda b: b / n
    steady = range(1, n_batches) # the first batch creates the optimizer state
    rows = []
    for i in steady:
        t = {k.split(':', 1)[1]:v for k,v in at.items() if k.startswith(f'{i}:')}
        rows.append(dict(
            between=total_at(allocs, t['after_batch']),
            peak_step=max_total_between(allocs, t['after_backward'], t['after_batch']), # backward is over: no activations left
            peak_batch=max_total_between(allocs, t['before_batch'], t['after_batch']), # forward and backward included
            activations=total_at(allocs, t['after_loss']) - total_at(allocs, t['before_batch']), # what the forward keeps for backward
            after_backward=total_at(allocs, t['after_backward'])))
    gcb = {(i, k):b for i,k,b in marks.gc_bytes + early.gc_bytes}
    last = n_batches - 1
    return dict(mode=mode, opt=opt, available=True, params=n, tensors=tensors,
                between=per(max(r['between'] for r in rows)), peak_step=per(max(r['peak_step'] for r in rows)),
                peak_batch=per(max(r['peak_batch'] for r in rows)), activations_MiB=max(r['activations'] for r in rows) / 2**20,
                gc_between=per(gcb[(last, 'after_batch')]), alloc_between_last=per(rows[-1]['between']),
                gc_after_backward=per(gcb[(last, 'after_backward')]), alloc_after_backward=per(rows[-1]['after_backward']),
                forward_dtype=str(marks.first_linear_out).split('.')[1], opt_state_dtypes='/'.join(opt_dtypes))

def run_memory(device) -> list:
    "One row per (mode, optimizer); each mode in a fresh process, so that no mode's caches or patches reach another's"
    root = Path(__file__).resolve().parent.parent
    rows = []
    for mode in modes:
        out = subprocess.run([sys.executable, '-m', 'bench.memory', mode, str(device)], cwd=root,
                             capture_output=True, text=True, env={**os.environ, 'PYTHONWARNINGS': 'ignore'})
        if out.returncode != 0: raise RuntimeError(f"memory child for {mode!r} failed:\n{out.stderr[-3000:]}")
        rows += json.loads(out.stdout.strip().splitlines()[-1])
    return rows

def memory_section(rows:list) -> str:
    ok = [r for r in rows if r['available']]
    r0 = ok[0]
    cols = ['mode', 'optimizer', 'forward computes in', '**between steps**', '**peak of a step**', 'peak with forward/backward',
            'activations MiB', 'gc: between steps', 'gc / allocator: end of backward']
    body = [[r['mode'], r['opt'], r['forward_dtype'], f"**{as_bpp(r['between'])}**", f"**{as_bpp(r['peak_step'])}**", as_bpp(r['peak_batch']),
             f"{r['activations_MiB']:.1f}", as_bpp(r['gc_between']), f"{as_bpp(r['gc_after_backward'])} / {as_bpp(r['alloc_after_backward'])}"]
            if r['available'] else [r['mode'], r['opt'], 'not available', '-', '-', '-', '-', '-', f"({r['reason']})"] for r in rows]
    tgt = memory_targets(rows)
    fp16 = [r for r in ok if r['mode'] == 'fastai to_fp16()']
    fp16_note = (" **fastai's `to_fp16()` trains FP32 here**: its first Linear layer computes in float32, as `autocast('cuda')` "
                 "is disabled without CUDA." if fp16 and fp16[0]['forward_dtype'] == 'float32' else '')
    gap = max(r['params'] * max(abs(r['gc_between'] - r['alloc_between_last']), abs(r['gc_after_backward'] - r['alloc_after_backward']))
              for r in ok) # bytes
    return ('### 3. Memory: bytes per parameter of training state (params + grads + optimizer state)\n\n'
            f"Linear+LayerNorm x50 ({r0['tensors']} tensors, {r0['params'] / 1e6:.1f}M parameters), bs 4, one epoch of 4 batches, "
            'each mode in its own process. Bytes from torch\'s allocator: the profiler (`profile_memory=True`) records each '
            "allocation with the allocator's running total, which on a CPU counts only what was allocated while profiling; the "
            'learner, data and FP32 model are built inside the profiled region, so the total is what training holds. Figures are '
            'the largest over batches 2-4 (batch 1 creates the optimizer state). *between steps*: at the end of a batch; '
            '*peak of a step*: the highest total from the end of backward to the end of the batch (no activations left); '
            '*peak with forward/backward*: from the start of the batch (activations, autocast\'s weight copies included); '
            '*activations*: bytes the forward pass and loss added. Cross-check: every live tensor `gc` finds (and its `.grad`), '
            f'each storage once, at the end of the last batch and right after its backward, differs by at most {gap:,.0f} bytes from the '
            "allocator's total at the same points (a difference would be memory no live tensor holds)." + fp16_note + '\n\n'
            + md_table(cols, body) + '\n\n#### Memory targets\n\n'
            + md_table(['target', 'measured', 'met'], [[t, m, '-' if k is None else 'yes' if k else '**no**'] for t,m,k in tgt]))

def memory_targets(rows:list) -> list:
    "(target, measured, met) for the memory targets"
    by = {(r['mode'], r['opt']):r for r in rows if r['available']}
    default = [r for (m,_),r in by.items() if m in ('to_mixed float16', 'to_mixed bfloat16')]
    fmt = lambda rs, k: ', '.join(f"{as_bpp(r[k])} ({r['mode'].split()[1]}, {r['opt']})" for r in rs)
    # Compared as printed, to 2 decimals: every total also holds the data set, 0.004 bytes/param (FP32 reads 16.004)
    met = lambda rs, k, target: all(round(r[k], 2) <= target for r in rs)
    return [('to_mixed: <= 12.0 bytes/param between steps (no 16-bit cast outlives its step)', fmt(default, 'between'), met(default, 'between', 12.0)),
            ('to_mixed: <= 18.5 bytes/param at the peak of a step', fmt(default, 'peak_step'), met(default, 'peak_step', 18.5))]

if __name__ == '__main__':
    torch.set_num_threads(int(os.environ.get('BENCH_THREADS', 1)))
    if len(sys.argv) == 3: # a child of `run_memory`
        mode,device = sys.argv[1:]
        print(json.dumps([measure(mode, opt, device) for opt in optimizers]))
    else: # `python -m bench.memory [device]`: this section alone, printed
        print(memory_section(run_memory(sys.argv[1] if len(sys.argv) > 1 else 'cpu')))
