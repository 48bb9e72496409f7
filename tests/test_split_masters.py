"""`to_mixed(torch.bfloat16, masters='16+16')`: the masters (rebuilt from the bfloat16 weights, low halves and ties) and the
weights the forward sees are bit for bit those of the default bfloat16 mode after every batch; between steps no FP32
master holds data; save/load/resume and export give the default mode's files and fits."""
import hashlib
from functools import partial
import pytest, torch
from torch import nn
from fastai.basics import Learner, Callback, CrossEntropyLossFlat, Adam, OptimWrapper, params, load_learner, set_seed
from fastai.optimizer import Lookahead
from fastai.callback.training import GradientClip, GradientAccumulation
from fastai.callback.progress import ProgressCallback
from mpcallbacks.all import MasterMixedPrecision, SplitMasters, SplitMixedFit
from mpcallbacks.digits import digits_dls, digits_cnn
from mpcallbacks.test_utils import InjectNonFinite

def digest(ts) -> str:
    h = hashlib.sha256()
    for t in ts: h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

def masters(learn) -> list:
    "The optimizer's parameters as FP32 values: 16+16 masters rebuilt from their parts, the others as they are"
    ms = learn.master_mixed_precision.fit_state.masters
    opt_params = [p for pg in learn.opt.param_lists for p in pg]
    if not isinstance(ms, SplitMasters): return opt_params
    return [ms.rebuild(ms.index[id(p)]) if id(p) in ms.index else p for p in opt_params]

class Hashes(Callback):
    "After every training batch: a hash of the masters and of the weights its forward used; the FP32 bytes the split masters hold"
    order = 100
    def __init__(self): self.seen,self.held = [],[]
    def after_pred(self):
        if self.training: self.used = digest(self.model.parameters())
    def after_batch(self):
        if not self.training: return
        self.seen.append((digest(masters(self.learn)), self.used))
        fit = self.learn.master_mixed_precision.fit_state
        if isinstance(fit, SplitMixedFit): self.held.append(sum(m.numel() for m in fit.masters.masters))

def mlp(): torch.manual_seed(0); return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 10))
def cnn(): torch.manual_seed(0); return digits_cnn(8)
opts = {'Adam': Adam, 'AdamW': partial(OptimWrapper, opt=torch.optim.AdamW)}

def learner(make_model, opt_func, **kwargs):
    learn = Learner(digits_dls(bs=64), make_model(), loss_func=CrossEntropyLossFlat(), opt_func=opt_func, **kwargs)
    learn.remove_cb(ProgressCallback)
    return learn

def run(make_model, opt_func, extra, masters_kind, lr=1e-2, splitter=None):
    learn = learner(make_model, opt_func, **({'splitter': splitter} if splitter else {}))
    hashes = Hashes()
    learn.to_mixed(torch.bfloat16, loss_scale='dynamic', init_scale=2.**12, masters=masters_kind)
    learn.fit(1, lr, cbs=[hashes] + extra())
    return hashes, learn

two_groups = lambda m: [params(m[:2]), params(m[2:])]
extras = {'plain': lambda: [], 'clip': lambda: [GradientClip(0.1)], 'accumulation': lambda: [GradientAccumulation(192)],
          'skips': lambda: [InjectNonFinite(at=[2, 3, 9])],
          'all': lambda: [GradientClip(0.1), GradientAccumulation(128), InjectNonFinite(at=[1, 4])],
          'discriminative+clip': lambda: [GradientClip(0.1)]}
cases = [(m, e, o) for m in ('mlp', 'cnn') for e in extras for o in opts]

@pytest.mark.parametrize('model,extra,opt', cases, ids=[f'{m}-{e}-{o}' for m, e, o in cases])
def test_split_masters_are_the_default_modes_after_every_batch(model, extra, opt):
    make = {'mlp': mlp, 'cnn': cnn}[model]
    kw = dict(lr=slice(1e-3, 1e-2), splitter=two_groups) if extra.startswith('discriminative') else {}
    ref, ref_learn = run(make, opts[opt], extras[extra], 'fp32', **kw)
    got, learn = run(make, opts[opt], extras[extra], '16+16', **kw)
    assert len(got.seen) == len(ref.seen) > 5
    assert got.seen == ref.seen, f"first differing batch: {next(i for i, (a, b) in enumerate(zip(got.seen, ref.seen)) if a != b)}"
    assert len(set(s for s, _ in ref.seen)) > 3 # the masters moved: the hashes can tell the modes apart
    skipped = learn.master_mixed_precision.skipped
    assert skipped == ref_learn.master_mixed_precision.skipped == (3 if extra == 'skips' else 2 if extra == 'all' else 0)
    assert set(got.held) == {0} # between steps, no FP32 master holds data
    # after the fit, the FP32 model is back, equal to the default mode's
    assert [p.dtype for p in learn.model.parameters()] == [torch.float32] * len(list(learn.model.parameters()))
    assert digest(learn.model.parameters()) == digest(ref_learn.model.parameters())

def test_clip_changes_the_trajectory_so_the_test_can_fail():
    plain, _ = run(mlp, Adam, extras['plain'], '16+16')
    clipped, _ = run(mlp, Adam, extras['clip'], '16+16')
    assert plain.seen != clipped.seen

