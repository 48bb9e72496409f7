"""A fit's lifetime has one owner, `MixedFit`: its close cannot half-happen, and nothing of a fit outlives it, whatever
fails: an optimizer built inside a forward, an export that fails, a Ctrl-C inside the close itself."""
import gc, pickle, weakref, torch
from torch.utils._python_dispatch import TorchDispatchMode
import pytest
from torch import nn
from fastai.basics import Callback
from mpcallbacks.all import MasterMixedPrecision
from mpcallbacks import cast, mixed_fit
from mpcallbacks.cast import ModelCast
from mpcallbacks.test_utils import synth_learner, opt_params
from intact import assert_fp32_and_intact, assert_at_rest, call_lock_free

class CreateOptInForward(Callback):
    "Build the learner's optimizer from a hook inside the model's forward, once"
    order = 50
    def before_fit(self): self.h = self.learn.model[-1].register_forward_pre_hook(self.build)
    def build(self, m, args):
        self.h.remove()
        self.learn.create_opt()
    def after_fit(self): self.h.remove()

def test_an_optimizer_built_inside_a_forward_steps_the_masters():
    learn = synth_learner().to_mixed(torch.bfloat16)
    learn.fit(1, 1e-2, cbs=CreateOptInForward())
    assert all(p.dtype == torch.float32 for p in opt_params(learn))
    assert all(a is b for a, b in zip(opt_params(learn), learn.model.parameters()))
    assert_fp32_and_intact(learn) # the next fit trains every layer, not only BatchNorm

def test_a_failed_export_gives_the_learner_back(tmp_path, monkeypatch):
    from test_entry_points import block_learner # (exportable data: fastai's data block API)
    learn = block_learner().to_mixed(torch.bfloat16)
    learn.path = tmp_path
    learn.fit(1, 1e-2)
    opt, n_batches = learn.opt, len(learn.dls.train)
    def full_disk(*args, **kwargs): raise OSError(28, 'No space left on device')
    monkeypatch.setattr(torch, 'save', full_disk)
    with pytest.raises(OSError): learn.export_atomic('model.pkl')
    monkeypatch.undo()
    assert learn.opt is opt and len(learn.dls.train) == n_batches # the optimizer with its state, the data
    assert_fp32_and_intact(learn)

def kept_learner():
    "A learner whose model has hooked modules: two layers kept in FP32, two hooks each"
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 16),
                                nn.ReLU(), nn.Linear(16, 2))
    return learn.to_mixed(torch.bfloat16, keep_fp32=['0', '6'])

@pytest.mark.parametrize('k', range(1, 5))
def test_a_ctrl_c_inside_the_close_finishes_it_before_it_is_raised(k, monkeypatch):
    "A Ctrl-C at the k-th hook removal of the cast's restore (the close at the end of the fit): the close completes, then it is raised"
    from torch.utils.hooks import RemovableHandle
    learn = kept_learner()
    remove, restore, n, restoring = RemovableHandle.remove, ModelCast.restore, [0], [False]
    def remove_interrupted(self):
        if restoring[0]:
            n[0] += 1
            if n[0] == k: raise KeyboardInterrupt
        return remove(self)
    def restore_marked(self):
        restoring[0] = True
        try: restore(self)
        finally: restoring[0] = False
    monkeypatch.setattr(RemovableHandle, 'remove', remove_interrupted)
    monkeypatch.setattr(ModelCast, 'restore', restore_marked)
    with pytest.raises(KeyboardInterrupt): learn.fit(1, 1e-2)
    monkeypatch.undo()
    assert n[0] > k # the close went on after the interrupt
    assert learn.master_mixed_precision.fit_state is None # closed, and dropped only then
    assert_fp32_and_intact(learn)

def test_a_learner_dropped_after_a_failed_inference_call_frees_its_model():
    "A `get_preds` whose `before_epoch` raises (fastai then never dispatches `after_fit`) leaves nothing that keeps the model alive"
    import gc, weakref
    from intact import RaiseOnce
    learn = synth_learner().to_mixed(torch.bfloat16, mixed_inference=True)
    learn.fit(1, 1e-2)
    learn.add_cb(RaiseOnce('before_epoch', RuntimeError('boom'), order=MasterMixedPrecision.order + 1))
    with pytest.raises(RuntimeError): call_lock_free(learn.get_preds)
    model = weakref.ref(learn.model)
    del learn; gc.collect()
    assert model() is None
    assert not cast._casting

class PhaseLog(Callback):
    "The phase of the learner's `MixedFit` at each event, and what a `get_preds` from inside the fit sees"
    order = MasterMixedPrecision.order + 1
    def __init__(self): self.seen = {}
    def _log(self, event): self.seen.setdefault(event, set()).add(self.learn.master_mixed_precision.mixed_fit.phase)
    def before_fit(self): self._log('before_fit')
    def before_batch(self): self._log('before_batch')
    def after_fit(self): self._log('after_fit')

