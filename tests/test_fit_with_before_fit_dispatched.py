"A fit started with `before_fit` already dispatched (`learn(_before_epoch)`, `with learn:`), as fastai's own tests do, trains the cast layers as FP32 does."
import pytest, torch
from fastai.learner import _before_epoch # fastai's [before_fit, before_epoch], what `with learn:` dispatches
from mpcallbacks.test_utils import synth_learner
from intact import assert_fp32_and_intact, hook_ids, call_lock_free, moved

def dispatched_then_fit(learn): learn(_before_epoch); learn.fit(3, 1e-2)
def fit_inside_with(learn):
    with learn: learn.fit(3, 1e-2)

def train(how, mixed):
    learn = synth_learner()
    if mixed: learn.to_mixed(torch.bfloat16)
    hooks = hook_ids(learn.model)
    w0 = [p.detach().clone() for p in learn.model.parameters()]
    call_lock_free(how, learn)
    trained = {n:moved(a, p) for a, (n, p) in zip(w0, learn.model.named_parameters()) if p.dim() > 1} # the cast layers' weights
    losses = [float(l) for l in learn.recorder.losses]
    return learn, hooks, trained, sum(losses[:4])/4, sum(losses[-4:])/4

@pytest.mark.parametrize('how', [dispatched_then_fit, fit_inside_with])
def test_fit_with_before_fit_dispatched_trains_like_fp32(how):
    _, _, moved32, first32, last32 = train(how, mixed=False)
    assert all(moved32.values()) and last32 < 0.9 * first32 # the idiom trains in plain fastai
    learn, hooks, moved, first, last = train(how, mixed=True)
    assert moved == moved32, f"layers that did not train: {[n for n, m in moved.items() if not m]}"
    assert last < 0.9 * first and abs(last - last32) < 0.1 * last32, (first, last, last32)
    assert_fp32_and_intact(learn, hooks) # and a later ordinary fit trains every layer
