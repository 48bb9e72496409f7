"Nothing lost: checkpoints, resuming, export, exceptions at every event, the loss-scale floor, bad input, observability."
import copy, pickle, random
from functools import partial
import pytest, torch
from torch import nn, Tensor
from fastai.basics import Learner, Callback, DataLoaders, CrossEntropyLossFlat, MSELossFlat, set_seed, load_learner, L
from fastai.callback.core import CancelFitException
from fastai.callback.progress import ProgressCallback
from fastai.callback.tracker import SaveModelCallback
import fastai.callback.schedule # fit_one_cycle
from mpcallbacks.callback import MasterMixedPrecision, NonFiniteGradients
from mpcallbacks.test_utils import synth_learner, synth_dls, synth_model, opt_params, InjectNonFinite
from test_with_fastai_callbacks import assert_same_state

def no_history(state:dict) -> dict: return {k:v for k,v in state.items() if k != 'history'} # (the steps' record, for the plot)

def weights(learn): return [p.detach().clone() for p in learn.model.parameters()]

def load_weights_only(path):
    "A checkpoint loaded with `weights_only=True`, allowing fastai's `L` (its hypers): `safe_globals` from torch 2.5, `add_safe_globals` in 2.4"
    if hasattr(torch.serialization, 'safe_globals'):
        with torch.serialization.safe_globals([L]): return torch.load(path, weights_only=True)
    torch.serialization.add_safe_globals([L])
    return torch.load(path, weights_only=True)
def not_16bit_exact(ts): return any(not torch.equal(t, t.half().float()) for t in ts) # a tensor no 16-bit copy could give back

# ---- checkpoints store the FP32 masters, never rounded through 16 bits

@pytest.mark.parametrize('with_opt', [False, True])
def test_save_during_and_after_fit_stores_fp32_masters(tmp_path, with_opt):
    learn = synth_learner(path=tmp_path).to_mixed(torch.float16, init_scale=2.**9)
    at_epoch_end = []
    class Keep(Callback):
        order = SaveModelCallback.order + 1
        def after_epoch(self): at_epoch_end.append([p.detach().clone() for p in self.learn.parameters()])
    learn.fit(2, 1e-2, cbs=[SaveModelCallback(every_epoch=True, with_opt=with_opt, fname='ep'), Keep(), InjectNonFinite(at=[0])])
    for epoch, masters in enumerate(at_epoch_end):
        sd = load_weights_only(tmp_path/'models'/f'ep_{epoch}.pth')
        model_sd = sd['model'] if with_opt else sd
        params = [v for k, v in model_sd.items() if 'running' not in k and 'num_batches' not in k]
        assert all(v.dtype == torch.float32 for v in params)
        assert all(torch.equal(a, b) for a, b in zip(params, masters)) # exactly the masters
        assert not_16bit_exact(params)
        if with_opt: assert no_history(sd['opt']['mpcallbacks.loss_scaler']) == {'scale': 2.**8, 'growth_tracker': 8*(epoch+1)-1, 'skipped': 1, 'consecutive_skips': 0, 'dynamic': True, 'growth_interval': 2000}
    learn.save('after', with_opt=False)
    sd = torch.load(tmp_path/'models'/'after.pth', weights_only=True)
    assert all(torch.equal(v, p.detach()) for v, p in zip([v for k, v in sd.items() if 'running' not in k and 'num' not in k], learn.model.parameters()))

