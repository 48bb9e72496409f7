"Every entry point that runs `before_fit`/`after_fit` (validate, get_preds, predict, tta, `with learn:`, one_batch) keeps the guarantee `fit` has."
import pytest, torch
from fastai.basics import Learner, CrossEntropyLossFlat, accuracy, set_seed, Callback
from fastai.callback.fp16 import MixedPrecision
from fastai.callback.progress import ProgressCallback
from fastai.data.block import DataBlock, TransformBlock, CategoryBlock
from fastai.data.transforms import IndexSplitter
from mpcallbacks.all import MasterMixedPrecision
from mpcallbacks.test_utils import synth_learner, synth_model
from intact import assert_fp32_and_intact, assert_at_rest, hook_ids, call_lock_free, RaiseOnce

def block_learner():
    "The synthetic problem through fastai's data block API: `predict` and `tta` need `Datasets`"
    torch.manual_seed(0)
    X = torch.randn(320, 1, 8, 8); Y = (X[:, 0, :4].mean((1, 2)) > 0).long().tolist()
    db = DataBlock(blocks=(TransformBlock(type_tfms=lambda i: X[i]), CategoryBlock), get_y=lambda i: Y[i],
                   splitter=IndexSplitter(list(range(256, 320))))
    dls = db.dataloaders(list(range(320)), bs=32, num_workers=0, device='cpu')
    learn = Learner(dls, synth_model(), loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    learn.remove_cb(ProgressCallback)
    return learn

def with_learn(learn):
    with learn: learn.model(learn.dls.one_batch()[0])

entry_points = {'validate': lambda l: l.validate(), 'get_preds': lambda l: l.get_preds(), 'predict': lambda l: l.predict(3),
                'tta': lambda l: l.tta(n=2), 'with': with_learn}
exceptions = {'RuntimeError': lambda: RuntimeError('boom'), 'KeyboardInterrupt': KeyboardInterrupt}
orders = {'before_ours': MasterMixedPrecision.order - 1, 'after_ours': MasterMixedPrecision.order + 1}

# tta dispatches before_fit, before_epoch and after_fit, never after_epoch: that pair cannot raise
cases = [(entry, event) for entry in entry_points for event in ['before_fit', 'before_epoch', 'after_epoch', 'after_fit']
         if (entry, event) != ('tta', 'after_epoch')]

@pytest.mark.parametrize('mixed_inference', [False, True], ids=['fp32_inference', 'mixed_inference'])
@pytest.mark.parametrize('order', orders)
@pytest.mark.parametrize('exc', exceptions)
@pytest.mark.parametrize('entry,event', cases, ids=[f'{a}-{b}' for a, b in cases])
def test_exception_in_an_inference_entry_point_leaves_learner_intact(entry, event, exc, order, mixed_inference):
    learn = (block_learner() if entry in ('predict', 'tta') else synth_learner()).to_mixed(torch.bfloat16, mixed_inference=mixed_inference)
    learn.fit(1, 1e-2) # an optimizer exists, as after any real training
    hooks = hook_ids(learn.model)
    e = exceptions[exc]()
    learn.add_cb(RaiseOnce(event, e, order=orders[order]))
    with pytest.raises(type(e)): call_lock_free(entry_points[entry], learn)
    if entry in locked_entries and event in ('before_fit', 'before_epoch'): unwound_where_fastai_is_not(learn, entry, event, e)
    assert_fp32_and_intact(learn, hooks)

locked_entries = ('validate', 'get_preds', 'predict') # fastai's `validation_context` takes `learn.lock`

def unwound_where_fastai_is_not(learn, entry, event, e):
    """A callback that raises while `validation_context` enters (`before_fit`, `before_epoch`): fastai leaves `learn.lock`
    held and the callbacks it added for the call (fastcore's `ContextManagers` does not unwind a failed `__enter__`);
    a mixed learner's is unwound, the lock free and those callbacks gone"""
    assert not learn.lock.locked(), "the mixed learner's lock is held: the next get_preds would wait for it for good"
    plain = synth_learner() if entry != 'predict' else block_learner()
    plain.add_cb(RaiseOnce(event, type(e)(*e.args)))
    with pytest.raises(type(e)): call_lock_free(entry_points[entry], plain)
    assert plain.lock.locked(), "fastai now releases the lock itself: the wrapped validation_context can go"
    left = lambda l: [cb for cb in l.cbs if type(cb).__name__ == 'GatherPredsCallback'] # the callbacks it added for the call
    assert len(left(learn)) == 0 and len(left(plain)) == (1 if entry in ('get_preds', 'predict') else 0)
    plain.lock.release()

def test_save_after_a_failed_validate_and_to_unmixed_writes_fp32(tmp_path):
    learn = synth_learner(path=tmp_path).to_mixed(torch.bfloat16)
    learn.fit(1, 1e-2)
    w = [p.detach().clone() for p in learn.model.parameters()]
    learn.add_cb(RaiseOnce('after_epoch', RuntimeError('boom'), order=MasterMixedPrecision.order - 1))
    with pytest.raises(RuntimeError): call_lock_free(learn.validate)
    learn.to_unmixed()
    learn.save('after', with_opt=False)
    sd = torch.load(tmp_path/'models'/'after.pth', weights_only=True)
    assert {v.dtype for v in sd.values() if v.is_floating_point()} == {torch.float32}
    params = [v for k, v in sd.items() if 'running' not in k and 'num_batches' not in k]
    assert all(torch.equal(a, b) for a, b in zip(params, w)) # the FP32 masters, not a 16-bit rounding of them

# ---- configuration errors: raised by to_mixed, never from inside fastai's context managers

def test_nothing_left_to_cast_fails_at_to_mixed():
    learn = synth_learner()
    with pytest.raises(ValueError, match='keep_fp32'): learn.to_mixed(torch.bfloat16, keep_fp32=['*'])
    assert not any(isinstance(c, MasterMixedPrecision) for c in learn.cbs)
    call_lock_free(learn.get_preds)
    assert_fp32_and_intact(learn)

def test_to_fp16_after_to_mixed_fails_clearly_and_holds_no_lock():
    learn = synth_learner().to_mixed(torch.bfloat16)
    learn.fit(1, 1e-2)
    hooks = hook_ids(learn.model)
    learn.to_fp16()
    with pytest.raises(ValueError, match='to_fp16'): call_lock_free(learn.fit, 1) # training refuses the pair
    assert_at_rest(learn, hooks)
    preds, _ = call_lock_free(learn.get_preds) # inference outside a fit casts nothing of ours: fastai's runs alone
    assert_at_rest(learn, hooks)
    learn.remove_cb(MixedPrecision)
    preds, _ = call_lock_free(learn.get_preds) # the second call neither hangs nor fails
    assert preds.dtype == torch.float32
    assert_fp32_and_intact(learn, hooks)

# ---- one_batch outside a fit behaves as in FP32 (or fails clearly), never with an internal AttributeError

def one_batch_trains(learn, b):
    "A training step by hand, without the callbacks that need a running fit"
    learn.create_opt(); learn.training = True
    learn.remove_cbs([learn.recorder, learn.train_eval])
    learn.one_batch(0, b)

def one_batch_with_default_cbs(learn, b):
    learn.create_opt(); learn.training = True
    learn.one_batch(0, b)

def one_batch_eval(learn, b):
    learn.remove_cb(learn.recorder)
    learn.one_batch(0, b)

def outcome(f, learn, b):
    w = [p.detach().clone() for p in learn.model.parameters()]
    try: call_lock_free(f, learn, b); err = None
    except Exception as e: err = e
    moved = [not torch.equal(a, p.detach()) for a, p in zip(w, learn.model.parameters())]
    return err, moved

@pytest.mark.parametrize('how', [one_batch_trains, one_batch_with_default_cbs, one_batch_eval])
def test_one_batch_outside_fit_behaves_like_fp32(how):
    plain = synth_learner(); b = plain.dls.one_batch()
    err32, moved32 = outcome(how, plain, b)
    learn = synth_learner().to_mixed(torch.bfloat16)
    hooks, cbs = hook_ids(learn.model), [learn.recorder, learn.train_eval]
    err, moved = outcome(how, learn, b)
    if err is not None: assert 'NoneType' not in str(err), f"internal error instead of a clear one: {err}"
    same = (err is None and err32 is None and moved == moved32) or \
           (err is not None and err32 is not None and type(err) is type(err32) and str(err) == str(err32))
    clear = err is not None and not isinstance(err, AttributeError) and 'one_batch' in str(err)
    assert same or clear, f"FP32: {err32!r}, moved {moved32}; mixed: {err!r}, moved {moved}"
    learn.add_cbs([c for c in cbs if c not in learn.cbs])
    assert_fp32_and_intact(learn, hooks)

# ---- inference called by a callback in the middle of a fit (a test-set metric at `after_train`)

class PredictMidFit(Callback):
    "Calls `how` on the learner after each training phase, and records the predictions' dtype"
    order = 50
    def __init__(self, how): self.how,self.dtypes = how,[]
    def after_train(self):
        dl = self.dls.valid
        if self.how == 'get_preds(inner=True)': p,_ = self.learn.get_preds(dl=dl, inner=True)
        elif self.how == 'get_preds': p,_ = self.learn.get_preds(dl=dl) # fires a nested before_fit/after_fit
        else: p = torch.tensor(self.learn.validate(dl=dl))
        self.dtypes.append(p.dtype)

@pytest.mark.parametrize('how', ['get_preds(inner=True)', 'get_preds', 'validate'])
def test_inference_called_mid_fit_leaves_the_fit_as_without_it(how):
    "The nested call neither ends the outer fit's mixed precision nor changes what it trains: the weights are bit-identical"
    def fit(cbs):
        set_seed(0)
        learn = synth_learner().to_mixed(torch.bfloat16)
        hooks = hook_ids(learn.model)
        call_lock_free(learn.fit, 3, 1e-2, cbs=cbs)
        return learn, hooks
    plain,_ = fit([])
    look = PredictMidFit(how)
    learn, hooks = fit([look])
    assert look.dtypes == [torch.float32] * 3
    for a, b in zip(plain.model.parameters(), learn.model.parameters()): assert torch.equal(a, b)
    assert learn.master_mixed_precision.skipped == 0 and learn.master_mixed_precision.loss_scale == plain.master_mixed_precision.loss_scale
    assert_fp32_and_intact(learn, hooks)
