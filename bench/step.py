"Section 2: whole training steps inside `fit`: FP32, `to_mixed()`, a hand-written master-weights loop, fastai's AMP; and the bookkeeping-bound fit vs fastai's `NonNativeMixedPrecision`."
from __future__ import annotations
import statistics, time
from functools import partial
import torch
from fastai.basics import Learner, Callback, CancelTrainException, CrossEntropyLossFlat, Adam, SGD
import fastai.callback.fp16 # to_fp16, to_bf16
from mpcallbacks.all import * # Learner.to_mixed
import copy
from mpcallbacks.policy import always_fp32
from mpcallbacks.digits import digits_dls, digits_cnn
from .common import (md_table, as_ratio, sync, quiet, batch_timer, median_ms, digits_mlp, linear_norm_stack, synthetic_dls,
                     to_non_native_fp16_any_device)

def _dtype_name(dtype) -> str: return str(dtype).split('.')[1]

class StopTrainingAfter(Callback):
    "End the training phase after `steps` batches: short fits, so that configs can take turns often"
    order = 1001 # after `TrainBatchTimes` recorded the batch
    def __init__(self, steps:int): self.steps = steps
    def after_batch(self):
        if self.training and self.iter + 1 >= self.steps: raise CancelTrainException()

def learner_step_times(make_model, dls, config:str, dtype, lr:float, steps:int, opt_func, device) -> list:
    "Seconds of each of the first `steps` training batches of a one-epoch `fit` with `config`"
    learn = Learner(dls, make_model(), loss_func=CrossEntropyLossFlat(), opt_func=opt_func, wd=0.)
    if config == 'to_mixed': learn.to_mixed(dtype)
    elif config == 'fastai AMP': learn.to_fp16() if dtype == torch.float16 else learn.to_bf16()
    elif config == 'fastai non-native': to_non_native_fp16_any_device(learn, max_loss_scale=2.**16) # our initial scale
    elif config != 'FP32': raise ValueError(f"Unknown config {config!r}")
    cbs,times = batch_timer(device)
    with quiet(learn): learn.fit(1, lr, cbs=cbs + [StopTrainingAfter(steps)])
    return times

def hand_loop_step_times(make_model, dls, dtype, lr:float, steps:int, opt_func, device) -> list:
    "Seconds of each of `steps` training steps of the same math as `to_mixed()` written out; `dtype=None`: plain FP32"
    model,loss_func = make_model().to(device),CrossEntropyLossFlat()
    if dtype is None: # the FP32 loop: the floor of the Learner's own overhead
        opt = opt_func(list(model.parameters()), lr=lr, wd=0.) # as the Learner's, built with wd=0.
        step = lambda xb,yb: (loss_func(model(xb), yb).backward(), opt.step(), opt.zero_grad())
    else:
        # The classic master-weights loop an expert writes by hand: a 16-bit copy of the model (BatchNorm kept FP32, as
        # `to_mixed()` keeps it), FP32 masters beside it, gradients copied over, the masters copied back after a step
        masters = [p for m in model.modules() if not isinstance(m, always_fp32) for p in m.parameters(recurse=False)]
        own32 = [p for m in model.modules() if isinstance(m, always_fp32) for p in m.parameters(recurse=False)]
        net = copy.deepcopy(model)
        for m in net.modules():
            if isinstance(m, always_fp32): continue
            for n,p in m._parameters.items():
                if p is not None: m._parameters[n] = torch.nn.Parameter(p.detach().to(dtype))
        model16 = [p for m in net.modules() if not isinstance(m, always_fp32) for p in m.parameters(recurse=False)]
        own32 = [p for m in net.modules() if isinstance(m, always_fp32) for p in m.parameters(recurse=False)] # trained as they are
        for m in masters: m.grad = torch.zeros_like(m)
        master_grads = [m.grad for m in masters]
        opt = opt_func(masters + own32, lr=lr, wd=0.)
        scale = 2.**16 if dtype == torch.float16 else 1. # to_mixed's 'auto': dynamic from 2**16 for float16, none for bfloat16
        inv_scale = torch.full((), 1./scale, device=device)
        def step(xb, yb):
            loss = loss_func(net(xb.to(dtype)).float(), yb) # FP32 loss
            (loss * scale if scale != 1. else loss).backward()
            grads16 = [p.grad for p in model16]
            torch._foreach_copy_(master_grads, grads16)
            for p in model16: p.grad = None # dropped, as the library does: the next backward refills them
            grads32 = master_grads + [p.grad for p in own32 if p.grad is not None]
            found_inf = torch.zeros((), device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads32, found_inf, inv_scale)
            if not found_inf.item(): # one host sync
                opt.step()
                with torch.no_grad(): torch._foreach_copy_(model16, masters)
            opt.zero_grad()
    times = []
    model.train()
    for xb,yb in dls.train: # the Learner's loader, so data loading is alike (and excluded from the times)
        sync(device)
        start = time.perf_counter()
        step(xb, yb)
        sync(device)
        times.append(time.perf_counter() - start)
        if len(times) == steps: break
    return times

