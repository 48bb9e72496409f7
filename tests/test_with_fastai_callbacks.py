"`to_mixed()` with the rest of fastai: each scenario compared with an FP32 run or an exact expectation."
import copy, random, warnings
from functools import partial
from fastai.optimizer import Optimizer
import pytest, torch
from torch import nn, Tensor
from fastai.basics import (Learner, Callback, DataLoaders, CrossEntropyLossFlat, MSELossFlat, accuracy, set_seed, L,
                           SGD, Adam, RAdam, Lamb, ranger, OptimWrapper)
from fastai.callback.progress import ProgressCallback, ShowGraphCallback
from fastai.callback.training import GradientClip, GradientAccumulation, BnFreeze
from fastai.callback.mixup import MixUp, CutMix
from fastai.callback.tracker import SaveModelCallback, EarlyStoppingCallback, ReduceLROnPlateau
from fastai.callback.progress import CSVLogger
import fastai.callback.schedule # fit_one_cycle, fine_tune, lr_find
from mpcallbacks.callback import MasterMixedPrecision
import mpcallbacks.cast
from mpcallbacks.cast import _warned
from mpcallbacks.test_utils import synth_learner, synth_dls, opt_params, InjectNonFinite
from intact import ForwardDtypes

def fp32_of(learn): return [p.detach().clone() for p in learn.model.parameters()]

# ---- freeze / unfreeze / fine_tune, discriminative learning rates

def two_group_learner(**kw):
    return synth_learner(splitter=lambda m: [list(m[:2].parameters()), list(m[2:].parameters())], **kw)

class Watch(Callback):
    "Record, each epoch, which masters the optimizer steps on (they have an FP32 gradient) and each group's learning rate"
    order = MasterMixedPrecision.order + 1
    def __init__(self): self.epochs = []
    def before_step(self):
        if self.iter != 0: return # hypers are set by then (ParamScheduler, at before_batch)
        self.epochs.append(dict(stepped=[p.grad is not None for p in opt_params(self.learn) if p.dim() > 1],
                                lrs=[h['lr'] for h in self.opt.hypers]))

def test_fine_tune_frozen_params_are_not_stepped_and_stay_bit_identical():
    learn = two_group_learner().to_mixed(torch.float16)
    body0 = [p.detach().clone() for p in learn.model[0].parameters()]
    watch = Watch()
    class CheckFrozen(Callback):
        def after_epoch(self):
            if self.epoch == 0 and len(watch.epochs) == 1: # the frozen epoch of fine_tune
                assert all(torch.equal(a, b.detach()) for a, b in zip(body0, list(self.learn.parameters())[:2]))
    learn.fine_tune(2, 1e-2, freeze_epochs=1, cbs=[watch, CheckFrozen()])
    frozen, unfrozen = watch.epochs[0], watch.epochs[1]
    assert frozen['stepped'] == [False, True]   # conv weight frozen: no gradient, not stepped; linear weight trains
    assert unfrozen['stepped'] == [True, True]
    assert unfrozen['lrs'][0] < unfrozen['lrs'][1] # fine_tune's slice(base_lr/lr_mult, base_lr) survives
    assert not torch.equal(body0[0], learn.model[0].weight.detach()) # after unfreeze the body trained

def test_discriminative_lrs_keep_each_groups_hypers():
    learn = two_group_learner().to_mixed(torch.float16)
    learn.unfreeze()
    watch = Watch()
    learn.fit(1, slice(1e-4, 1e-2), cbs=watch)
    assert watch.epochs[0]['lrs'] == [1e-4, 1e-2]

# ---- lr_find leaves everything as it was

def test_lr_find_restores_weights_opt_state_and_scaler():
    learn = synth_learner().to_mixed(torch.float16, init_scale=2.**8, growth_interval=3)
    learn.fit(1, 1e-2, cbs=InjectNonFinite(at=[1]))
    w, opt_sd, sc = fp32_of(learn), copy.deepcopy(learn.opt.state_dict()), learn.master_mixed_precision.scaler.state_dict()
    with learn.no_logging(): learn.lr_find(num_it=20, show_plot=False)
    assert all(torch.equal(a, b.detach()) for a, b in zip(w, learn.model.parameters()))
    assert learn.master_mixed_precision.scaler.state_dict() == sc
    assert_same_state(opt_sd['state'], learn.opt.state_dict()['state']) # moments and step counters
    # (fastai's `fit` sets the hypers' lr to `learn.lr` before LRFinder saves them: the same in FP32)
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}

