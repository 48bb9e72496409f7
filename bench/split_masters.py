"""16+16 masters vs the default bfloat16 mode: whole training steps inside `fit`, interleaved, medians, one thread; and where
a 16+16 step's time goes. Run: `python -m bench.split_masters [rounds]`."""
from __future__ import annotations
import statistics, sys, time
from collections import defaultdict
from functools import partial
import torch
from fastai.basics import Learner, Callback, CrossEntropyLossFlat, Adam, OptimWrapper
from mpcallbacks.all import * # Learner.to_mixed
import mpcallbacks.split_masters as sm
from .common import quiet, batch_timer, linear_norm_stack, synthetic_dls, n_params, n_tensors
from .step import StopTrainingAfter

optimizers = {'fastai Adam': Adam, 'OptimWrapper(AdamW)': partial(OptimWrapper, opt=torch.optim.AdamW)}

class StepWindow(Callback):
    "Seconds from mixed precision's `before_step` to its `after_step`: unscale and check, the optimizer, the copy-back or split"
    order = 9 # just before `MasterMixedPrecision` (10) at before_step; at after_step, just before it too (see `after_step`)
    def __init__(self): self.times,self.t0 = [],None
    def before_step(self): self.t0 = time.perf_counter()
    def after_step(self): # runs before ours (order 10): take the time at the next event instead
        self.pending = True
    def after_batch(self):
        if self.t0 is not None and getattr(self, 'pending', False): self.times.append(time.perf_counter() - self.t0)
        self.t0,self.pending = None,False

def fit_times(masters:str, opt_func, steps:int) -> tuple:
    "Per-batch and per-step-window seconds of a short fit of the 202-tensor model (batch 4)"
    learn = Learner(synthetic_dls(bs=4, n_train_batches=steps), linear_norm_stack(), loss_func=CrossEntropyLossFlat(),
                    opt_func=opt_func, wd=0.)
    learn.to_mixed(torch.bfloat16, masters=masters)
    cbs,times = batch_timer('cpu')
    win = StepWindow()
    with quiet(learn): learn.fit(1, 1e-3, cbs=cbs + [StopTrainingAfter(steps), win])
    return times,win.times

def side_by_side(opt_name:str, rounds:int=9, steps:int=6, skip:int=2) -> dict:
    "Medians (ms) of the default bfloat16 mode and 16+16, taking turns (the order flips every round)"
    kinds = ['fp32', '16+16']
    whole,window = defaultdict(list),defaultdict(list)
    for r in range(rounds):
        for k in (kinds if r % 2 == 0 else kinds[::-1]):
            w,s = fit_times(k, optimizers[opt_name], steps)
            whole[k] += w[skip:]; window[k] += s[skip:]
    med = lambda v: 1e3 * statistics.median(v)
    return {k: (med(whole[k]), med(window[k])) for k in kinds}

def breakdown(opt_name:str, steps:int=6, skip:int=2) -> dict:
    "ms per 16+16 step in: the inf/NaN check, gradients to FP32 (convert + unscale), rebuild, split, the optimizer's own math"
    acc = defaultdict(float)
    def timed(name, f):
        def inner(*a, **k):
            t0 = time.perf_counter()
            try: return f(*a, **k)
            finally: acc[name] += time.perf_counter() - t0
        return inner
    saved = {n: getattr(sm, n) for n in ('nonfinite_flag', 'split_bf16_', 'rebuild_fp32')}
    saved_m = {n: getattr(sm.SplitMasters, n) for n in ('fp32_grad', 'step_masters')}
    try:
        sm.nonfinite_flag = timed('check', saved['nonfinite_flag'])
        sm.split_bf16_ = timed('split', saved['split_bf16_'])
        sm.rebuild_fp32 = timed('rebuild', saved['rebuild_fp32'])
        sm.SplitMasters.fp32_grad = timed('gradient to FP32', saved_m['fp32_grad'])
        sm.SplitMasters.step_masters = timed('step total', saved_m['step_masters'])
        fit_times('16+16', optimizers[opt_name], skip) # warm-up, not counted
        acc.clear()
        fit_times('16+16', optimizers[opt_name], steps)
    finally:
        for n,f in saved.items(): setattr(sm, n, f)
        for n,f in saved_m.items(): setattr(sm.SplitMasters, n, f)
    per = {k: 1e3 * v / steps for k,v in acc.items()}
    per['optimizer math and loop'] = per['step total'] - per['rebuild'] - per['split'] - per['gradient to FP32']
    return per

if __name__ == '__main__':
    torch.set_num_threads(1)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    m = linear_norm_stack()
    print(f"model: {n_tensors(m)} tensors, {n_params(m)/1e6:.1f}M parameters, batch 4, bfloat16, 1 thread, {rounds} rounds interleaved")
    for opt_name in optimizers:
        r = side_by_side(opt_name, rounds)
        (w0,s0),(w1,s1) = r['fp32'],r['16+16']
        print(f"{opt_name:20} whole step: default {w0:.1f} ms, 16+16 {w1:.1f} ms ({w1/w0:.2f}x); "
              f"before_step..after_batch: default {s0:.1f} ms, 16+16 {s1:.1f} ms ({s1/s0:.2f}x)", flush=True)
    for opt_name in optimizers:
        per = breakdown(opt_name)
        print(f"{opt_name:20} 16+16 step, ms: " + ', '.join(f"{k} {v:.1f}" for k,v in per.items()), flush=True)