def side_by_side_fits(runs:dict, rounds:int, skip:int, samples:dict|None=None) -> dict:
    "name -> median ms per step over `rounds` short fits of each run, taken in turn; the first `skip` steps of each fit are warm-up"
    # Background load comes in bursts of seconds: many short fits, in an order that rotates, spread it over all runs.
    times,names = {k:[] for k in runs},list(runs)
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]: times[k] += runs[k]()[skip:]
    if samples is not None: samples.update(times) # name -> the seconds of every timed step, for those who want the spread
    return {k:median_ms(v) for k,v in times.items()}

def run_whole_step(device, rounds:int=8, skip:int=2, steps:int=8, lr:float=1e-3) -> list:
    "One row per (model, dtype): median ms per training step of each config, side by side"
    dls = digits_dls(bs=64, device=device)
    models = {'digits CNN (BatchNorm)': digits_cnn, 'digits MLP': digits_mlp}
    rows = []
    for mname,make_model in models.items():
        for dtype in (torch.bfloat16, torch.float16):
            common = dict(dls=dls, lr=lr, steps=steps, opt_func=Adam, device=device)
            runs = {'FP32': partial(learner_step_times, make_model, config='FP32', dtype=None, **common),
                    'to_mixed': partial(learner_step_times, make_model, config='to_mixed', dtype=dtype, **common),
                    'hand loop': partial(hand_loop_step_times, make_model, dtype=dtype, **common),
                    'hand loop FP32': partial(hand_loop_step_times, make_model, dtype=None, **common),
                    'fastai AMP': partial(learner_step_times, make_model, config='fastai AMP', dtype=dtype, **common)}
            ms = side_by_side_fits(runs, rounds, skip)
            rows.append(dict(model=mname, dtype=_dtype_name(dtype), steps=steps, skip=skip, rounds=rounds, ms=ms,
                             mixed_vs_hand=ms['to_mixed'] / ms['hand loop'],
                             learner_vs_hand_fp32=ms['FP32'] / ms['hand loop FP32'],
                             # what the callback adds beyond the Learner's own per-batch overhead (the FP32 pair's gap)
                             callback_own_ms=(ms['to_mixed'] - ms['hand loop']) - (ms['FP32'] - ms['hand loop FP32'])))
    return rows

def run_bookkeeping_bound_fit(device, rounds:int=16, skip:int=2, bs:int=4, steps:int=6, lr:float=1e-3) -> dict:
    "The 202-tensor model, SGD without momentum, float16: `to_mixed()` vs fastai's non-native mixed precision, side by side"
    dls = synthetic_dls(bs=bs, n_train_batches=steps, device=device)
    common = dict(dls=dls, dtype=torch.float16, lr=lr, steps=steps, opt_func=partial(SGD, mom=0.), device=device)
    runs = {'FP32': partial(learner_step_times, linear_norm_stack, config='FP32', **common),
            'to_mixed': partial(learner_step_times, linear_norm_stack, config='to_mixed', **common),
            'fastai non-native (assert removed)': partial(learner_step_times, linear_norm_stack, config='fastai non-native', **common)}
    ms = side_by_side_fits(runs, rounds, skip)
    return dict(model='Linear+LayerNorm x50 (202 tensors, 13.2M)', bs=bs, steps=steps, skip=skip, rounds=rounds, ms=ms,
                mixed_vs_nonnative=ms['to_mixed'] / ms['fastai non-native (assert removed)'])