def assert_same_state(a, b):
    if isinstance(a, Tensor): assert torch.equal(a, b); return
    if isinstance(a, dict): assert a.keys() == b.keys(); [assert_same_state(a[k], b[k]) for k in a]; return
    if isinstance(a, (list, tuple, L)): assert len(a) == len(b); [assert_same_state(x, y) for x, y in zip(a, b)]; return
    assert a == b

# ---- GradientClip clips the true FP32 gradients

def test_gradient_clip_clips_unscaled_fp32_grads_like_fp32():
    def one_step(mixed):
        learn = synth_learner(opt_func=partial(SGD, mom=0.), wd=0.)
        if mixed: learn.to_mixed(torch.float16)
        norms = []
        class Norm(Callback):
            def __init__(self, order): self.order = order
            def before_step(self): norms.append(torch.stack([p.grad.norm() for p in self.learn.parameters() if p.grad is not None]).norm().item())
        w0 = fp32_of(learn)
        # the norm of the gradients the optimizer will step on, before and after GradientClip
        learn.fit(1, 0.1, cbs=[GradientClip(max_norm=0.05), Norm(GradientClip.order - .5), Norm(GradientClip.order + .5), ShortFit(1)])
        return w0, fp32_of(learn), norms
    w0, w32, n32 = one_step(False)
    _, w16, n16 = one_step(True)
    assert n32[0] > 0.5 and n16[0] == pytest.approx(n32[0], rel=1e-2) # true (unscaled) gradients, clipped 10x or more
    assert n32[1] == pytest.approx(0.05, rel=1e-5) and n16[1] == pytest.approx(0.05, rel=1e-5)
    for a, b, c in zip(w0, w32, w16):
        step32, step16 = b - a, c - a
        assert (step16 - step32).norm() <= 3e-2 * step32.norm() + 1e-6 # float16 tolerance, per tensor (biases before BatchNorm: 0 in FP32)

class ShortFit(Callback):
    "Stop after n optimizer steps"
    order = 100
    def __init__(self, n): self.n, self.i = n, 0
    def after_step(self):
        self.i += 1
        if self.i >= self.n: raise fastai_cancel_fit()

def fastai_cancel_fit():
    from fastai.callback.core import CancelFitException
    return CancelFitException()

# ---- GradientAccumulation: FP32 accumulation, one check per real step

class Const(nn.Module):
    def __init__(self, n=4): super().__init__(); self.w = nn.Parameter(torch.ones(n))
    def forward(self, x): return x @ self.w

def const_learner(k, bs):
    x = torch.ones(64, 4); ds = list(zip(x, torch.zeros(64)))
    dls = DataLoaders.from_dsets(ds, ds[:16], bs=bs, num_workers=0, device='cpu')
    learn = Learner(dls, Const(), loss_func=lambda pred, y: k * pred.mean(), opt_func=partial(SGD, mom=0.), wd=0.)
    learn.remove_cb(ProgressCallback)
    return learn

def test_gradient_accumulation_in_fp32_without_16bit_overflow():
    # Each micro-batch's scaled gradient is S*k/4 = 30,000 (fits float16); four of them add up to 120,000,
    # which would overflow float16 (max 65,504) if accumulated there.
    k = 120_000 / 2.**16
    mixed = const_learner(k, bs=16).to_mixed(torch.float16)
    mixed.fit(1, 1e-3, cbs=GradientAccumulation(n_acc=64))
    big = const_learner(k, bs=64)
    big.fit(1, 1e-3)
    mmp = mixed.master_mixed_precision
    assert mmp.skipped == 0 and len(mmp.scaler.history) == 1 # one real step, checked once
    assert torch.allclose(mixed.model.w.detach(), big.model.w.detach(), rtol=1e-6)
    assert mixed.recorder.values[-1][0] == pytest.approx(big.recorder.values[-1][0], rel=1e-3) # logged losses unscaled

