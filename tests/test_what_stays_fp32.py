"""What stays FP32, what is left behind after a fit, and the CPU speed warning match what the docs say.

The README says "Normalization layers stay FP32": LayerNorm and GroupNorm included, by default. After a fit nothing of
16 bits is left anywhere in the module tree, plain tensor attributes included. The warning that a 16-bit type is slow on
this CPU follows what the CPU supports, for whichever type torch emulates."""
import warnings
import pytest
import torch
from intact import ForwardDtypes
from torch import nn, Tensor
from fastai.basics import Callback
import mpcallbacks.all # noqa: F401 (`Learner.to_mixed`)
import mpcallbacks.cast
from mpcallbacks.test_utils import synth_learner
from like_fp32 import fit_once, assert_like_fp32
from test_applications import make_awd_lm, make_awd_classifier

# ---- LayerNorm and GroupNorm stay FP32 during a fit, by default, as BatchNorm does

RMSNorm = getattr(nn, 'RMSNorm', None) # torch >= 2.4
norms_1d = {'LayerNorm': nn.LayerNorm} | ({'RMSNorm': RMSNorm} if RMSNorm else {})

class NormNet(nn.Module):
    "Conv -> GroupNorm, then Linear -> LayerNorm (or `norm`, RMSNorm say) -> Linear, on synth_dls' 1x8x8 images"
    def __init__(self, norm=nn.LayerNorm):
        super().__init__()
        self.conv, self.gn = nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.lin, self.ln, self.head = nn.Linear(8*8*8, 32), norm(32), nn.Linear(32, 2)
    def forward(self, x):
        h = torch.relu(self.gn(self.conv(x))).flatten(1)
        return self.head(torch.relu(self.ln(self.lin(h))))

class NormDtypes(ForwardDtypes):
    "The dtypes of the norm layers' parameters inside each forward, and what the conv and linear layers computed in"
    @property
    def norms(self): return {d for n, ds in self.seen.items() if n.startswith(('gn.', 'ln.')) for d in ds}
    @property
    def others(self): return {d for n, ds in self.outs.items() if n in ('conv', 'lin', 'head') for d in ds}

@pytest.mark.parametrize('norm', list(norms_1d))
def test_layer_norm_and_group_norm_stay_fp32_by_default(norm):
    "RMSNorm too: every normalization layer, as the docs say"
    def make():
        learn = synth_learner()
        learn.model = NormNet(norms_1d[norm])
        return learn
    seen = NormDtypes()
    ref = fit_once(make, None, 2, 1e-2)
    mix = fit_once(make, dict(dtype=torch.bfloat16), 2, 1e-2, cbs=[seen])
    assert seen.others == {torch.bfloat16}, f"the conv and linear layers ran as {seen.others}"
    assert seen.norms == {torch.float32}, f"GroupNorm/{norm} parameters during the fit: {seen.norms} (the docs say FP32)"
    assert_like_fp32(ref, mix, cos_min=0.9)

# ---- nothing 16-bit left behind after a fit, plain attributes included (AWD-LSTM's WeightDropout keeps `weight_hh_l0`)

def tensors_16bit(model) -> list:
    "Every 16-bit tensor the module tree holds: parameters, buffers, and tensors kept as plain attributes or in lists"
    found = []
    def visit(name, v):
        if isinstance(v, Tensor):
            if v.dtype in (torch.float16, torch.bfloat16): found.append(f'{name} {v.dtype}')
        elif isinstance(v, dict): [visit(f'{name}.{k}', o) for k, o in v.items()]
        elif isinstance(v, (list, tuple)): [visit(f'{name}[{i}]', o) for i, o in enumerate(v)]
    for mname, m in model.named_modules():
        for k, v in vars(m).items():
            if k in ('_modules',): continue
            visit(f'{mname}.{k}' if mname else k, v)
    return found

def make_plain_lstm():
    from test_tensors_made_in_forward import make_learner, LSTMFromZeroState
    return make_learner(LSTMFromZeroState)()

LEFTOVER_CASES = [make_awd_lm, make_awd_classifier, make_plain_lstm]
LEFTOVER_IDS = ['awd_lstm_lm', 'awd_lstm_classifier', 'plain_nn_lstm']

@pytest.mark.parametrize('make', LEFTOVER_CASES, ids=LEFTOVER_IDS)
def test_after_fit_no_16bit_tensor_is_left_anywhere_in_the_module_tree(make):
    "Parameters, buffers, and plain attributes: WeightDropout's `weight_hh_l0`, an RNN's `_flat_weights`, AWD-LSTM's `hidden`"
    run = fit_once(make, dict(dtype=torch.bfloat16), 1, 1e-2)
    ref = fit_once(make, None, 1, 1e-2)
    assert not tensors_16bit(ref.learn.model), "the walk itself finds 16-bit tensors after an FP32 fit"
    model = run.learn.model
    if make is not make_plain_lstm:
        assert any(hasattr(m, 'module') and 'weight_hh_l0' in vars(m.module) for m in model.modules()), \
            "no WeightDropout attribute found: the test does not look where the stale weight lives"
    left = tensors_16bit(model)
    assert not left, f"16-bit tensors left in the model after fit: {left}"

