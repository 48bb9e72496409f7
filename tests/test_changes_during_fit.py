"Changes a callback makes during a fit: a new optimizer, removing mixed precision, writing or reading the model's state."
import copy
import pytest, torch
from fastai.basics import Callback, set_seed
from mpcallbacks.all import MasterMixedPrecision
from mpcallbacks.test_utils import synth_learner, opt_params
from intact import assert_fp32_and_intact, hook_ids, call_lock_free

# ---- learn.create_opt() between epochs: the new optimizer steps the FP32 tensors and the cast layers keep training

class NewOptimizerAfterEpoch0(Callback):
    order = 90
    def __init__(self): self.snap, self.stepped = None, set()
    def after_epoch(self):
        if self.epoch != 0: return
        self.learn.create_opt()
        names = [n for n, _ in self.learn.model.named_parameters()]
        self.snap = {n:p.detach().float().clone() for n, p in zip(names, opt_params(self.learn))} # what the new optimizer steps
    def after_step(self):
        if self.epoch == 1: self.stepped |= {p.dtype for p in opt_params(self.learn)}

def test_create_opt_mid_fit_keeps_training_the_fp32_tensors():
    learn = synth_learner().to_mixed(torch.bfloat16)
    hooks = hook_ids(learn.model)
    cb = NewOptimizerAfterEpoch0()
    call_lock_free(learn.fit, 2, 1e-2, cbs=cb)
    assert cb.stepped == {torch.float32}, f"the new optimizer steps {cb.stepped} tensors"
    now = dict(learn.model.named_parameters())
    weights = [n for n, p in now.items() if p.dim() > 1] # the cast layers' weight matrices: they must keep training
    still = [n for n in weights if torch.equal(cb.snap[n], now[n].detach())]
    assert not still, f"stopped training after create_opt: {still}"
    assert_fp32_and_intact(learn, hooks)

# ---- to_unmixed() or remove_cb inside a fit: the fit ends with the FP32 model

@pytest.mark.parametrize('how', ['to_unmixed', 'remove_cb'])
def test_removing_mixed_precision_mid_fit_ends_fp32(how):
    learn = synth_learner().to_mixed(torch.bfloat16)
    hooks = hook_ids(learn.model)
    class Remove(Callback):
        order = 90
        def after_epoch(self):
            if self.epoch != 0: return
            if how == 'to_unmixed': self.learn.to_unmixed()
            else: self.learn.remove_cb(self.learn.master_mixed_precision)
    call_lock_free(learn.fit, 2, 1e-2, cbs=Remove())
    assert not any(isinstance(c, MasterMixedPrecision) for c in learn.cbs)
    assert_fp32_and_intact(learn, hooks)

# ---- snapshots of the model's state during a fit are the FP32 masters, and loading one at after_fit sticks

class SnapshotAndRestore(Callback):
    "Restore-best / EMA style: snapshot at the end of epoch 0, load it back at after_fit"
    order = MasterMixedPrecision.order - 1
    def after_epoch(self):
        if self.epoch != 0: return
        self.snap = copy.deepcopy(self.learn.model.state_dict())
        names = [n for n, _ in self.learn.model.named_parameters()]
        self.masters = {n:p.detach().clone() for n, p in zip(names, opt_params(self.learn))} # the optimizer's tensors now
    def after_fit(self): self.learn.model.load_state_dict(self.snap)

def test_state_dict_snapshot_mid_fit_is_fp32_masters_and_loading_it_at_after_fit_sticks():
    learn = synth_learner().to_mixed(torch.bfloat16)
    hooks = hook_ids(learn.model)
    cb = SnapshotAndRestore()
    call_lock_free(learn.fit, 2, 1e-2, cbs=cb)
    dtypes = {k:v.dtype for k, v in cb.snap.items() if v.is_floating_point()}
    assert set(dtypes.values()) == {torch.float32}, f"the snapshot holds {dtypes}"
    wrong = [n for n, m in cb.masters.items() if not torch.equal(cb.snap[n], m)]
    assert not wrong, f"snapshot differs from the FP32 masters at that moment: {wrong}"
    now = learn.model.state_dict()
    lost = [k for k, v in cb.snap.items() if not torch.equal(now[k], v.to(now[k].dtype)) or now[k].dtype != v.dtype]
    assert not lost, f"the snapshot loaded at after_fit was overwritten: {lost}"
    assert_fp32_and_intact(learn, hooks)


# ---- a checkpoint or a new optimizer between a forward and its backward

class SaveBeforeBackward(Callback):
    "At `before_backward` of every training batch: `learn.save` (with the optimizer) or `learn.create_opt`"
    order = 50
    def __init__(self, what): self.what = what
    def before_backward(self):
        if not self.training: return
        if self.what == 'save': self.learn.save('mid', with_opt=True)
        else: self.learn.create_opt()

@pytest.mark.parametrize('what', ['save', 'create_opt'])
def test_save_or_create_opt_between_forward_and_backward_trains_as_without(what, tmp_path):
    "As in FP32, the backward that follows still runs: the 16-bit copies autograd saved are put back untouched"
    def fit(cbs):
        set_seed(0)
        learn = synth_learner(path=tmp_path).to_mixed(torch.bfloat16)
        hooks = hook_ids(learn.model)
        call_lock_free(learn.fit, 1, 1e-2, cbs=cbs)
        return learn, hooks
    plain,_ = fit([])
    learn,hooks = fit([SaveBeforeBackward(what)])
    if what == 'save': # a fresh optimizer each batch trains differently (Adam's state starts over): compare saves only
        for a, b in zip(plain.model.parameters(), learn.model.parameters()): assert torch.equal(a, b)
        sd = torch.load(tmp_path/'models'/'mid.pth', weights_only=False)['model']
        assert {v.dtype for v in sd.values() if v.is_floating_point()} == {torch.float32}
    assert_fp32_and_intact(learn, hooks)