def test_the_phase_of_each_entry_point():
    "IDLE between calls; FITTING through a fit (a `get_preds` inside it opens nothing); INFERRING through inference"
    from mpcallbacks.mixed_fit import FitPhase
    learn = synth_learner().to_mixed(torch.bfloat16)
    mf = learn.master_mixed_precision.mixed_fit
    assert mf.phase is FitPhase.IDLE
    log = PhaseLog()
    learn.fit(1, 1e-2, cbs=log)
    assert log.seen == {'before_fit':{FitPhase.FITTING}, 'before_batch':{FitPhase.FITTING},
                        'after_fit':{FitPhase.IDLE}} # (ours, order 10, ended the fit before this `after_fit`)
    assert mf.phase is FitPhase.IDLE and mf.cast is None and mf.learn is None # nothing of the fit held
    log = PhaseLog()
    learn.get_preds(cbs=log)
    assert log.seen['before_batch'] == {FitPhase.INFERRING} and mf.phase is FitPhase.IDLE
    with learn: assert mf.phase is FitPhase.INFERRING
    assert mf.phase is FitPhase.IDLE
    assert_at_rest(learn)

def test_a_close_cut_short_is_completed_by_the_next_call(monkeypatch):
    "An error in the close (not a Ctrl-C) leaves it CLOSING: the next call of any kind completes it before anything else"
    # (the close at `after_fit` fails, and so do the two `Learner.fit` makes on its way out; the next call completes it)
    from mpcallbacks.mixed_fit import FitPhase
    from mpcallbacks.scaler import LossScaler
    learn = synth_learner().to_mixed(torch.bfloat16)
    from mpcallbacks.mixed_fit import MixedFit
    settle, close_once, calls, closing = LossScaler.settle, MixedFit._close_once, [], [False]
    def settle_once(self): # (only the settle of a close fails: a step's reads go through)
        if closing[0]:
            calls.append(1)
            if len(calls) <= 3: raise RuntimeError('boom')
        return settle(self)
    def close_marked(self):
        closing[0] = True
        try: return close_once(self)
        finally: closing[0] = False
    monkeypatch.setattr(LossScaler, 'settle', settle_once)
    monkeypatch.setattr(MixedFit, '_close_once', close_marked)
    with pytest.raises(RuntimeError, match='boom'): learn.fit(1, 1e-2)
    mf = learn.master_mixed_precision.mixed_fit
    assert mf.phase is FitPhase.CLOSING
    assert not [m for m in learn.model.modules() if cast.cast_holding(m) is not None] # (the cast went back in a `finally`)
    learn.get_preds() # completes the close first, then runs
    assert mf.phase is FitPhase.IDLE and len(calls) >= 4
    assert_fp32_and_intact(learn)

def test_phases_move_only_along_their_transitions():
    from mpcallbacks.mixed_fit import FitPhase, MixedFit
    assert FitPhase.IDLE.next == {FitPhase.FITTING, FitPhase.INFERRING}
    assert all(FitPhase.CLOSING in p.next for p in (FitPhase.FITTING, FitPhase.INFERRING))
    mf = MixedFit()
    with pytest.raises(RuntimeError, match='cannot go from IDLE to CLOSING'): mf._to(FitPhase.CLOSING)
    mf.close() # closing an idle fit is nothing
    assert mf.phase is FitPhase.IDLE

@pytest.mark.parametrize('at', ['registry', 'second hook'])
def test_a_ctrl_c_while_the_cast_registers_leaves_nothing_registered(at, monkeypatch):
    "A Ctrl-C as the cast takes the model's modules, or between two of its hooks: none stays"
    learn = kept_learner()
    if at == 'registry':
        class Interrupted(dict):
            def setdefault(self, k, v): # (the third module taken: part way)
                if len(self) == 2: raise KeyboardInterrupt
                return super().setdefault(k, v)
        monkeypatch.setattr(cast, '_casting', Interrupted())
    else:
        register, n = nn.Module.register_forward_hook, [0]
        def interrupted(self, *args, **kwargs):
            n[0] += 1
            if n[0] == 2: raise KeyboardInterrupt
            return register(self, *args, **kwargs)
        monkeypatch.setattr(nn.Module, 'register_forward_hook', interrupted)
    with pytest.raises(KeyboardInterrupt): learn.fit(1, 1e-2)
    monkeypatch.undo()
    assert_at_rest(learn)
    assert_fp32_and_intact(learn)

class Casts16(TorchDispatchMode):
    "Weak references to every 16-bit cast of a parameter made while active (autocast's in the ops, the recurrent hooks')"
    def __init__(self, params): super().__init__(); self.params,self.refs = {id(p) for p in params},[]
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and id(args[0]) in self.params and out.dtype == torch.bfloat16:
            self.refs.append(weakref.ref(out))
        return out

class CastsAfterTheStep(Callback):
    "Whether any 16-bit cast of a parameter made in a training batch is alive once the batch is over"
    order = MasterMixedPrecision.order + 1
    def __init__(self): self.alive,self.made = [],0
    def before_batch(self):
        if self.training: self.mode = Casts16(self.learn.model.parameters()).__enter__()
    def after_batch(self):
        if not self.training: return
        self.mode.__exit__(None, None, None)
        gc.collect()
        self.made += len(self.mode.refs)
        self.alive.append(sum(r() is not None for r in self.mode.refs))