class KeepsActivations(nn.Module):
    "Keeps what its forward saw: in buffers (one registered as None, one as a tensor) and in a dict attribute"
    def __init__(self):
        super().__init__()
        self.lin, self.head = nn.Linear(64, 16), nn.Linear(16, 2)
        self.register_buffer('last_h', None)
        self.register_buffer('mean_h', torch.zeros(16))
        self.stats = {}
    def forward(self, x):
        h = torch.relu(self.lin(x.flatten(1)))
        self.last_h, self.mean_h = h.detach(), h.detach().mean(0)
        self.stats['h'] = h.detach().abs().max()
        return self.head(h)

def test_buffers_and_dicts_a_forward_filled_are_fp32_after_fit():
    "In FP32 they hold FP32 activations; after a mixed fit, the same, in the state dict too"
    def make():
        learn = synth_learner()
        learn.model = KeepsActivations()
        return learn
    run = fit_once(make, dict(dtype=torch.bfloat16), 1, 1e-2)
    left = tensors_16bit(run.learn.model)
    assert not left, f"16-bit tensors left in the model after fit: {left}"
    assert {v.dtype for v in run.learn.model.state_dict().values()} == {torch.float32}

@pytest.mark.parametrize('make', LEFTOVER_CASES, ids=LEFTOVER_IDS)
def test_after_fit_the_fp32_model_runs_a_plain_forward_as_a_fresh_copy_does(make):
    """No reset, no callback: `learn.model(x)` in eval mode, as a user calls it after fit, gives what a freshly built model
    loaded with the same state dict gives (1e-6): no stale 16-bit state (an RNN's hidden state) changes or breaks it"""
    run = fit_once(make, dict(dtype=torch.bfloat16), 1, 1e-2)
    x = run.learn.dls.valid.one_batch()[0]
    model = run.learn.model.eval()
    fresh = make().model.eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad(): want = fresh(x)
    with torch.no_grad(): got = model(x)
    got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

# ---- a module kept in FP32 by name hands its output on in FP32 (a head's predictions were rounded)

class Preds(Callback):
    "Every training prediction, as the loss function gets it"
    def __init__(self): self.preds = []
    def after_pred(self):
        if self.training: self.preds.append(self.learn.pred.detach().clone())

def test_a_head_kept_in_fp32_predicts_in_fp32():
    "Regression around 1000: bfloat16 spaces values there by 8, so a 16-bit head could only predict multiples of 8"
    from fastai.basics import Learner, DataLoaders, MSELossFlat
    def make():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(320, 8, generator=g)
        y = 1000 + x @ torch.randn(8, 1, generator=g)
        ds = list(zip(x, y))
        dls = DataLoaders.from_dsets(ds[:256], ds[256:], bs=32, num_workers=0, device='cpu')
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        with torch.no_grad(): model[2].bias.fill_(1000.)
        return Learner(dls, model, loss_func=MSELossFlat())
    look = Preds()
    ref = fit_once(make, None, 3, 1e-2)
    mix = fit_once(make, dict(dtype=torch.bfloat16, keep_fp32=['2']), 3, 1e-2, cbs=[look])
    preds = torch.cat(look.preds)
    assert preds.dtype == torch.float32 and not torch.equal(preds, preds.round() // 8 * 8), "the head's output was rounded to 16 bits"
    end32, end16 = ref.mean_loss(False, 4), mix.mean_loss(False, 4)
    assert end16 <= 1.5 * end32, f"final loss {end16:.3f}, FP32 {end32:.3f}"

# ---- normalization layers without parameters: their CPU kernels take no 16-bit input

def test_local_response_norm_trains():
    "`nn.LocalResponseNorm` has no bfloat16/float16 kernel on a CPU: it runs in FP32 as the other normalization layers"
    def make():
        learn = synth_learner()
        learn.model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.LocalResponseNorm(3), nn.ReLU(), nn.Flatten(),
                                    nn.Linear(8*8*8, 2))
        return learn
    ref = fit_once(make, None, 2, 1e-2)
    mix = fit_once(make, dict(dtype=torch.bfloat16), 2, 1e-2)
    assert_like_fp32(ref, mix, cos_min=0.9)