def test_save_load_with_opt_round_trips_masters_opt_and_scaler(tmp_path):
    learn = synth_learner(path=tmp_path).to_mixed(torch.float16, init_scale=2.**9, growth_interval=3)
    learn.fit(1, 1e-2, cbs=InjectNonFinite(at=[2]))
    learn.save('ck', with_opt=True)
    w, opt_sd, sc = weights(learn), copy.deepcopy(learn.opt.state_dict()), learn.master_mixed_precision.scaler.state_dict()
    other = synth_learner(path=tmp_path, seed=1).to_mixed(torch.float16, init_scale=2.**9, growth_interval=3)
    other.load('ck', with_opt=True)
    assert all(torch.equal(a, b.detach()) for a, b in zip(w, other.model.parameters()))
    assert_same_state(opt_sd['state'], other.opt.state_dict()['state'])
    assert other.master_mixed_precision.scaler.state_dict() == sc and no_history(sc) == {'scale': 2.**9, 'growth_tracker': 2, 'skipped': 1, 'consecutive_skips': 0, 'dynamic': True, 'growth_interval': 3}

def test_checkpoint_loads_without_mpcallbacks(tmp_path):
    learn = synth_learner(path=tmp_path).to_mixed(torch.float16); learn.fit(1, 1e-2); learn.save('ck', with_opt=True)
    plain = synth_learner(path=tmp_path, seed=1)
    plain.load('ck', with_opt=True) # fastai's own Learner.load path: the scaler entry is ignored
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(learn.model.parameters(), plain.model.parameters()))

# ---- resuming ends bit-identical to the uninterrupted run

class Reseed(Callback):
    "The same data order in each epoch whether the run was resumed or not"
    order = -10
    def before_epoch(self): self.dls.train.rng = random.Random(self.epoch)

class InjectAt(Callback):
    "An inf at chosen (epoch, iter) pairs, so the loss scale has a history worth resuming"
    order = MasterMixedPrecision.order - 1
    def __init__(self, at): self.at = set(at)
    def after_backward(self):
        if (self.epoch, self.iter) in self.at: self.model[0].weight.grad.view(-1)[0] = float('inf')

class Interrupt(Callback):
    order = 100
    def __init__(self, epoch): self.stop = epoch
    def after_epoch(self):
        if self.epoch == self.stop: raise KeyboardInterrupt

def resumable(path):
    set_seed(0)
    return synth_learner(path=path).to_mixed(torch.float16, init_scale=2.**10, growth_interval=3)

@pytest.mark.parametrize('how', ['save-between-fits', 'SaveModelCallback'])
def test_resume_is_bit_identical(tmp_path, how):
    n, k, inj = 4, 2, [(0, 1), (2, 3)]
    full = resumable(tmp_path); full.fit_one_cycle(n, 1e-2, cbs=[Reseed(), InjectAt(inj)])
    first = resumable(tmp_path)
    if how == 'save-between-fits':
        with pytest.raises(KeyboardInterrupt):
            first.fit_one_cycle(n, 1e-2, cbs=[Reseed(), InjectAt(inj), Interrupt(k-1), SaveModelCallback(every_epoch=True, with_opt=True, fname='tmp')])
        first.load(f'tmp_{k-1}', with_opt=True) # back to the end of epoch k-1, then learn.save between fits
        first.save('between', with_opt=True)
        ck = 'between'
    else:
        with pytest.raises(KeyboardInterrupt):
            first.fit_one_cycle(n, 1e-2, cbs=[Reseed(), InjectAt(inj), Interrupt(k-1), SaveModelCallback(every_epoch=True, with_opt=True, fname='ep')])
        ck = f'ep_{k-1}'
    resumed = resumable(tmp_path)
    resumed.load(ck, with_opt=True)
    resumed.fit_one_cycle(n, 1e-2, start_epoch=k, cbs=[Reseed(), InjectAt(inj)])
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(full.model.parameters(), resumed.model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(full.model.buffers(), resumed.model.buffers()))
    assert_same_state(full.opt.state_dict()['state'], resumed.opt.state_dict()['state'])
    a, b = full.master_mixed_precision.scaler, resumed.master_mixed_precision.scaler
    assert (a.scale, a.growth_tracker, a.skipped) == (b.scale, b.growth_tracker, b.skipped) and a.skipped == 2

# ---- export: an FP32 learner that predicts anywhere

