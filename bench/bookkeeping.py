"Section 1: the master-weight bookkeeping alone (grad path, and the cast that replaces the copy-back) vs fastai's per-parameter helpers vs a plain copy."
from __future__ import annotations
import torch, torchvision
from torch import nn
from fastai.callback.fp16 import to_master_grads, grad_overflow, to_model_params
import copy
from mpcallbacks.policy import cast_summary
from mpcallbacks.master import MasterParams
from mpcallbacks.scaler import LossScaler
from .common import md_table, as_ratio, time_side_by_side, median_ms, linear_norm_stack, n_tensors, n_params

def bookkeeping_models() -> dict:
    "ResNet-18 (62 tensors, 11.7M parameters) and a model with 202 tensors and 13.2M parameters"
    torch.manual_seed(0)
    return {'ResNet-18': torchvision.models.resnet18(weights=None), 'Linear+LayerNorm x50': linear_norm_stack()}

def _16bit_params_with_grads(model:nn.Module, dtype:torch.dtype) -> list:
    "16-bit copies of `model`'s parameters, each with a small random gradient, as after a scaled backward"
    res = [nn.Parameter(p.detach().to(dtype)) for p in model.parameters()]
    for p in res: p.grad = (torch.randn_like(p, dtype=torch.float32) * 1e-2).to(dtype)
    return res

def _fp32_masters(model:nn.Module) -> list: return [nn.Parameter(p.detach().clone()) for p in model.parameters()]

