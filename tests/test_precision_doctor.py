"""The precision doctor: `learn.precision_report()` and `to_mixed(keep_fp32='auto')`.

Models built to break, each against FP32 on the same seed: activations beyond float16's range, gradients that
underflow without loss scaling, a layer that bfloat16's 7 mantissa bits make wrong, a forward that mixes dtypes
(`parametrizations.orthogonal`); and benign models, where the doctor flags nothing and 'auto' changes nothing. The
report leaves the learner untouched, bit for bit, also when it raises, and reads the device once."""
import random, warnings
import numpy as np
import pytest, torch
from torch import nn
from fastai.basics import Learner, CrossEntropyLossFlat, SGD, set_seed
import mpcallbacks.all # noqa: F401 (`Learner.to_mixed`, `Learner.precision_report`)
from mpcallbacks.policy import KeptFor
from mpcallbacks.scaler import NonFiniteGradients
from mpcallbacks.digits import digits_cnn, digits_dls
from mpcallbacks.test_utils import synth_learner, count_syncs
from like_fp32 import fit_once
from intact import assert_fp32_and_intact, hook_ids
from test_applications import make_transformer

# ---- models built to break

class Gain(nn.Module):
    "A linear layer followed by a large fixed gain: its output leaves float16's range (65504), not bfloat16's"
    def __init__(self, n_in, n_out, gain=1e6): super().__init__(); self.lin,self.gain = nn.Linear(n_in, n_out),gain
    def forward(self, x): return self.lin(x) * self.gain

def gain_learner():
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = nn.Sequential(nn.Flatten(), Gain(64, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 2))
    return learn

class TinyLoss(nn.Module):
    "Cross-entropy times 2**-24: every gradient that much smaller, below float16's smallest normal without a loss scale"
    def forward(self, out, y): return nn.functional.cross_entropy(out, y) * 2**-24

def tiny_loss_learner():
    learn = synth_learner(opt_func=SGD)
    torch.manual_seed(0)
    learn.model,learn.loss_func = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2)),TinyLoss()
    return learn

class Integrator(nn.Module):
    "A running sum of small increments on a large level: in bfloat16 (ulp 2**-5 at 4) each addition rounds the increment away"
    def __init__(self, n_in, n=128): super().__init__(); self.lin = nn.Linear(n_in, n)
    def forward(self, x):
        h = self.lin(x) * 0.01
        s,out = torch.full_like(h[:, 0], 4.),[]
        for t in range(h.shape[1]):
            s = s + h[:, t]
            out.append(s)
        return torch.stack(out, 1) - 4.

def integrator_learner():
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = nn.Sequential(nn.Flatten(), Integrator(64), nn.Linear(128, 2))
    return learn

def orthogonal_learner():
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = nn.Sequential(nn.Flatten(), nn.utils.parametrizations.orthogonal(nn.Linear(64, 64)), nn.ReLU(), nn.Linear(64, 2))
    return learn

# ---- benign models

class TinyResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1,self.bn1,self.conv2,self.bn2 = nn.Conv2d(c, c, 3, padding=1),nn.BatchNorm2d(c),nn.Conv2d(c, c, 3, padding=1),nn.BatchNorm2d(c)
    def forward(self, x): return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))

def resnet_learner():
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), TinyResBlock(16), TinyResBlock(16),
                                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 2))
    return learn

def digits_learner():
    torch.manual_seed(0)
    return Learner(digits_dls(bs=64), digits_cnn(), loss_func=CrossEntropyLossFlat())

def transformer_learner():
    set_seed(0)
    return make_transformer()

benign = {'digits CNN': digits_learner, 'transformer': transformer_learner, 'ResNet': resnet_learner}

def quiet(learn):
    learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ == 'ProgressCallback'])
    return learn

def fit_auto(make, mixed, **kw):
    "`fit_once` with 'auto' saying what it keeps: the warnings it gave, by text"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        run = fit_once(make, mixed, **kw)
    return run,[str(x.message) for x in w if "keep_fp32='auto'" in str(x.message) or 'loss scaling' in str(x.message)]

