"A checkpoint's run of skips goes on only where its scale does: a float16 checkpoint saved during a run of overflows does not stop a bfloat16 learner at its first skip; the total of skipped steps carries."
import torch, pytest
from mpcallbacks.all import LossScaler, NonFiniteGradients
from mpcallbacks.test_utils import synth_learner, InjectNonFinite
from intact import call_lock_free

def test_a_float16_run_of_skips_does_not_stop_a_bfloat16_learner_at_its_first_skip(tmp_path):
    f16 = synth_learner(path=tmp_path).to_mixed(torch.float16)
    with pytest.raises(NonFiniteGradients, match='All 32'): # 32 overflows in a row, under float16's limit of 41: every step of the fit
        f16.fit(4, 1e-2, cbs=InjectNonFinite(at=range(32)))
    assert f16.master_mixed_precision.scaler.consecutive_skips == 32
    f16.save('ck', with_opt=True)
    bf16 = synth_learner(path=tmp_path, seed=1).to_mixed(torch.bfloat16) # no scaling: a limit of 25 in a row
    call_lock_free(bf16.load_checked, 'ck', with_opt=True)
    scaler = bf16.master_mixed_precision.scaler
    assert (scaler.scale, scaler.skipped, scaler.consecutive_skips) == (1., 32, 0)
    bf16.fit(1, 1e-2, cbs=InjectNonFinite(at=[0])) # raised "33 optimizer steps in a row" before
    assert scaler.skipped == 33 and scaler.consecutive_skips == 0

def test_the_run_goes_on_where_the_scale_does():
    "Both dynamic: the scale is restored, and so is its run, with a limit still counted from where it began"
    a = LossScaler(2.**16)
    for _ in range(10): a.update(True)
    b = LossScaler(2.**16); b.load_state_dict(a.state_dict())
    assert (b.scale, b.consecutive_skips, b.max_consecutive_skips) == (a.scale, 10, a.max_consecutive_skips)
    s = LossScaler(8., dynamic=False)
    for _ in range(3): s.update(True)
    same, other = LossScaler(8., dynamic=False), LossScaler(4., dynamic=False)
    same.load_state_dict(s.state_dict()); other.load_state_dict(s.state_dict())
    assert (same.consecutive_skips, other.consecutive_skips, other.skipped, other.scale) == (3, 0, 3, 4.)

def test_start_at_lowers_only_a_dynamic_scale_that_has_not_stepped():
    from mpcallbacks.scaler import LossScaler
    s = LossScaler(2.**16, min_scale=4.)
    s.start_at(2.**20); assert s.scale == 2.**16 # never raised
    s.start_at(16.); assert s.scale == 16.
    s.start_at(1.); assert s.scale == 4. # never below min_scale
    static = LossScaler(128., dynamic=False)
    static.start_at(2.); assert static.scale == 128. # a static scale is the user's
    stepped = LossScaler(2.**16)
    stepped.update(False)
    stepped.start_at(16.); assert stepped.scale == 2.**16 # a scale that stepped moves by the dynamic rule alone
