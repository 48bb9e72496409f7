"Train a learner twice on the same seed, in FP32 and under `to_mixed()`, and compare what the two fits leave behind."
from dataclasses import dataclass, field
import torch
from fastai.basics import Callback, set_seed, noop
import mpcallbacks.all # noqa: F401 (`Learner.to_mixed`)
from intact import not_fp32, call_lock_free

class LossLog(Callback):
    "Each training batch's loss, as the loss function returned it"
    order = 100
    def __init__(self): self.losses = []
    def after_batch(self):
        if self.training: self.losses.append(float(self.learn.loss.detach()))

def quiet(learn):
    "No progress bar, no printed metrics"
    learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ == 'ProgressCallback'])
    learn.logger = noop
    return learn

@dataclass
class Run:
    "What a fit left: the learner, its weights before the fit and each training batch's loss"
    learn: object
    before: dict
    losses: list = field(default_factory=list)

    @property
    def after(self) -> dict: return {n:p.detach().clone() for n,p in self.learn.model.named_parameters()}

    def mean_loss(self, first:bool, k:int) -> float:
        ls = self.losses[:k] if first else self.losses[-k:]
        return sum(ls) / len(ls)

def fit_once(make, mixed=None, epochs=2, lr=1e-2, cbs=(), seed=0, fit=None) -> Run:
    "`make()` a learner on `seed`, mix it with `mixed` (kwargs of `to_mixed`, or None for FP32), fit it"
    set_seed(seed, reproducible=True)
    learn = quiet(make())
    if mixed is not None: learn.to_mixed(**{'dtype': torch.float16, **mixed})
    before = {n:p.detach().clone() for n,p in learn.model.named_parameters()}
    log = LossLog()
    if fit is None: call_lock_free(learn.fit, epochs, lr, cbs=[log, *cbs])
    else: call_lock_free(fit, learn, [log, *cbs])
    return Run(learn, before, log.losses)

def amax(t) -> float: return t.abs().max().item() if t.numel() else 0. # (fastai makes empty layers: BatchNorm1d(0))

def update_cosine(ref:Run, mix:Run) -> float:
    "Cosine between the two fits' total weight updates, all trained parameters flattened together"
    a,b = ref.after,mix.after
    da = torch.cat([(a[n] - ref.before[n]).flatten().double() for n in a])
    db = torch.cat([(b[n].double() - mix.before[n].double()).flatten() for n in a])
    return float(torch.nn.functional.cosine_similarity(da, db, dim=0))

def fp32_valid_loss(run:Run) -> float:
    "The validation loss of the model the fit left, in FP32 (our callback removed first, so nothing is cast)"
    run.learn.to_unmixed()
    return float(run.learn.validate()[0])

def assert_like_fp32(ref:Run, mix:Run, loss_rtol=0.15, k=4, cos_min=0.5, falls=True, valid=True):
    """`mix` trained as `ref` did: its loss fell, ended within `loss_rtol` (+0.05) of FP32's (mean of the last `k` batches), the
    FP32 model after fit holds FP32 tensors only, every parameter FP32 moved moved and every one it left bit-identical
    stayed (up to a rounding residue, see below), the total update points the same way (cosine >= `cos_min`: Adam turns the noise of near-zero gradients
    into full-size steps of either sign, so chaotic nets stay well below 1), and the model after fit, run in FP32, has a
    validation loss within `loss_rtol` (+0.05) of FP32's"""
    assert len(mix.losses) == len(ref.losses) and mix.losses, f"{len(mix.losses)} training batches, FP32 ran {len(ref.losses)}"
    assert all(torch.isfinite(torch.tensor(mix.losses))), f"non-finite losses: {mix.losses}"
    if falls:
        assert ref.mean_loss(False, k) < ref.mean_loss(True, k), f"the FP32 run itself did not learn: {ref.losses}"
        assert mix.mean_loss(False, k) < mix.mean_loss(True, k), f"the loss did not fall: {mix.losses}"
    end32,end16 = ref.mean_loss(False, k),mix.mean_loss(False, k)
    assert abs(end16 - end32) <= loss_rtol * abs(end32) + 0.05, f"final loss {end16:.4f}, FP32 {end32:.4f} (rtol {loss_rtol})"
    bad = not_fp32(mix.learn.model)
    assert not bad, f"tensors left in 16 bits after fit: {bad}"
    a,b = ref.after,mix.after
    assert list(a) == list(b)
    frozen32 = {n for n in a if torch.equal(a[n], ref.before[n])}
    frozen16 = {n for n in b if torch.equal(b[n], mix.before[n])}
    assert not frozen16 - frozen32, f"FP32 trains these, mixed left them untouched: {sorted(frozen16 - frozen32)}"
    # A parameter whose gradient is zero in exact math (a conv bias before BatchNorm) gets exactly 0 in FP32 and a rounding
    # residue in 16 bits: allowed, if its change stays under 1e-3 of FP32's largest update
    biggest = max(amax(a[n] - ref.before[n]) for n in a)
    drift = {n:amax(b[n] - mix.before[n]) for n in frozen32 - frozen16}
    moved = {n:d for n,d in drift.items() if d > 1e-3 * biggest}
    assert not moved, f"FP32 leaves these untouched, mixed moved them: {moved} (FP32's largest update {biggest:.3g})"
    cos = update_cosine(ref, mix)
    assert cos >= cos_min, f"the weight update differs from FP32's: cosine {cos:.3f} < {cos_min}"
    if valid:
        v32,v16 = fp32_valid_loss(ref),fp32_valid_loss(mix)
        assert abs(v16 - v32) <= loss_rtol * abs(v32) + 0.05, f"validation loss after fit {v16:.4f}, FP32 {v32:.4f}"