def rel(a, b) -> float: return abs(a - b) / abs(b)

# ---- activations beyond float16's range

def test_overflow_plain_float16_skips_every_step_and_auto_trains_like_fp32():
    rep = gain_learner().precision_report(torch.float16)
    top = rep.iloc[0]
    assert (top.module, top.verdict) == ('1', 'keep FP32') and top.reason.startswith('overflow'), rep[['module', 'verdict', 'reason']]
    assert set(rep.verdict[rep.module != '1']) == {'fine'}
    assert set(gain_learner().precision_report(torch.bfloat16).verdict) == {'fine'} # bfloat16 has float32's range
    ref = fit_once(gain_learner, None, epochs=3)
    plain = gain_learner().to_mixed(torch.float16)
    n = 3 * len(plain.dls.train)
    with pytest.raises(NonFiniteGradients, match=f"All {n} optimizer steps of this fit"): plain.fit(3, 1e-2) # nothing learned: said
    cb = plain.cbs[-1]
    assert cb.skipped == n, f"plain float16 skipped {cb.skipped} of {n} steps"
    auto,said = fit_auto(gain_learner, dict(dtype=torch.float16, keep_fp32='auto'), epochs=3)
    assert auto.learn.cbs[-1].skipped == 0 and auto.learn.cbs[-1].auto_kept == (KeptFor('1', 'overflow'),)
    assert len(said) == 1 and '`1` (overflow' in said[0], said
    assert rel(auto.mean_loss(False, 4), ref.mean_loss(False, 4)) < 0.02, (auto.mean_loss(False, 4), ref.mean_loss(False, 4))
    s = auto.learn.mixed_summary()
    assert s.set_index('module').why['1.lin'] == "auto: overflow (in `1`)", s

# ---- gradients that underflow without loss scaling

def test_gradients_that_underflow_need_loss_scaling():
    rep = tiny_loss_learner().to_mixed(torch.float16, loss_scale=None).precision_report()
    rep = rep[rep.module != '0'] # (the Flatten of the data: no gradient)
    assert set(rep.verdict) == {'needs loss scaling'}, rep[['module', 'verdict', 'reason']]
    assert "loss scale 1: use loss_scale='dynamic'" in rep.reason.iloc[0]
    assert (rep.grad_underflow == 1).all()
    assert set(tiny_loss_learner().to_mixed(torch.float16).precision_report().verdict) == {'fine'} # the dynamic scale settles high enough
    lr = 2**24 * 0.1 # SGD: the 2**-24 smaller gradients at a 2**24 larger rate make the ordinary step
    ref = fit_once(tiny_loss_learner, None, epochs=3, lr=lr)
    unscaled = fit_once(tiny_loss_learner, dict(dtype=torch.float16, loss_scale=None), epochs=3, lr=lr)
    dynamic = fit_once(tiny_loss_learner, dict(dtype=torch.float16), epochs=3, lr=lr)
    end = {k:r.mean_loss(False, 4) for k,r in dict(ref=ref, unscaled=unscaled, dynamic=dynamic).items()}
    assert rel(end['dynamic'], end['ref']) < 0.02 and rel(end['unscaled'], end['ref']) > 0.1, end
    # 'auto' keeps nothing for it: FP32 would not help, a loss scale does; its warning says so
    _,said = fit_auto(tiny_loss_learner, dict(dtype=torch.float16, loss_scale=None, keep_fp32='auto'), epochs=1, lr=lr)
    assert len(said) == 1 and 'need loss scaling' in said[0] and "loss_scale='dynamic'" in said[0], said

# ---- a layer bfloat16 makes wrong