def whole_step_section(rows:list, bound:dict|None, device) -> str: # (`bound` None: the table of whole steps alone)
    configs,r0 = list(rows[0]['ms']),rows[0]
    cols = ['model', 'dtype'] + [f'{c} ms' for c in configs] + [
        'to_mixed / hand loop', 'FP32 Learner / FP32 hand loop', "callback's own ms (to_mixed - hand) - (FP32 - hand FP32)"]
    body = [[r['model'], r['dtype']] + [f"{r['ms'][c]:.2f}" for c in configs]
            + [as_ratio(r['mixed_vs_hand']), as_ratio(r['learner_vs_hand_fp32']), f"{r['callback_own_ms']:+.2f}"] for r in rows]
    note = ("**fastai AMP (`to_fp16()`/`to_bf16()`) trains FP32 on this CPU**: it uses `autocast('cuda')`, disabled without CUDA.\n\n"
            if device.type != 'cuda' else '')
    if bound is None: b_part = ''
    else:
        b_rows = [[k, f'{v:.2f}'] for k,v in bound['ms'].items()] + [['**to_mixed / fastai non-native**', as_ratio(bound['mixed_vs_nonnative'])]]
        b_part = (f"\n\n#### 2b. Bookkeeping-bound fit: {bound['model']}, bs {bound['bs']}, float16, SGD without momentum\n\n"
                  f"{bound['rounds']} rounds of short fits ({bound['steps']} steps, the first {bound['skip']} not timed), in turn. "
                  'fastai non-native = `ModelToHalf` + `NonNativeMixedPrecision(max_loss_scale=2**16)` with only the CUDA assert removed '
                  '(the same initial scale as ours).\n\n' + md_table(['config', 'ms per training step'], b_rows))
    return ('### 2. Whole training step inside `fit` (median ms per training batch, data loading and validation excluded)\n\n'
            f"Digits, bs 64, Adam (wd=0); {r0['rounds']} rounds of short fits ({r0['steps']} training steps, the first "
            f"{r0['skip']} not timed), the configs taking turns in a rotating order. "
            'hand loop = the same math as `to_mixed()` written out (same cast, FP32 loss, scaled backward, `_foreach_copy_` + '
            'fused unscale/check + one `.item()`, step on the masters, copy back), over the same DataLoader, without a Learner. '
            "hand loop FP32 = a plain FP32 loop, to show the Learner's own overhead; the last column is what `to_mixed()` "
            'costs beyond that overhead.\n\n'
            + note + md_table(cols, body) + b_part)


def main():
    """`python -m bench.step`: section 2's whole steps alone, on this machine's CPU with one torch thread, written to
    `bench/results/cpu_step.md` (the README quotes it for a CPU without native bfloat16: run it on one)"""
    import argparse, os, platform
    from datetime import datetime, timezone
    from pathlib import Path
    import fastai
    from mpcallbacks.cast import native_16bit_dtypes
    from .common import cpu_name
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument('--rounds', type=int, default=8, help='short fits of each config (default 8)')
    ap.add_argument('--out', default=str(Path(__file__).parent/'results'/'cpu_step.md'))
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = torch.device('cpu')
    native = ', '.join(sorted(_dtype_name(d) for d in native_16bit_dtypes(device))) or 'none'
    flags = set(next((l.split(':', 1)[1].split() for l in open('/proc/cpuinfo') if l.startswith('flags')), [])) if os.path.exists('/proc/cpuinfo') else set()
    vector = ', '.join(f for f in ('avx2', 'avx512f', 'avx512_bf16', 'avx512_fp16', 'amx_bf16') if f in flags) or 'not read'
    start = time.perf_counter()
    rows = run_whole_step(device, rounds=args.rounds)
    load = os.getloadavg()[0] if hasattr(os, 'getloadavg') else None
    text = (f"# Whole training steps on another CPU\n\ntorch {torch.__version__}, fastai {fastai.__version__}, Python "
            f"{platform.python_version()}; CPU: {cpu_name()}, {os.cpu_count()} cores, 1 torch thread; "
            f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; 16-bit types computed natively here: {native}; vector instructions: {vector}; {time.perf_counter() - start:.0f} s"
            + (f", 1-minute load average at the end {load:.1f}" if load is not None else '') + '. Every comparison within the table '
            'was measured side by side (interleaved rounds) in this run; times are medians.\n\n'
            + whole_step_section(rows, None, device) + '\n')
    Path(args.out).write_text(text)
    print(text)

if __name__ == '__main__': main()