def test_export_gives_fp32_learner_without_callback(tmp_path):
    from test_with_fastai_callbacks import digits_block_learner # export needs fastai Datasets (`new_empty`)
    learn = digits_block_learner().to_mixed(torch.float16)
    learn.path = tmp_path
    exported_mid_fit = []
    class ExportMidFit(Callback):
        order = 90
        done = False # fastai pickles this fit-scoped callback too: once exported, it must do nothing in the loaded learner
        def after_epoch(self):
            if self.epoch == 0 and not self.done:
                self.done = True
                self.learn.export('mid.pkl'); exported_mid_fit.append([p.detach().clone() for p in self.learn.parameters()])
    learn.fit(2, 1e-2, cbs=ExportMidFit())
    learn.export('end.pkl')
    assert isinstance(learn.master_mixed_precision, MasterMixedPrecision) # the exporting learner keeps it
    for name, expect in [('mid.pkl', exported_mid_fit[0]), ('end.pkl', weights(learn))]:
        loaded = load_learner(tmp_path/name)
        tensors = list(loaded.model.state_dict().values())
        assert {t.dtype for t in tensors if t.is_floating_point()} == {torch.float32}
        assert not any(isinstance(c, MasterMixedPrecision) for c in loaded.cbs)
        assert 'parameters' not in loaded.__dict__
        assert all(torch.equal(a, b.detach()) for a, b in zip(expect, loaded.model.parameters()))
        preds, _ = loaded.get_preds(dl=learn.dls.valid)
        assert preds.dtype == torch.float32

# ---- an exception at any event leaves the FP32 model, equal to the masters

events = ['before_fit', 'before_epoch', 'before_train', 'before_batch', 'after_pred', 'after_loss', 'before_backward',
          'after_backward', 'before_step', 'after_step', 'after_batch', 'after_train', 'before_validate', 'after_validate',
          'after_epoch', 'after_fit']

def raiser(event, exc):
    "A callback ordered after ours that raises `exc` the first time `event` fires (the second batch, for batch events)"
    class Raise(Callback): order = MasterMixedPrecision.order + 1
    def f(self):
        if getattr(self, 'iter', 1) >= 1 or not self.training: raise exc
    setattr(Raise, event, f)
    return Raise()

@pytest.mark.parametrize('exc', [partial(RuntimeError, 'boom'), KeyboardInterrupt, CancelFitException], ids=['RuntimeError', 'KeyboardInterrupt', 'CancelFitException'])
@pytest.mark.parametrize('event', events)
def test_exception_at_any_event(event, exc):
    learn = synth_learner().to_mixed(torch.float16)
    learn.create_opt()
    masters = opt_params(learn)
    try: learn.fit(1, 1e-2, cbs=raiser(event, exc()))
    except (RuntimeError, KeyboardInterrupt, CancelFitException): pass
    assert all(a is b for a, b in zip(learn.model.parameters(), masters)) # the FP32 masters themselves are in the model
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}
    assert 'parameters' not in learn.__dict__
    assert learn.master_mixed_precision.fit_state is None
    assert all(torch.isfinite(p).all() for p in masters)
    learn.fit(1, 1e-2) # the optimizer is consistent: a second fit trains
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}

# ---- the loss-scale floor and the NaN storm

def test_floor_keeps_skipping_and_counting_without_stopping():
    learn = synth_learner().to_mixed(torch.float16, init_scale=4., min_scale=1., max_consecutive_skips=10)
    learn.fit(1, 1e-2, cbs=InjectNonFinite(at=range(7))) # 7 skips in a row: 4 -> 2 -> 1 -> 1 ...
    mmp = learn.master_mixed_precision
    assert [s for s, _ in mmp.scaler.history] == [4., 2.] + [1.] * 6
    assert mmp.skipped == 7 and mmp.loss_scale == 1.