# ---- the speed warning follows what the CPU supports
#
# torch.backends.cpu.get_cpu_capability() is one of "DEFAULT", "VSX", "Z VECTOR", "NO AVX", "AVX2", "AVX512",
# "SVE128"/"SVE256"/"SVE512" (torch/backends/cpu/__init__.py): the vector ISA torch's kernels were dispatched for, which
# says nothing of bfloat16 or float16 arithmetic. torch.cpu has the finer checks: _is_avx512_bf16_supported(),
# _is_amx_tile_supported() (AMX-BF16 comes with the tiles), _is_amx_fp16_supported(). The rule encoded here, for x86:
#   bfloat16 is native  iff AVX512-BF16 or AMX tiles
#   float16  is native  iff AMX-FP16
# whatever the capability: oneDNN, which runs the matmuls and convolutions, picks its own instructions (with a forced
# ATEN_CPU_CAPABILITY=avx2 on this AMX machine, a 512x512 bfloat16 matmul took 0.21 ms, FP32's 1.55 ms). torch exposes no
# AVX512-FP16 check, so AVX512-FP16 alone (Sapphire Rapids without AMX-FP16) counts as emulated float16, as measured on
# this machine. A warning names the emulated type; it never calls an emulated type "the faster choice".

CPUS = { # capability, avx512_bf16, amx_tile, amx_fp16 -> (bfloat16 warns, float16 warns)
    'AVX2 (AMD EPYC Zen 2/3)': (('AVX2', False, False, False), (True, True)),
    'DEFAULT': (('DEFAULT', False, False, False), (True, True)),
    'AVX512 without BF16 (Skylake-SP)': (('AVX512', False, False, False), (True, True)),
    'AVX512-BF16 (Cooper Lake, Zen 4)': (('AVX512', True, False, False), (False, True)),
    'AMX-BF16 (Sapphire Rapids)': (('AVX512', True, True, False), (False, True)),
    'AMX-FP16 (Granite Rapids)': (('AVX512', True, True, True), (False, False)),
    'AVX2 dispatch on an AMX CPU': (('AVX2', True, True, True), (False, False)), # oneDNN still uses AMX
}

def fake_cpu(monkeypatch, capability, bf16, amx, amx_fp16):
    monkeypatch.setattr(torch.backends.cpu, 'get_cpu_capability', lambda: capability)
    monkeypatch.setattr(torch.cpu, '_is_avx512_bf16_supported', raising=False, value=lambda: bf16)
    monkeypatch.setattr(torch.cpu, '_is_amx_tile_supported', raising=False, value=lambda: amx)
    monkeypatch.setattr(torch.cpu, '_is_amx_fp16_supported', raising=False, value=lambda: amx_fp16)
    monkeypatch.setattr(mpcallbacks.cast, '_warned', set(), raising=False) # the warning is once per process: start afresh

def speed_warnings(dtype) -> list:
    learn = synth_learner().to_mixed(dtype)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        learn.fit(1, 1e-3)
    return [str(w.message) for w in ws if 'emulated' in str(w.message) or 'faster' in str(w.message)]

@pytest.mark.parametrize('cpu', list(CPUS))
def test_cpu_speed_warning_follows_the_cpu_capability(monkeypatch, cpu):
    (capability, bf16, amx, amx_fp16), expected = CPUS[cpu]
    fake_cpu(monkeypatch, capability, bf16, amx, amx_fp16)
    for dtype, warns in zip((torch.bfloat16, torch.float16), expected):
        got = speed_warnings(dtype)
        assert bool(got) == warns, f"{cpu}: {dtype} {'should' if warns else 'should not'} warn; got {got}"
        name = str(dtype).split('.')[1]
        assert all(name in m for m in got), f"the warning does not name {name}: {got}"
        other, other_emulated = (('float16', expected[1]) if dtype == torch.bfloat16 else ('bfloat16', expected[0]))
        if other_emulated:
            assert not any(f'to_mixed(torch.{other})' in m for m in got), f"{cpu}: recommends the emulated {other}: {got}"

def test_this_machine_warns_by_the_same_rule():
    "Unpatched: what torch reports here decides, by the rule above"
    cap = torch.backends.cpu.get_cpu_capability()
    has = lambda f: bool(getattr(torch.cpu, f'_is_{f}_supported', lambda: False)()) # torch 2.4 has none of these: emulated
    bf16_native = has('avx512_bf16') or has('amx_tile')
    fp16_native = has('amx_fp16')
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mpcallbacks.cast, '_warned', set(), raising=False)
        assert bool(speed_warnings(torch.bfloat16)) == (not bf16_native), f"capability {cap}"
        assert bool(speed_warnings(torch.float16)) == (not fp16_native), f"capability {cap}"

def test_the_speed_warning_points_at_the_users_call(monkeypatch):
    "The warning names the line of the user's `fit`, not a line of fastai's callback dispatch"
    monkeypatch.setattr(mpcallbacks.cast, 'native_16bit_dtypes', lambda device: set()) # a CPU that emulates both types
    monkeypatch.setattr(mpcallbacks.cast, '_warned', set())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        synth_learner().to_mixed(torch.bfloat16).fit(1)
    emulated = [x for x in w if 'emulated' in str(x.message)]
    assert len(emulated) == 1 and emulated[0].filename == __file__, [(x.filename, x.lineno) for x in emulated]

def test_keep_fp32_refuses_a_type_that_is_no_module():
    with pytest.raises(TypeError, match='subclasses of nn.Module'): synth_learner().to_mixed(torch.bfloat16, keep_fp32=[int])
