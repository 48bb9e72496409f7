"Checkpoints: `learn.load_checked` validates the scaler entry with our own clear error and loads nothing half-way; the learner's mode wins; growth resumes; Ctrl-C is never swallowed."
import copy, math, warnings
import pytest, torch
from fastai.basics import Callback
from fastai.optimizer import Optimizer
from fastai.callback.core import CancelFitException
from mpcallbacks.test_utils import synth_learner, InjectNonFinite
from test_with_fastai_callbacks import assert_same_state
from intact import assert_fp32_and_intact, hook_ids, call_lock_free

scaler_key = 'mpcallbacks.loss_scaler' # where a checkpoint keeps the scaler's state, next to the optimizer's

def tamper(path, **changes):
    "Rewrite the scaler entry of the checkpoint at `path`"
    sd = torch.load(path, weights_only=False)
    sd['opt'][scaler_key].update(changes)
    torch.save(sd, path)

class OneStep(Callback):
    order = 100
    def after_step(self): raise CancelFitException()

def float16_learner(path, **kwargs): return synth_learner(path=path).to_mixed(torch.float16, **kwargs)

def state_of(learn):
    return ([p.detach().clone() for p in learn.model.parameters()], [b.clone() for b in learn.model.buffers()],
            copy.deepcopy(learn.opt.state_dict()['state']), learn.master_mixed_precision.scaler.state_dict())

def assert_same_learner_state(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0])), "model weights changed"
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1])), "model buffers changed"
    assert_same_state(a[2], b[2])
    assert a[3] == b[3], f"scaler state changed: {a[3]} -> {b[3]}"

bad_entries = [('scale', math.nan), ('scale', None), ('scale', 0), ('scale', -1), ('scale', 'x'), ('scale', math.inf),
               ('growth_tracker', 1.5), ('growth_tracker', -1), ('skipped', -3)]

@pytest.mark.parametrize('key,value', bad_entries, ids=[f'{k}={v!r}' for k, v in bad_entries])
def test_bad_scaler_entry_fails_clearly_and_loads_nothing(tmp_path, key, value):
    learn = float16_learner(tmp_path, init_scale=2.**8)
    learn.fit(1, 1e-2, cbs=InjectNonFinite(at=[2]))
    learn.save('ck', with_opt=True)
    tamper(tmp_path/'models'/'ck.pth', **{key: value})
    learn.fit(1, 1e-2) # the learner moves on from the checkpoint
    hooks, before = hook_ids(learn.model), state_of(learn)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        with pytest.raises((ValueError, TypeError), match=key): call_lock_free(learn.load_checked, 'ck', with_opt=True)
    assert not [x for x in w if 'Could not load the optimizer state' in str(x.message)], "fastai's misleading warning"
    assert_same_learner_state(before, state_of(learn)) # nothing half-loaded
    assert_fp32_and_intact(learn, hooks)

def test_float16_checkpoint_into_unscaled_bfloat16_learner_keeps_scale_1(tmp_path):
    learn = float16_learner(tmp_path, init_scale=2.**8)
    learn.fit(1, 1e-2, cbs=InjectNonFinite(at=[2]))
    learn.save('ck', with_opt=True)
    other = synth_learner(path=tmp_path, seed=1).to_mixed(torch.bfloat16, loss_scale=None)
    hooks = hook_ids(other.model)
    other.load('ck', with_opt=True)
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(learn.model.parameters(), other.model.parameters()))
    assert other.master_mixed_precision.loss_scale == 1.0, "the checkpoint's mode replaced the learner's"
    other.fit(1, 1e-2)
    assert other.master_mixed_precision.loss_scale == 1.0
    assert_fp32_and_intact(other, hooks)

def test_growth_counter_above_the_new_interval_grows_at_the_next_good_step(tmp_path):
    learn = float16_learner(tmp_path, init_scale=2.**8, growth_interval=10_000)
    learn.create_opt()
    learn.save('ck', with_opt=True)
    tamper(tmp_path/'models'/'ck.pth', growth_tracker=5000) # 5000 good steps in a row, of 10000 needed there
    other = float16_learner(tmp_path, init_scale=2.**8, growth_interval=2000)
    hooks = hook_ids(other.model)
    other.load('ck', with_opt=True)
    other.fit(1, 1e-2, cbs=OneStep())
    mmp = other.master_mixed_precision
    assert mmp.skipped == 0 and mmp.loss_scale == 2.**9, f"scale {mmp.loss_scale} after a good step past the interval"
    assert_fp32_and_intact(other, hooks)

def test_ctrl_c_inside_load_is_not_swallowed(tmp_path, monkeypatch):
    learn = synth_learner(path=tmp_path).to_mixed(torch.bfloat16)
    learn.fit(1, 1e-2)
    learn.save('ck', with_opt=True)
    hooks = hook_ids(learn.model)
    def interrupted(self, sd): raise KeyboardInterrupt
    monkeypatch.setattr(Optimizer, 'load_state_dict', interrupted)
    with pytest.raises(KeyboardInterrupt): call_lock_free(learn.load_checked, 'ck', with_opt=True)
    monkeypatch.undo()
    assert_fp32_and_intact(learn, hooks)

def test_a_checkpoint_written_after_fit_one_cycle_is_checked_too(tmp_path):
    "fit_one_cycle leaves numpy scalars in the optimizer's hyper-parameters: the check reads the file as fastai's load does"
    import fastai.callback.schedule # fit_one_cycle
    learn = float16_learner(tmp_path)
    learn.fit_one_cycle(1, 1e-2)
    learn.save('ck', with_opt=True)
    tamper(tmp_path/'models'/'ck.pth', scale=-1.)
    before = state_of(learn)
    with pytest.raises(ValueError, match='scale'): call_lock_free(learn.load_checked, 'ck', with_opt=True)
    assert_same_learner_state(before, state_of(learn)) # nothing half-loaded