class LSTMNet(nn.Module):
    def __init__(self): super().__init__(); self.lstm,self.head = nn.LSTM(8, 16, batch_first=True),nn.Linear(16, 2)
    def forward(self, x): return self.head(self.lstm(x.view(-1, 8, 8))[0][:, -1])

@pytest.mark.parametrize('model', [None, LSTMNet], ids=['cnn', 'lstm'])
def test_no_16bit_cast_outlives_its_step(model):
    "Between steps the model holds 12 bytes per parameter: fastai keeps `learn.pred` and `learn.loss_grad` (and their graph) until the next batch, and nothing on that graph keeps a cast alive"
    learn = synth_learner()
    if model is not None: learn.model = model()
    learn.to_mixed(torch.bfloat16)
    spy = CastsAfterTheStep()
    learn.fit(1, 1e-2, cbs=spy)
    assert spy.made and spy.alive and set(spy.alive) == {0}, spy.alive

class LargeCastFreedInTheBackward(Callback):
    "Whether the forward's cast of a large weight is alive once the backward has accumulated that weight's FP32 gradient"
    order = MasterMixedPrecision.order + 1
    def __init__(self): self.alive_at_grad = []
    def before_fit(self):
        w = self.learn.model[3].weight # (65,536 elements)
        self.handle = w.register_post_accumulate_grad_hook(lambda p: self.alive_at_grad.append(any(r() is not None for r in self.mode.refs)))
    def before_batch(self):
        if self.training: self.mode = Casts16([self.learn.model[3].weight]).__enter__()
    def after_pred(self):
        if self.training: self.mode.__exit__(None, None, None)
    def after_fit(self): self.handle.remove()

class OwnLinear(nn.Linear):
    "A layer of the user's own, a subclass of torch's Linear"

def test_a_large_cast_is_freed_once_its_gradient_is_made():
    "The backward frees each weight's cast as it makes its master's gradient, so that the FP32 gradients still to come reuse its memory"
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), OwnLinear(256, 256), nn.ReLU(), nn.Linear(256, 2))
    learn.to_mixed(torch.bfloat16)
    spy = LargeCastFreedInTheBackward()
    learn.fit(1, 1e-2, cbs=spy)
    assert spy.alive_at_grad and not any(spy.alive_at_grad), spy.alive_at_grad
    assert_fp32_and_intact(learn)

class GradientOrder(Callback):
    "What the backward makes first: the FP32 gradient of the large weight of layer 3, or the gradient of layer 1's output"
    order = MasterMixedPrecision.order + 1
    def __init__(self): self.seen = []
    def before_fit(self):
        m = self.learn.model
        self.handles = [m[3].weight.register_post_accumulate_grad_hook(lambda p: self.seen.append('weight')),
                        m[1].register_forward_hook(self.on_output)]
    def on_output(self, m, args, out):
        if out.requires_grad: out.register_hook(lambda g: self.seen.append('output of layer 1'))
    def after_fit(self):
        for h in self.handles: h.remove()

def test_a_large_weight_of_a_torch_linear_gets_its_gradient_right_after_its_layer():
    "A large weight of torch's own Linear is cast in its op, as autocast casts: the backward converts its gradient (and frees the cast) right after that layer, not after the whole backward, holding every 16-bit gradient and cast until then (a wide MLP's backward was 4-6 ms slower than autocast's)"
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 2))
    learn.to_mixed(torch.bfloat16)
    spy = GradientOrder()
    learn.fit(1, 1e-2, cbs=spy)
    assert len(spy.seen) >= 4 and spy.seen == ['weight', 'output of layer 1'] * (len(spy.seen) // 2), spy.seen
    assert_fp32_and_intact(learn)

class ReadsTheLayersWeight(nn.Module):
    "A parent that computes with its child's weight directly, without calling the child"
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 256)
        self.dtypes = []
    def forward(self, x):
        out = nn.functional.linear(x, self.lin.weight, self.lin.bias)
        self.dtypes.append((self.lin.weight.dtype, out.dtype))
        return out

def test_a_large_weight_read_outside_its_layer_is_cast_by_autocast_and_trained():
    "Inside a forward, the slot of a large weight of torch's own Linear holds its master: a parent that reads it directly computes in 16 bits all the same (autocast casts it in the op), and the weight trains"
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), ReadsTheLayersWeight(), nn.ReLU(), nn.Linear(256, 2))
    learn.to_mixed(torch.bfloat16)
    before = learn.model[2].lin.weight.detach().clone()
    learn.fit(1, 1e-2)
    assert (torch.float32, torch.bfloat16) in learn.model[2].dtypes, learn.model[2].dtypes
    assert not torch.equal(before, learn.model[2].lin.weight.detach())
    assert_fp32_and_intact(learn)