def bookkeeping_fns(model:nn.Module, dtype=torch.float16, device='cpu', loss_scale:float=2.**16) -> dict:
    "name -> one step's bookkeeping for `model`'s parameters, every variant with its own tensors"
    model = model.to(device)
    numel = n_params(model)
    # Ours: the masters are the model's parameters and autograd hands them FP32 gradients; what is left per step is
    # `MasterParams.after_backward` (one fused unscale-and-check pass) and the step's one `.item()`.
    ours32 = _fp32_masters(model)
    masters,scaler = MasterParams(ours32),LossScaler(init_scale=loss_scale)
    ours_g32 = [torch.randn_like(p) * 1e-2 for p in ours32]
    def backward_done(): # untimed: fresh FP32 gradients, as backward writes them (the previous run's were unscaled in place)
        for p,g in zip(ours32, ours_g32): p.grad = g.clone()
        masters.before_backward(1.) # (no gradients were there before this backward: nothing to scale)
    def ours_grad_path():
        masters.after_backward(scaler.unscale_)
        res = masters.found_inf.item() # the callback's one host sync per step
        masters.skip() # (frees the gradients, as the step does)
        return res
    # The copy-back's place is taken by the casts the next forward makes: autocast casts each weight its 16-bit ops read,
    # once per forward (its cache), in the op: one `.to` per weight of the layers it casts (`cast_summary`'s 16-bit rows).
    rows = cast_summary(model, dtype)
    cast_mods = set(rows.module[rows.forward == str(dtype).split('.')[1]])
    autocast_weights = [p for n,m in model.named_modules() if n in cast_mods for p in m.parameters(recurse=False)]
    def ours_copy_back(): return [p.to(dtype) for p in autocast_weights]

    # fastai: what `NonNativeMixedPrecision.before_step` and `after_step` run (dynamic scaling, no clipping).
    fa16,fa32 = [_16bit_params_with_grads(model, dtype)],[_fp32_masters(model)]
    def fastai_grad_path():
        if grad_overflow(fa16): return True # one `float(x.float().sum())` per tensor
        to_master_grads(fa16, fa32)
        for p in fa32[0]: p.grad.div_(loss_scale)
        return False
    def fastai_copy_back(): to_model_params(fa16, fa32)

    # Reference variants of our grad path, to show where its time goes.
    ref16,ref32 = _16bit_params_with_grads(model, dtype),_fp32_masters(model)
    for p in ref32: p.grad = torch.zeros_like(p)
    ref_g16,ref_g32 = [p.grad for p in ref16],[p.grad for p in ref32]
    inv_scale = torch.full((), 1./loss_scale, device=device) # exact: the scale is a power of two
    def foreach_copy_unscale(): # the library's two fused ops alone, without its list building
        torch._foreach_copy_(ref_g32, ref_g16)
        found_inf = torch.zeros((), device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(ref_g32, found_inf, inv_scale)
        return found_inf.item()
    flat16,flat32 = torch.randn(numel, device=device).to(dtype),torch.empty(numel, device=device)
    def flat_copy_unscale(): # gradients in one flat buffer per dtype: one copy, one unscale
        flat32.copy_(flat16)
        found_inf = torch.zeros((), device=device)
        torch._amp_foreach_non_finite_check_and_unscale_([flat32], found_inf, inv_scale)
        return found_inf.item()

    # The floor: moving the same number of values once, in one flat tensor.
    copy16,copy32 = torch.randn(numel, device=device).to(dtype),torch.randn(numel, device=device)
    def copy_16_to_32(): copy32.copy_(copy16)
    def copy_32_to_16(): copy16.copy_(copy32)
    return {'copy_ 16->32': copy_16_to_32, 'copy_ 32->16': copy_32_to_16,
            'ours grad path': (backward_done, ours_grad_path), 'fastai grad path': fastai_grad_path,
            'ours copy-back': ours_copy_back, 'fastai copy-back': fastai_copy_back,
            'ref: foreach copy+unscale': foreach_copy_unscale, 'ref: flat copy+unscale': flat_copy_unscale}

def run_bookkeeping(device, warmup:int=5, repeats:int=25, dtype=torch.float16) -> list:
    "One row per model: median ms of each variant, measured side by side, and the ratios the targets use"
    rows = []
    for name,model in bookkeeping_models().items():
        fns = bookkeeping_fns(model, dtype, device)
        ms = {k:median_ms(v) for k,v in time_side_by_side(fns, device, warmup, repeats).items()}
        rows.append(dict(model=name, tensors=n_tensors(model), params_M=n_params(model)/1e6, ms=ms,
            grad_vs_copy=ms['ours grad path'] / ms['copy_ 16->32'],
            fastai_vs_ours=ms['fastai grad path'] / ms['ours grad path'],
            back_vs_copy=ms['ours copy-back'] / ms['copy_ 32->16'],
            back_vs_copy16=ms['ours copy-back'] / ms['copy_ 16->32'],
            fastai_vs_copy=ms['fastai grad path'] / ms['copy_ 16->32'])) # the most any grad path could gain over fastai's
        del model, fns
    return rows

def bookkeeping_section(rows:list) -> str:
    variants = list(rows[0]['ms'])
    cols = ['ms per step (median)'] + [f"{r['model']} ({r['tensors']} tensors, {r['params_M']:.1f}M)" for r in rows]
    body = [[v] + [f"{r['ms'][v]:.2f}" for r in rows] for v in variants]
    body += [['**ours grad path / copy_ 16->32**'] + [as_ratio(r['grad_vs_copy']) for r in rows],
             ['**fastai grad path / ours**'] + [as_ratio(r['fastai_vs_ours']) for r in rows],
             ['fastai grad path / copy_ 16->32 (the most a grad path could gain)'] + [as_ratio(r['fastai_vs_copy']) for r in rows],
             ['**ours copy-back / copy_ 32->16**'] + [as_ratio(r['back_vs_copy']) for r in rows],
             ['ours copy-back / copy_ 16->32'] + [as_ratio(r['back_vs_copy16']) for r in rows]]
    return ('### 1. Bookkeeping per optimizer step (float16 parameters)\n\n'
            'ours grad path = `MasterParams.after_backward()` (`LossScaler.unscale_()` on the FP32 gradients autograd wrote into '
            'the masters, the model\'s own parameters) + one `.item()`; ours copy-back = the casts the next forward makes in its '
            'place: autocast\'s cast of each weight its 16-bit ops read, once per forward (the masters stay in the model\'s slots). '
            'fastai grad path = `grad_overflow` + `to_master_grads` + per-parameter `div_` (as `NonNativeMixedPrecision.before_step`); '
            'fastai copy-back = `to_model_params`. copy_ = one flat tensor of the same number of values. '
            'The `ref:` rows are variants of our grad path, for where its time goes.\n\n' + md_table(cols, body))