def test_gradient_accumulation_matches_big_batch_fp32_on_cnn():
    def run(mixed, bs, cbs):
        set_seed(0)
        learn = synth_learner(opt_func=partial(SGD, mom=0.), wd=0.)
        learn.dls = synth_dls(bs=bs)
        learn.model[1].momentum = 0. # BatchNorm statistics differ between micro and big batches; keep them out
        learn.model[1].eval(); learn.add_cb(BnEval())
        if mixed: learn.to_mixed(torch.float16)
        learn.fit(1, 0.1, cbs=cbs)
        return fp32_of(learn), learn
    w_big, _ = run(False, 64, [])
    w_acc, learn = run(True, 16, [GradientAccumulation(n_acc=64)])
    assert len(learn.master_mixed_precision.scaler.history) == 4
    for a, b in zip(w_acc, w_big): assert torch.allclose(a, b, rtol=1e-2, atol=1e-3)

class BnEval(Callback):
    order = 1
    def before_train(self): self.model[1].eval()

# ---- warn once where the 16-bit type is slow

def test_warns_once_for_float16_on_cpu(monkeypatch):
    monkeypatch.setattr(mpcallbacks.cast, 'native_16bit_dtypes', lambda device: {torch.bfloat16}) # a CPU with AVX512-BF16
    _warned.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        learn = synth_learner().to_mixed(torch.float16); learn.fit(1, 1e-3); learn.fit(1, 1e-3)
        synth_learner().to_mixed(torch.float16).fit(1, 1e-3)
        synth_learner().to_mixed(torch.bfloat16).fit(1, 1e-3)
    msgs = [str(x.message) for x in w if 'emulated' in str(x.message)]
    assert len(msgs) == 1 and 'bfloat16' in msgs[0]

# ---- optimizers: a skipped step leaves counters and moments untouched

@pytest.mark.parametrize('opt_func', [Adam, partial(SGD, mom=0.9), RAdam, Lamb, ranger, partial(OptimWrapper, opt=torch.optim.AdamW)],
                         ids=['Adam', 'SGD-mom', 'RAdam', 'Lamb', 'ranger', 'OptimWrapper-AdamW'])
def test_optimizers_skip_leaves_state_untouched(opt_func):
    learn = synth_learner(opt_func=opt_func).to_mixed(torch.float16)
    snaps = {}
    class Snap(Callback):
        order = MasterMixedPrecision.order + 1
        def before_batch(self):
            if self.training and self.epoch == 0 and self.iter == 4: snaps['before'] = copy.deepcopy(self.opt.state_dict())
        def after_batch(self):
            if self.training and self.epoch == 0 and self.iter == 4: snaps['after'] = copy.deepcopy(self.opt.state_dict())
    learn.fit(2, 1e-3, cbs=[InjectNonFinite(at=[4]), Snap()])
    assert learn.master_mixed_precision.skipped == 1
    before, after = [{k: v for k, v in snaps[k].items() if k != 'mpcallbacks.loss_scaler'} for k in ('before', 'after')]
    assert_same_state(before, after) # (the loss scaler's state, carried in the optimizer's, backed off)
    state = learn.opt.opt.state if isinstance(learn.opt.opt, Optimizer) else learn.opt.opt.opt.state
    tensors = [v for p in opt_params(learn) for v in state[p].values() if isinstance(v, Tensor) and v.is_floating_point()]
    assert tensors and {t.dtype for t in tensors} == {torch.float32} and all(torch.isfinite(t).all() for t in tensors)
    assert learn.recorder.values[-1][0] < learn.recorder.values[0][0] + 0.1

# ---- other callbacks

@pytest.mark.parametrize('mix', [MixUp, CutMix])
def test_mixup_cutmix(mix):
    fp32 = synth_learner(); fp32.fit(2, 1e-2, cbs=mix())
    mixed = synth_learner().to_mixed(torch.bfloat16); mixed.fit(2, 1e-2, cbs=mix())
    assert abs(mixed.recorder.values[-1][1] - fp32.recorder.values[-1][1]) < 0.1
    assert {p.dtype for p in mixed.model.parameters()} == {torch.float32}