def test_default_limits_never_trigger_during_normal_backoff():
    learn = synth_learner().to_mixed(torch.float16) # 2**16 -> 1 takes 16 back-offs; the default allows them plus 25 in a row
    assert learn.master_mixed_precision.scaler.max_consecutive_skips == 41
    learn.fit(3, 1e-2, cbs=InjectNonFinite(at=range(16)))
    assert learn.master_mixed_precision.skipped == 16 and learn.master_mixed_precision.loss_scale == 1.
    assert learn.master_mixed_precision.scaler.max_consecutive_skips == 25 # the limit follows the scale: at 1, no back-off is left

def test_nan_storm_stops_fit_with_cause_after_every_after_fit(tmp_path):
    learn = synth_learner(path=tmp_path).to_mixed(torch.float16, max_consecutive_skips=20)
    learn.fit(1, 1e-2)
    good = weights(learn)
    after_fit_ran = []
    class Mark(Callback):
        order = 99
        def after_fit(self): after_fit_ran.append(True)
    with pytest.raises(NonFiniteGradients, match='learning rate is too high'):
        learn.fit(5, 1e-2, cbs=[InjectNonFinite(at=range(1000), value=float('nan')), Mark()])
    assert after_fit_ran == [True]
    assert learn.master_mixed_precision.skipped == 20
    assert all(torch.equal(a, b.detach()) for a, b in zip(good, learn.model.parameters())) # nothing stepped: the last good weights

def test_nan_inputs_or_targets_are_counted_skips():
    set_seed(0)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    x[20, 0] = float('nan'); y[45, 0] = float('nan') # batch 1 has a NaN input, batch 2 a NaN target
    ds = list(zip(x, y))
    dls = DataLoaders.from_dsets(ds, ds[:16], bs=16, shuffle=False, num_workers=0, device='cpu')
    learn = Learner(dls, nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)), loss_func=MSELossFlat()).to_mixed(torch.float16)
    learn.remove_cb(ProgressCallback)
    learn.fit(1, 1e-2)
    mmp = learn.master_mixed_precision
    assert [s for _, s in mmp.scaler.history] == [False, True, True, False] and mmp.skipped == 2
    assert all(torch.isfinite(p).all() for p in learn.model.parameters()) # masters never corrupted
    # (BatchNorm's running stats saw the NaN batch in forward, as they would in FP32: fastai has no way to skip that)

# ---- bad input, at the earliest moment

def test_bad_models_fail_at_to_mixed():
    dls = synth_dls()
    with pytest.raises(ValueError, match='no floating-point parameters'):
        Learner(dls, nn.Sequential(nn.Flatten()), loss_func=CrossEntropyLossFlat()).to_mixed(torch.float16)
    with pytest.raises(ValueError, match=r'already has 16-bit parameters.*learn.model.float\(\)'):
        Learner(dls, synth_model().half(), loss_func=CrossEntropyLossFlat()).to_mixed(torch.float16)

def test_integer_and_boolean_buffers_are_left_alone():
    class WithBuffers(nn.Module):
        def __init__(self):
            super().__init__(); self.m = synth_model()
            self.register_buffer('mask', torch.ones(2, dtype=torch.bool)); self.register_buffer('count', torch.zeros((), dtype=torch.long))
        def forward(self, x): self.count += 1; return self.m(x) * self.mask
    learn = Learner(synth_dls(), WithBuffers(), loss_func=CrossEntropyLossFlat()).to_mixed(torch.float16)
    learn.remove_cb(ProgressCallback)
    seen = set()
    learn.fit(1, 1e-2, cbs=Callback(after_pred=lambda cb: seen.add((cb.model.mask.dtype, cb.model.count.dtype))))
    assert seen == {(torch.bool, torch.long)} and learn.model.count.item() == 10

# ---- observability