def test_the_ties_matter_so_the_test_can_fail(monkeypatch):
    "Dropping the ties (low halves alone) makes the 16+16 masters differ from the default mode's"
    import mpcallbacks.split_masters as sm
    split = sm.split_bf16_
    monkeypatch.setattr(sm, 'split_bf16_', lambda x, w, low: split(x, w, low)[:0])
    ref, _ = run(mlp, Adam, extras['plain'], 'fp32')
    got, _ = run(mlp, Adam, extras['plain'], '16+16')
    assert got.seen != ref.seen

# ---- the arguments

def test_masters_argument_is_validated_at_to_mixed():
    learn = learner(mlp, Adam)
    with pytest.raises(ValueError, match="masters='16\\+16'.*bfloat16"): learn.to_mixed(torch.float16, masters='16+16')
    with pytest.raises(ValueError, match="masters must be one of"): learn.to_mixed(torch.bfloat16, masters='16')
    with pytest.raises(ValueError, match="check_drift"): learn.to_mixed(torch.bfloat16, masters='16+16', check_drift=True)
    assert not learn._grab_cbs(MasterMixedPrecision)
    assert learn.to_mixed(torch.bfloat16, masters='16+16').master_mixed_precision.masters == '16+16'

def test_an_optimizer_it_cannot_step_is_refused_and_the_model_comes_back():
    learn = learner(mlp, lambda ps, lr: Lookahead(Adam(ps, lr)))
    want = digest(learn.model.parameters())
    learn.to_mixed(torch.bfloat16, masters='16+16')
    with pytest.raises(TypeError, match="Lookahead.*masters='fp32'"): learn.fit(1, 1e-2)
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}
    assert digest(learn.model.parameters()) == want

# ---- save / load / resume, export

class SaveAt(Callback):
    "In the middle of the fit: save (with the optimizer) and export"
    order = 100
    def __init__(self, at): self.at,self.i = at,0
    def after_batch(self):
        if self.training and self.i == self.at:
            self.learn.save('mid', with_opt=True)
            self.learn.export('mid.pkl')
        self.i += self.training

def saved_state(path) -> tuple:
    sd = torch.load(path, weights_only=False)
    opt_tensors = [t for s in sd['opt']['state'] for t in (s.values() if isinstance(s, dict) else [s]) if isinstance(t, torch.Tensor)] \
        if isinstance(sd['opt']['state'], list) else [t for s in sd['opt']['state'].values() for t in s.values() if isinstance(t, torch.Tensor)]
    return digest(sd['model'].values()), digest(opt_tensors), sd['opt']['mpcallbacks.loss_scaler']

def block_learner(opt_func, path):
    from test_with_fastai_callbacks import digits_block_learner # export needs fastai Datasets (`new_empty`)
    set_seed(0) # its DataLoaders draw their shuffling seed when they are built
    learn = digits_block_learner()
    learn.opt_func,learn.path = opt_func,path
    return learn

@pytest.mark.parametrize('opt', list(opts))
def test_save_load_resume_and_export_give_the_default_modes_files_and_fits(opt, tmp_path):
    res = {}
    for kind in ('fp32', '16+16'):
        learn = block_learner(opts[opt], tmp_path/kind)
        learn.to_mixed(torch.bfloat16, loss_scale='dynamic', init_scale=2.**12, masters=kind)
        hashes = Hashes()
        set_seed(1)
        learn.fit(1, 1e-2, cbs=[hashes, SaveAt(4), InjectNonFinite(at=[2])]) # the fit goes on after a save and an export
        res[kind] = dict(fit=hashes.seen, mid=saved_state(tmp_path/kind/'models'/'mid.pth'))
        learn.save('end', with_opt=True)
        res[kind]['end'] = saved_state(tmp_path/kind/'models'/'end.pth')
        exported = load_learner(tmp_path/kind/'mid.pkl')
        res[kind]['export'] = digest(exported.model.parameters()), [p.dtype for p in exported.model.parameters()]
        resumed = block_learner(opts[opt], tmp_path/kind)
        resumed.to_mixed(torch.bfloat16, loss_scale='dynamic', masters=kind)
        resumed.load('mid', with_opt=True)
        hashes = Hashes()
        set_seed(1)
        resumed.fit(1, 1e-2, cbs=[hashes])
        res[kind]['resumed'] = hashes.seen
    ref, got = res['fp32'], res['16+16']
    assert len(got['fit']) > 5 and got['fit'] == ref['fit']
    assert got['mid'] == ref['mid'] and got['end'] == ref['end']
    assert got['export'] == ref['export'] and set(got['export'][1]) == {torch.float32}
    assert len(got['resumed']) > 5 and got['resumed'] == ref['resumed']

def test_validate_and_get_preds_leave_the_fp32_model_as_it_was():
    "Entry points outside a fit split the masters for their `before_fit` and rebuild them at `after_fit`: nothing moves"
    _, learn = run(mlp, Adam, extras['plain'], '16+16')
    want = digest(learn.model.parameters())
    preds, _ = learn.get_preds()
    learn.validate()
    assert digest(learn.model.parameters()) == want and {p.dtype for p in learn.model.parameters()} == {torch.float32}
    assert preds.dtype == torch.float32 and preds.shape[1] == 10