def test_save_model_early_stopping_progress_showgraph_reduce_lr_csv_logger(tmp_path):
    learn = synth_learner(path=tmp_path).to_mixed(torch.float16)
    learn.add_cbs([ProgressCallback(), ShowGraphCallback()])
    reduce = ReduceLROnPlateau(patience=0, factor=10., min_delta=10.) # every epoch "plateaus": the lr drops each time
    learn.fit(3, 1e-2, cbs=[SaveModelCallback(fname='best'), EarlyStoppingCallback(patience=1), reduce, CSVLogger(fname='log.csv')])
    assert learn.opt.hypers[0]['lr'] < 1e-2 # ReduceLROnPlateau lowered the lr of the optimizer holding the masters
    assert len((tmp_path/'log.csv').read_text().splitlines()) == 1 + len(learn.recorder.values) # header + one row per epoch
    best = torch.load(tmp_path/'models'/'best.pth', weights_only=True)
    assert {v.dtype for v in best.values() if v.is_floating_point()} == {torch.float32}
    for (k, v), p in zip([(k, v) for k, v in best.items() if 'running' not in k and 'num_batches' not in k], learn.model.parameters()):
        assert torch.equal(v, p.detach()), k # the best model was loaded back exactly, in FP32

class TwoInTwoOut(nn.Module):
    def __init__(self):
        super().__init__(); self.a, self.b, self.bn = nn.Linear(8, 4), nn.Linear(8, 4), nn.BatchNorm1d(4)
    def forward(self, x1, x2): h = self.bn(self.a(x1) + self.b(x2)); return h[:, :2], h[:, 2:]

def test_multi_input_multi_output_and_predictions_are_fp32():
    set_seed(0)
    x1, x2, y = torch.randn(96, 8), torch.randn(96, 8), torch.randint(0, 2, (96,))
    ds = list(zip(x1, x2, y))
    dls = DataLoaders.from_dsets(ds[:64], ds[64:], bs=16, num_workers=0, device='cpu')
    dls.n_inp = 2
    loss = lambda preds, y: sum(nn.functional.cross_entropy(p, y) for p in preds)
    learn = Learner(dls, TwoInTwoOut(), loss_func=loss).to_mixed(torch.float16)
    learn.remove_cb(ProgressCallback)
    seen = set()
    class P(Callback):
        order = MasterMixedPrecision.order + 1
        def after_pred(self): seen.update(p.dtype for p in self.pred)
    learn.fit(2, 1e-2, cbs=P())
    assert seen == {torch.float32}
    preds, targs = learn.get_preds()
    assert [p.dtype for p in preds] == [torch.float32, torch.float32]
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}

def digits_block_learner():
    from fastai.data.block import DataBlock, TransformBlock, CategoryBlock
    from fastai.data.transforms import IndexSplitter
    from sklearn.datasets import load_digits
    d = load_digits(); X = torch.tensor(d.images[:400], dtype=torch.float32)[:, None] / 16; Y = d.target[:400]
    db = DataBlock(blocks=(TransformBlock(type_tfms=lambda i: X[i]), CategoryBlock), get_y=lambda i: Y[i],
                   splitter=IndexSplitter(list(range(300, 400))))
    dls = db.dataloaders(list(range(400)), bs=50, num_workers=0, device='cpu')
    from mpcallbacks.digits import digits_cnn
    set_seed(0)
    learn = Learner(dls, digits_cnn(), loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    learn.remove_cb(ProgressCallback)
    return learn

def test_get_preds_predict_tta_are_float32():
    learn = digits_block_learner().to_mixed(torch.float16)
    learn.fit(1, 1e-2)
    preds, targs = learn.get_preds()
    assert preds.dtype == torch.float32 and preds.shape == (100, 10)
    _, _, probs = learn.predict(5)
    assert probs.dtype == torch.float32
    tta_preds, _ = learn.tta(n=2)
    assert tta_preds.dtype == torch.float32
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}
    fp32 = learn.to_unmixed().get_preds()[0]
    assert (fp32.argmax(1) == preds.argmax(1)).float().mean() > 0.95 # 16-bit inference agrees with FP32

# ---- BatchNorm variants and keep_fp32

