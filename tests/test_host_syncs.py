"Host syncs: over a whole `fit`, `to_mixed()` adds at most one per training step to FP32's, plus at most two per fit."
from collections import Counter
import pytest, torch
from fastai.basics import Callback
from mpcallbacks.test_utils import synth_learner, count_syncs, InjectNonFinite # the benchmark's counter too

pytestmark = pytest.mark.filterwarnings('ignore:float16 math is emulated')

def fit_syncs(learn, epochs:int, cbs=None) -> Counter:
    "Host syncs by method during a whole `learn.fit(epochs)`: set-up, training, validation, clean-up"
    with count_syncs() as counts: learn.fit(epochs, 1e-3, cbs=cbs)
    return counts

def extra_syncs(dtype, epochs:int=2, cbs=None) -> tuple: # (syncs beyond FP32's, training steps, both counters)
    "Syncs of a `to_mixed(dtype)` fit beyond those of the same FP32 fit"
    fp32 = fit_syncs(synth_learner(), epochs)
    learn = synth_learner().to_mixed(dtype)
    mixed = fit_syncs(learn, epochs, cbs)
    steps = epochs * len(learn.dls.train)
    return sum(mixed.values()) - sum(fp32.values()),steps,(fp32, mixed)

def within_budget(extra:int, steps:int) -> bool: return extra <= steps + 2 # one per step, two per fit

def test_counter_counts_reads_and_pageable_copies_as_cuda_syncs_them():
    t = torch.ones(())
    with count_syncs() as counts:
        t.item(); bool(t); float(t); int(t); t.tolist()
        torch.tensor([1.], device=t.device) # Python data to the device: a blocking copy from pageable memory
        torch.tensor([1.]).tolist() # host memory read on the host: none
    assert counts == Counter(item=1, __bool__=1, __float__=1, __int__=1, tolist=1, h2d=1)
    with count_syncs() as counts: pass
    assert not counts and torch.overrides._get_current_function_mode() is not None # (the suite's own rules stay on)

@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_to_mixed_adds_at_most_one_sync_per_step(dtype):
    extra,steps,(fp32, mixed) = extra_syncs(dtype)
    assert steps == 16 # two epochs of 256 items at bs 32: a fixed cost per fit cannot pass for a per-step one
    assert within_budget(extra, steps), f"{extra} syncs beyond FP32 over {steps} steps: FP32 {dict(fp32)}, mixed {dict(mixed)}"

class OneMoreSyncPerStep(Callback):
    "The regression the budget must catch: a second host sync in every optimizer step"
    def before_step(self): self.loss.item()

def test_budget_catches_a_second_sync_per_step():
    extra,steps,_ = extra_syncs(torch.float16, cbs=OneMoreSyncPerStep())
    assert extra >= 2 * steps # so the test above can fail: 32 > 16 + 2
    assert not within_budget(extra, steps)

def test_the_first_skip_reads_the_loss_in_the_steps_one_sync():
    "An optimizer that reads each step's flag: the loss of the fit's first skip is read with that flag, so a fit with skips adds one host sync per step, no more"
    fp32 = sum(fit_syncs(synth_learner(), 2).values())
    learn = synth_learner().to_mixed(torch.float16, init_scale=2.**8)
    mixed = sum(fit_syncs(learn, 2, cbs=[InjectNonFinite(at=[0, 3])]).values())
    assert learn.master_mixed_precision.skipped == 2 and len(learn.master_mixed_precision.scaler.history) == 16
    assert mixed - fp32 == 16 # one per step: each step's flag, the first skip's loss read with it