def test_a_layer_sensitive_in_bfloat16_is_kept():
    rep = integrator_learner().precision_report(torch.bfloat16)
    top = rep.iloc[0]
    assert (top.module, top.verdict) == ('1', 'keep FP32') and top.reason.startswith('sensitivity'), rep[['module', 'verdict', 'reason']]
    assert top.sensitivity > 0.1 and set(rep.verdict[1:]) == {'fine'}
    ref = fit_once(integrator_learner, None, epochs=3)
    plain = fit_once(integrator_learner, dict(dtype=torch.bfloat16), epochs=3)
    auto,said = fit_auto(integrator_learner, dict(dtype=torch.bfloat16, keep_fp32='auto'), epochs=3)
    end32 = ref.mean_loss(False, 4)
    assert rel(plain.mean_loss(False, 4), end32) > 0.2, (plain.mean_loss(False, 4), end32)
    assert rel(auto.mean_loss(False, 4), end32) < 0.02, (auto.mean_loss(False, 4), end32)
    assert len(said) == 1 and '`1` (sensitivity' in said[0], said

# ---- a forward that mixes dtypes: torch's orthogonal parametrization

def test_orthogonal_parametrization_runs_in_fp32_and_trains_as_in_fp32():
    "A parametrization computes its weight in FP32 (an orthogonal matrix's exponential in 16 bits is not orthogonal): as FP32 trains, with nothing to flag"
    ref = fit_once(orthogonal_learner, None, epochs=3)
    mix = fit_once(orthogonal_learner, dict(dtype=torch.bfloat16), epochs=3)
    assert rel(mix.mean_loss(False, 4), ref.mean_loss(False, 4)) < 0.02
    s = mix.learn.mixed_summary().set_index('module')
    assert s.why['1.parametrizations.weight'] == 'parametrization' and s.forward['3'] == 'bfloat16', s
    rep = orthogonal_learner().precision_report(torch.bfloat16)
    assert set(rep.verdict) == {'fine'}, rep[['module', 'verdict', 'reason']]

# ---- benign models: nothing flagged, nothing changed

@pytest.mark.parametrize('name', list(benign))
@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_benign_models_are_fine(name, dtype):
    rep = quiet(benign[name]()).precision_report(dtype)
    assert set(rep.verdict) == {'fine'}, rep[rep.verdict != 'fine'][['module', 'verdict', 'reason']]
    assert (rep.sensitivity < 2 * torch.finfo(dtype).eps).all(), rep.sensitivity.max() # well under the 8-epsilon limit

def test_fine_rows_are_in_the_models_order():
    # not by headroom: a hundred bits of room more or less ranks nothing, and the model's order is what a reader follows
    learn = digits_learner()
    rep = learn.precision_report(torch.bfloat16)
    assert set(rep.verdict) == {'fine'}
    assert list(rep.module) == [n for n,m in learn.model.named_modules() if n in set(rep.module)]

@pytest.mark.parametrize('name', list(benign))
def test_auto_changes_nothing_on_benign_models(name):
    default = quiet(benign[name]()).to_mixed(torch.bfloat16)
    learn = quiet(benign[name]()).to_mixed(torch.bfloat16, keep_fp32='auto')
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        learn.fit(1, 1e-3)
    assert not [x for x in w if 'auto' in str(x.message)]
    assert learn.cbs[-1].auto_kept == ()
    assert learn.mixed_summary().equals(default.mixed_summary())

# ---- 'auto' itself

def test_auto_is_validated_and_measures_once():
    with pytest.raises(TypeError, match="keep_fp32 takes .*'auto'"): synth_learner().to_mixed(keep_fp32=['auto', 3])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        learn = gain_learner().to_mixed(torch.float16, keep_fp32=['auto', nn.ReLU])
    assert not [x for x in w if 'matches no module' in str(x.message)] # 'auto' is not a name pattern
    assert learn.mixed_summary().set_index('module').why['1.lin'] == 'autocast' # decided at the first fit
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        learn.fit(1, 1e-2)
        learn.fit(1, 1e-2)
    assert len([x for x in w if "keep_fp32='auto'" in str(x.message)]) == 1
    assert learn.cbs[-1].keep[-2:] == (nn.ReLU, KeptFor('1', 'overflow'))
    assert learn.cbs[-1].skipped == 0