class BNZoo(nn.Module):
    def __init__(self):
        super().__init__()
        self.c3, self.bn3 = nn.Conv3d(1, 2, 1), nn.BatchNorm3d(2)
        self.bn2 = nn.BatchNorm2d(2, affine=False)
        self.fc, self.bn1, self.ln, self.out = nn.Linear(32, 6), nn.BatchNorm1d(6), nn.LayerNorm(6), nn.Linear(6, 2)
    def forward(self, x):
        h = self.bn3(self.c3(x[:, :, None].expand(-1, -1, 4, -1, -1)))  # (b, 2, 4, 8, 8)
        h = self.bn2(h.mean(2))                                         # (b, 2, 8, 8)
        h = nn.functional.avg_pool2d(h, 2).flatten(1)                   # (b, 32)
        return self.out(self.ln(self.bn1(self.fc(h))))

@pytest.mark.parametrize('keep', [(), (nn.LayerNorm, 'out')])
def test_batchnorm_variants_and_keep_fp32(keep):
    learn = Learner(synth_dls(), BNZoo(), loss_func=CrossEntropyLossFlat()).to_mixed(torch.float16, keep_fp32=keep)
    learn.remove_cb(ProgressCallback)
    probe = ForwardDtypes() # what the forward ran with
    learn.fit(1, 1e-2, cbs=probe)
    for n, dts in probe.seen.items(): # every slot holds the FP32 master (buffers are never cast)
        assert dts == ({torch.long} if n.endswith('num_batches_tracked') else {torch.float32}), n
    computed = {n:dts for n, dts in probe.outs.items() if n in ('c3', 'fc', 'out')} # the layers autocast casts in their ops
    assert computed == {'c3': {torch.float16}, 'fc': {torch.float16}, 'out': {torch.float32 if keep else torch.float16}}, computed
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}

def test_frozen_batchnorm_in_eval_keeps_fp32_stats_bit_identical():
    learn = two_group_learner(train_bn=False).to_mixed(torch.float16)
    learn.freeze() # body frozen, BatchNorm included (train_bn=False)
    stats = [b.clone() for b in learn.model[1].buffers()]
    dts = set()
    class P(Callback):
        order = MasterMixedPrecision.order + 1
        def after_batch(self): dts.update(t.dtype for t in list(self.model[1].parameters()) + [self.model[1].running_mean])
    learn.fit(1, 1e-2, cbs=[BnFreeze(), P()])
    assert dts == {torch.float32}
    assert all(torch.equal(a, b) for a, b in zip(stats, learn.model[1].buffers()))

# ---- requires_grad changed on either side in the middle of a fit

def test_requires_grad_toggled_mid_epoch_on_either_side_takes_effect_at_once():
    """A callback unfreezes the conv layer through the model (the 16-bit copy) at batch 2, and freezes the classifier
    through the optimizer (its master) at batch 4: the conv layer trains as in FP32 from then on, the classifier stops.
    (fastai's FP32 `zero_grad` keeps zeroed gradients, so Adam's momentum still moves a layer frozen mid-fit; mixed
    precision frees every gradient after a step, so a frozen layer stops at once.)"""
    class Toggle(Callback):
        def before_batch(self):
            if not self.training: return
            if self.iter == 2: self.model[0].weight.requires_grad_(True)
            if self.iter == 4:
                self.opt.param_lists[-1][-2].requires_grad_(False) # the classifier's weight, as the optimizer holds it
                self.frozen_at = self.opt.param_lists[-1][-2].detach().clone()
    def run(mixed):
        learn = synth_learner(splitter=lambda m: [list(m.parameters())]) # every parameter in the optimizer, frozen or not
        learn.model[0].weight.requires_grad_(False)
        if mixed: learn.to_mixed(torch.bfloat16)
        toggle = Toggle()
        learn.fit(1, 1e-2, cbs=toggle)
        return learn, toggle
    (fp32, _), (mixed, toggle) = run(False), run(True)
    start = synth_learner().model[0].weight.detach()
    a, b = fp32.model[0].weight.detach(), mixed.model[0].weight.detach()
    assert mixed.model[0].weight.requires_grad and not mixed.model[4].weight.requires_grad # the FP32 model took both changes
    assert not torch.equal(b, start), "the conv layer unfrozen through the model did not train"
    assert (b - a).abs().max() < 0.25 * (a - start).abs().max() # bfloat16 vs FP32, over 6 steps
    assert torch.equal(mixed.model[4].weight.detach(), toggle.frozen_at), "the classifier frozen through the optimizer kept moving"