def test_plot_loss_scale_marks_skips():
    learn = synth_learner().to_mixed(torch.float16, init_scale=2.**10, growth_interval=2)
    learn.fit(1, 1e-2, cbs=InjectNonFinite(at=[1, 5]))
    ax = learn.master_mixed_precision.plot_loss_scale()
    assert ax.collections[0].get_offsets().tolist() == [[1, 2.**10], [5, 2.**10]]
    assert learn.recorder.metric_names == ['epoch', 'train_loss', 'valid_loss', 'accuracy', 'time'] # fastai's columns unchanged

def our_hooks(model) -> list:
    "Every forward and state-dict hook a module of `model` holds, by type and name"
    dicts = ('_forward_pre_hooks', '_forward_hooks', '_state_dict_hooks', '_load_state_dict_pre_hooks', '_load_state_dict_post_hooks')
    return [f'{n}.{d}: {getattr(h, "__qualname__", type(h).__name__)}' for n, m in model.named_modules() for d in dicts for h in getattr(m, d).values()]

def test_export_mid_fit_pickles_no_hook_of_ours_and_loads_without_mpcallbacks(tmp_path):
    "An export in the middle of a fit pickles the plain FP32 model: no hook, and nothing that needs mpcallbacks to load"
    import subprocess, sys
    from test_with_fastai_callbacks import digits_block_learner
    learn = digits_block_learner().to_mixed(torch.bfloat16)
    learn.path = tmp_path
    class ExportMidFit(Callback):
        order, done = 90, False
        def after_batch(self):
            if self.training and self.iter == 2 and not self.done: self.done = True; self.learn.export('mid.pkl')
    learn.fit(1, 1e-2, cbs=ExportMidFit())
    code = ("import sys\nfrom fastai.learner import load_learner\nl = load_learner(sys.argv[1])\n"
            "dicts = ('_forward_pre_hooks', '_forward_hooks', '_state_dict_hooks', '_load_state_dict_pre_hooks', '_load_state_dict_post_hooks')\n"
            "print(sum(len(getattr(m, d)) for m in l.model.modules() for d in dicts), 'mpcallbacks' in sys.modules)")
    r = subprocess.run([sys.executable, '-c', code, str(tmp_path/'mid.pkl')], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-2:] == ['0', 'False'], f"hooks left in the exported model, or mpcallbacks needed to load it: {r.stdout}"

@pytest.mark.parametrize('event', ['before_fit', 'after_batch'])
def test_a_deep_copy_of_the_model_during_a_fit_is_a_plain_fp32_model(event):
    "An EMA made with `copy.deepcopy(learn.model)` during the fit: FP32 weights equal to the masters, and it runs on its own"
    learn = synth_learner().to_mixed(torch.bfloat16)
    class Copy(Callback):
        order = MasterMixedPrecision.order + 1 # after ours: the model is cast
        def _copy(self):
            if hasattr(self, 'ema') or (event == 'after_batch' and not self.training): return
            self.ema = copy.deepcopy(self.learn.model)
            self.masters = [p.detach().clone() for p in self.learn.parameters()]
        def after_epoch(self):
            with torch.no_grad(): self.out = self.ema(self.dls.valid.one_batch()[0])
    cb = Copy()
    setattr(cb, event, cb._copy)
    plain = synth_learner().to_mixed(torch.bfloat16)
    learn.fit(1, 1e-2, cbs=cb)
    plain.fit(1, 1e-2)
    assert {p.dtype for p in cb.ema.parameters()} == {torch.float32} and cb.out.dtype == torch.float32
    assert all(torch.equal(a.detach(), b) for a, b in zip(cb.ema.parameters(), cb.masters))
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(learn.model.parameters(), plain.model.parameters())) # the fit is unaffected
    assert not our_hooks(learn.model)
    again = pickle.loads(pickle.dumps(cb.ema)) # as `torch.save(ema)` or `learn.export` of a learner that keeps it
    x = learn.dls.valid.one_batch()[0]
    with torch.no_grad(): assert torch.equal(again(x), cb.ema(x))