def test_auto_fit_follows_the_same_batches_as_without():
    "The measurement draws batches from dls.train: the fit after it shuffles and draws as it would have"
    seen = {}
    for auto in (False, True):
        learn = fit_once(synth_learner, dict(dtype=torch.bfloat16, keep_fp32='auto' if auto else ()), epochs=2).learn
        seen[auto] = {n:p.detach().clone() for n,p in learn.model.named_parameters()}
    assert all(torch.equal(seen[False][n], seen[True][n]) for n in seen[False])

# ---- the report leaves the learner untouched, bit for bit

def _state(learn) -> dict:
    "Everything the report must leave as it was"
    opt = learn.opt
    return dict(
        params={n:p.detach().clone() for n,p in learn.model.named_parameters()},
        grads={n:None if p.grad is None else p.grad.clone() for n,p in learn.model.named_parameters()},
        grad_ids={n:id(p.grad) for n,p in learn.model.named_parameters()},
        buffers={n:b.clone() for n,b in learn.model.named_buffers()},
        opt={k:v.clone() if isinstance(v, torch.Tensor) else v for p,st in opt.state.items() for k,v in st.items()},
        rng=(torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy(), learn.dls.train.rng.getstate()),
        training={n:m.training for n,m in learn.model.named_modules()},
        attrs={k:id(getattr(learn, k, None)) for k in ('pred', 'loss', 'loss_grad', 'xb', 'yb', 'opt', 'model', 'dls')},
        hooks=hook_ids(learn.model), global_hooks=(len(torch.nn.modules.module._global_forward_hooks),
                                                   len(torch.nn.modules.module._global_forward_pre_hooks)))

def _same(a, b) -> list:
    "The keys of `_state` that differ"
    def eq(x, y):
        if isinstance(x, torch.Tensor): return isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)
        if isinstance(x, np.ndarray): return np.array_equal(x, y)
        if isinstance(x, dict): return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)): return len(x) == len(y) and all(eq(u, v) for u,v in zip(x, y))
        return x == y
    return [k for k in a if not eq(a[k], b[k])]

def trained_learner():
    "BatchNorm (running statistics), Dropout (random state), an optimizer with state, gradients left from a batch, eval mode"
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Dropout(0.3), nn.Linear(512, 2))
    learn.fit(1, 1e-3)
    xb,yb = learn.dls.one_batch()
    learn.loss_func(learn.model(xb), yb).backward() # gradients the report must not touch
    learn.pred,learn.loss = torch.zeros(1),torch.ones(1)
    learn.model.eval()
    return learn

@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_report_leaves_everything_untouched(dtype):
    learn = trained_learner()
    before = _state(learn)
    rep = learn.precision_report(dtype)
    assert len(rep) == 6 # every module
    assert not _same(before, _state(learn)), _same(before, _state(learn))

class FailOn:
    "A loss function that raises at its `n`th call"
    def __init__(self, loss_func, n): self.loss_func,self.n,self.calls = loss_func,n,0
    def __call__(self, *args):
        self.calls += 1
        if self.calls == self.n: raise ValueError('a loss that fails')
        return self.loss_func(*args)

def test_report_that_raises_leaves_everything_untouched():
    learn = trained_learner()
    learn.loss_func = FailOn(learn.loss_func, 2) # the second batch: after the first one's statistics and backward
    before = _state(learn)
    with pytest.raises(ValueError, match='a loss that fails'): learn.precision_report()
    assert not _same(before, _state(learn)), _same(before, _state(learn))
    learn.loss_func = learn.loss_func.loss_func
    assert_fp32_and_intact(learn)

def test_next_fit_follows_the_same_trajectory():
    "A report between two fits changes nothing the next fit computes: the same weights, bit for bit"
    after = []
    for report in (False, True):
        set_seed(0)
        learn = trained_learner()
        if report: learn.precision_report(torch.float16)
        learn.model.train()
        learn.fit(1, 1e-3)
        after.append({n:p.detach().clone() for n,p in learn.model.named_parameters()})
    assert all(torch.equal(after[0][n], after[1][n]) for n in after[0])

