"Loss scales outside float32's normal range (1/scale infinite, or the scale itself infinite) are refused at to_mixed and at load; the masters never take a non-finite step."
import pytest, torch
from mpcallbacks.test_utils import synth_learner
from test_checkpoints import tamper, float16_learner, state_of, assert_same_learner_state
from intact import assert_fp32_and_intact, hook_ids, call_lock_free

extreme = [dict(loss_scale=1e-39), dict(min_scale=1e-39), dict(loss_scale=1e39), dict(init_scale=1e39),
           dict(loss_scale=2.**-127), dict(init_scale=2.**128)]

@pytest.mark.parametrize('kwargs', extreme, ids=lambda kw: ','.join(f'{k}={v:g}' for k, v in kw.items()))
def test_extreme_scale_is_refused_at_to_mixed_naming_the_argument(kwargs):
    learn = synth_learner()
    (name,) = kwargs
    with pytest.raises(ValueError, match=name): learn.to_mixed(torch.float16, **kwargs)
    assert_fp32_and_intact(learn, fit=False)

@pytest.mark.parametrize('scale', [1e-39, 1e39])
def test_extreme_scale_in_a_checkpoint_is_refused_at_load(tmp_path, scale):
    learn = float16_learner(tmp_path, init_scale=2.**8)
    learn.fit(1, 1e-2)
    learn.save('ck', with_opt=True)
    tamper(tmp_path/'models'/'ck.pth', scale=scale)
    hooks, before = hook_ids(learn.model), state_of(learn)
    with pytest.raises(ValueError, match='scale'): call_lock_free(learn.load_checked, 'ck', with_opt=True)
    assert_same_learner_state(before, state_of(learn))
    assert_fp32_and_intact(learn, hooks)

def test_subnormal_scale_never_steps_the_masters_to_non_finite():
    learn = synth_learner().to_mixed(torch.bfloat16, loss_scale=2.**4)
    hooks = hook_ids(learn.model)
    learn.fit(1, 1e-2)
    try: learn.master_mixed_precision.scaler.scale = 1e-39 # what a tiny floor or an unchecked checkpoint led to
    except (ValueError, TypeError, AttributeError): pytest.skip('a subnormal scale cannot be set through the public API')
    try: call_lock_free(learn.fit, 1, 1e-2)
    except Exception: pass # refusing to go on is fine; stepping on inf/NaN is not
    bad = [n for n, p in learn.model.named_parameters() if not torch.isfinite(p).all()]
    assert not bad, f"non-finite masters after a step with 1/scale = inf: {bad}"
    learn.master_mixed_precision.scaler.scale = 2.**4
    assert_fp32_and_intact(learn, hooks)
