"Section 4: host syncs (`item`, `bool`, `float`, `int`, `tolist` on tensors) over a whole `fit`, set-up and validation included."
from __future__ import annotations
from functools import partial
import torch
from fastai.basics import Learner, CrossEntropyLossFlat, SGD
from mpcallbacks.all import * # Learner.to_mixed
from mpcallbacks.digits import digits_dls, digits_cnn
from mpcallbacks.test_utils import count_syncs
from .common import md_table, adam_optimizers, quiet, linear_norm_stack, synthetic_dls, n_tensors, to_non_native_fp16_any_device

def fit_syncs(learn:Learner, epochs:int=1) -> int:
    "Host syncs during `learn.fit(epochs)`"
    with quiet(learn), count_syncs() as counts: learn.fit(epochs, 1e-3)
    return sum(counts.values())

def _learner(make_model, dls, config:str, opt_func=partial(SGD, mom=0.)) -> Learner:
    learn = Learner(dls, make_model(), loss_func=CrossEntropyLossFlat(), opt_func=opt_func)
    if config.startswith('to_mixed'): learn.to_mixed(getattr(torch, config.split()[1]))
    elif config == 'fastai non-native': to_non_native_fp16_any_device(learn, max_loss_scale=2.**16)
    elif config != 'FP32': raise ValueError(f"Unknown config {config!r}")
    return learn

def _cases(device) -> dict: # name -> (make_model, dls)
    return {'digits CNN': (digits_cnn, digits_dls(bs=64, device=device)),
            'Linear+LayerNorm x50': (linear_norm_stack, synthetic_dls(bs=4, n_train_batches=4, device=device))}

def run_syncs(device) -> list:
    "One row per (model, config): syncs per fit, and the extra ones per training step beyond FP32"
    cases = _cases(device)
    rows = []
    for mname,(make_model,dls) in cases.items():
        steps = len(dls.train)
        fp32 = fit_syncs(_learner(make_model, dls, 'FP32'))
        for config in ('FP32', 'to_mixed float16', 'to_mixed bfloat16', 'fastai non-native'):
            n = fp32 if config == 'FP32' else fit_syncs(_learner(make_model, dls, config))
            rows.append(dict(model=mname, tensors=n_tensors(make_model()), config=config, train_steps=steps, syncs=n,
                             extra=n - fp32, extra_per_step=(n - fp32) / steps,
                             within_budget=n - fp32 <= steps + 2)) # the target: at most one per step, plus two per fit
    return rows

def run_optimizer_syncs(device) -> list:
    "One row per (model, optimizer, config): syncs per fit with fastai's Adam or fused AdamW, and the extra ones beyond FP32's"
    rows = []
    for mname,(make_model,dls) in _cases(device).items():
        steps = len(dls.train)
        for o,(oname,opt_func) in adam_optimizers.items():
            fp32 = fit_syncs(_learner(make_model, dls, 'FP32', opt_func))
            for config in ('FP32', 'to_mixed bfloat16', 'to_mixed float16'):
                n = fp32 if config == 'FP32' else fit_syncs(_learner(make_model, dls, config, opt_func))
                rows.append(dict(model=mname, tensors=n_tensors(make_model()), opt=oname, config=config, train_steps=steps,
                                 syncs=n, extra=n - fp32, extra_per_step=(n - fp32) / steps))
    return rows

def syncs_section(rows:list) -> str:
    cols = ['model', 'tensors', 'config', 'train steps', 'syncs per fit', 'extra vs FP32', 'extra per step', '<= steps + 2']
    body = [[r['model'], r['tensors'], r['config'], r['train_steps'], r['syncs'], r['extra'], f"{r['extra_per_step']:.2f}",
             'yes' if r['within_budget'] else 'no'] for r in rows]
    return ('### 4. Host syncs over one whole `fit` (set-up and validation included)\n\n'
            'Calls of `Tensor.item`, `__bool__`, `__float__`, `__int__`, `tolist`, counted by wrapping them.\n\n' + md_table(cols, body))

def optimizer_syncs_section(rows:list) -> str:
    cols = ['model', 'tensors', 'optimizer', 'config', 'train steps', 'syncs per fit', 'extra vs FP32 (same optimizer)', '**extra per step**']
    body = [[r['model'], r['tensors'], r['opt'], r['config'], r['train_steps'], r['syncs'], r['extra'], f"**{r['extra_per_step']:.2f}**"]
            for r in rows]
    return ("#### 8c. Host syncs per training step with fastai's Adam and fused AdamW\n\n"
            'As section 4 counts them, over one whole `fit` (set-up and validation included); the extra ones against an FP32 fit '
            'with the same optimizer, divided by the training steps. With fused AdamW the step\'s inf/NaN flag is recorded once it '
            'has landed on the host (a CPU\'s at once, from memory, as the step begins: a finite step\'s kernel then gets no flag; '
            'an accelerator\'s after a copy that does not block): no read waits for the device; the step\'s loss travels with its flag until the fit\'s first skip is known, to say whether that '
            'loss was itself non-finite with no read of its own. fused AdamW = '
            '`partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True))`.\n\n' + md_table(cols, body))

if __name__ == '__main__': # `python -m bench.syncs`: section 4 and the optimizers' host syncs of section 8, printed
    torch.set_num_threads(1)
    print(syncs_section(run_syncs('cpu')) + '\n\n' + optimizer_syncs_section(run_optimizer_syncs('cpu')))