def test_report_reads_the_device_once():
    "One transfer for the whole table, whatever the number of modules; the data loader's own draw aside"
    def syncs(n_blocks):
        learn = synth_learner()
        torch.manual_seed(0)
        learn.model = nn.Sequential(nn.Flatten(), *[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU()) for _ in range(n_blocks)], nn.Linear(64, 2))
        with count_syncs() as counts: rep = learn.precision_report(torch.float16, n_batches=3)
        assert len(rep) == 4 * n_blocks + 2 # the Flatten, each block and its three layers, the head
        return counts
    few,many = syncs(2),syncs(20)
    assert few == many and few['tolist'] == 1 and sum(few.values()) <= 2, (few, many)

def test_report_defaults_follow_to_mixed():
    learn = gain_learner().to_mixed(torch.bfloat16, keep_fp32=['1'])
    rep = learn.precision_report()
    assert rep.attrs['dtype'] == torch.bfloat16 and '1' not in set(rep.module) and rep.attrs['loss_scale'] == 1.
    rep = gain_learner().precision_report()
    assert rep.attrs['dtype'] == torch.float16 and rep.attrs['dynamic']
    with pytest.raises(ValueError, match='n_batches'): gain_learner().precision_report(n_batches=0)
    with pytest.raises(ValueError, match='float16 or torch.bfloat16'): gain_learner().precision_report(torch.float32)

def test_a_stateful_rnn_is_judged_as_the_fit_runs_it():
    """AWD-LSTM: its hidden state carries over between forwards, and its `WeightDropout` sets the LSTM's weight in its own
    forward; each rerun starts from the state its FP32 forward started from, and the LSTM alone is judged inside the
    `WeightDropout` that runs it. Its batches also go through fastai's `RNNCallback` (`after_pred`), as in a fit."""
    from test_applications import make_awd_lm
    set_seed(0)
    learn = quiet(make_awd_lm())
    hidden = learn.model[0].hidden
    rep = learn.precision_report(torch.bfloat16)
    assert set(rep.verdict) == {'fine'}, rep[rep.verdict != 'fine'][['module', 'reason']]
    lstm = rep.set_index('module').loc['0.rnns.0.module']
    # judged inside the `WeightDropout` that runs it, or on its own where its 16-bit rerun alone runs (the forward's autocast
    # casts the FP32 weight `WeightDropout` left on it, as the fit's 16-bit forward gives it a 16-bit one)
    assert 'only inside `0.rnns.0`' in lstm.reason or lstm.sensitivity == lstm.sensitivity, lstm
    assert learn.model[0].hidden is hidden

# ---- data-parallel ranks measure their own batches, and cast alike

def _auto_on_rank(rank, port, out):
    "One rank of two: 'auto' measured on this rank's own model and batches, then what it keeps written to `out`"
    import os, torch.distributed as dist
    from mpcallbacks import doctor
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    dist.init_process_group('gloo', rank=rank, world_size=2)
    try:
        learn = quiet(gain_learner())
        if rank == 1: learn.model[1].gain = 1. # here the layer stays in float16's range: on its own, this rank keeps nothing
        learn.to_mixed(torch.float16, keep_fp32='auto')
        cb = learn.master_mixed_precision
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            cb.take_auto(doctor.auto_fp32(learn, cb.dtype, cb.keep, cb.loss_scale, cb.scaler.dynamic))
        torch.save([(k.name, k.why) for k in cb.auto_kept], f'{out}/rank{rank}.pt')
    finally: dist.destroy_process_group()

def test_auto_keeps_what_any_rank_flags_on_every_rank(tmp_path):
    "Ranks that measured different batches keep the same modules (all must cast the model alike): what any rank flags"
    from distributed_worker import free_port
    torch.multiprocessing.spawn(_auto_on_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    kept = [torch.load(tmp_path/f'rank{r}.pt') for r in range(2)]
    assert kept[0] == kept[1] == [('1', 'overflow')], kept
