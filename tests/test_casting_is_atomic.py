"Casting and re-casting either complete or leave the model exactly as it was: a lazy layer, an out-of-memory part way, a Ctrl-C during the re-cast after a mid-fit save."
from contextlib import contextmanager
import pytest, torch
from torch import nn, Tensor
from torch.overrides import TorchFunctionMode
from fastai.basics import Learner, Callback, CrossEntropyLossFlat
from fastai.callback.progress import ProgressCallback
from mpcallbacks.all import cast_model, MasterMixedPrecision
from mpcallbacks.test_utils import synth_dls, synth_learner
from intact import assert_fp32_and_intact, hook_ids, call_lock_free

half_types = (torch.float16, torch.bfloat16)

def tensors(model): return [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]

def snapshot(model):
    "Each parameter and buffer object with a copy of its value, and the hooks"
    lazy = nn.parameter.UninitializedTensorMixin
    return dict(ts=[(n, t, None if isinstance(t, lazy) else t.detach().clone()) for n, t in tensors(model)], hooks=hook_ids(model))

def assert_exactly_as_before(model, snap):
    now = tensors(model)
    assert [n for n, _ in now] == [n for n, _, _ in snap['ts']]
    replaced = [n for (n, t), (_, t0, _) in zip(now, snap['ts']) if t is not t0]
    assert not replaced, f"tensor objects replaced: {replaced}"
    changed = [n for (n, t), (_, _, v) in zip(now, snap['ts']) if v is not None and not torch.equal(t.detach(), v)]
    assert not changed, f"values changed: {changed}"
    in16 = [n for n, t in now if t.dtype in half_types]
    assert not in16, f"16-bit tensors left: {in16}"
    assert hook_ids(model) == snap['hooks'], "hooks left behind"

# ---- a lazy layer after a normal one: refused at to_mixed, naming the parameter, and nothing touched

def test_lazy_parameter_is_refused_at_to_mixed_and_model_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.LazyLinear(2))
    learn = Learner(synth_dls(), model, loss_func=CrossEntropyLossFlat())
    learn.remove_cb(ProgressCallback)
    snap = snapshot(model)
    with pytest.raises(ValueError, match=r'3\.(weight|bias)'): learn.to_mixed(torch.bfloat16)
    assert not any(isinstance(c, MasterMixedPrecision) for c in learn.cbs)
    assert_exactly_as_before(model, snap)
    call_lock_free(learn.fit, 1, 1e-2) # plain fastai trains this model
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}

# ---- out of memory part way through the cast

class OOMTensor(Tensor):
    "A tensor whose every operation that involves a 16-bit tensor or dtype fails as an out-of-memory would, while armed"
    armed = False
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if cls.armed and cls.involves_16bit(args, kwargs): raise RuntimeError('CUDA out of memory (injected)')
        res = super().__torch_function__(func, types, args, kwargs)
        if cls.armed and cls.involves_16bit([res], {}): raise RuntimeError('CUDA out of memory (injected)')
        return res
    @staticmethod
    def involves_16bit(args, kwargs):
        with torch._C.DisableTorchFunctionSubclass():
            flat = [o for a in [*args, *kwargs.values()] for o in (a if isinstance(a, (list, tuple)) else [a])]
            return any((isinstance(o, Tensor) and o.dtype in half_types) or o in half_types for o in flat)

@contextmanager
def out_of_memory():
    OOMTensor.armed = True
    try: yield
    finally: OOMTensor.armed = False

class Scale(nn.Module):
    def __init__(self): super().__init__(); self.register_buffer('s', torch.ones(16))
    def forward(self, x): return x * self.s

def oom_model(where):
    "Layers cast before the fault, the fault (on a parameter or on a buffer), layers after it"
    torch.manual_seed(0)
    m = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), Scale(), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 2))
    if where == 'parameter': m[4].weight = nn.Parameter(OOMTensor(m[4].weight.detach().clone()))
    else: m[2].s = OOMTensor(m[2].s.clone())
    return m

@pytest.mark.parametrize('where', ['parameter', 'buffer'])
def test_cast_model_out_of_memory_part_way_leaves_model_as_before(where):
    model = oom_model(where)
    snap = snapshot(model)
    if where == 'buffer': # buffers are never cast: nothing to run out of memory for, the buffer stays the FP32 object it was
        with out_of_memory(): cast = cast_model(model, torch.bfloat16)
        assert model[2].s is dict((n, t) for n, t, _ in snap['ts'])['2.s'] and model[2].s.dtype == torch.float32
        cast.restore()
    else: # the casts are made at the first forward, every one before any goes in: the fault leaves the masters in
        cast = cast_model(model, torch.bfloat16)
        cast.begin()
        with out_of_memory(), pytest.raises(RuntimeError, match='out of memory'): model(torch.randn(2, 1, 8, 8))
        assert all(a is b for a, b in zip(model.parameters(), [t for _, t, _ in snap['ts'] if isinstance(t, nn.Parameter)]))
        cast.restore()
    assert_exactly_as_before(model, snap)
    assert model(torch.randn(2, 1, 8, 8)).dtype == torch.float32 # a working FP32 model

@pytest.mark.parametrize('where', ['parameter', 'buffer'])
def test_fit_out_of_memory_while_casting_leaves_learner_intact(where):
    model = oom_model(where)
    learn = Learner(synth_dls(), model, loss_func=CrossEntropyLossFlat()).to_mixed(torch.bfloat16)
    learn.remove_cb(ProgressCallback)
    snap = snapshot(model)
    with out_of_memory(), pytest.raises(RuntimeError, match='out of memory'): call_lock_free(learn.fit, 1, 1e-2)
    assert_exactly_as_before(model, snap)
    assert_fp32_and_intact(learn, snap['hooks']) # once memory is there, training works

# ---- Ctrl-C during the re-cast that follows a mid-fit learn.save

class FaultWindow(TorchFunctionMode):
    "Count every torch call (and hook registration) from the end of `torch.save` to the end of `learn.save`; raise KeyboardInterrupt at the k-th"
    def __init__(self, k): super().__init__(); self.k, self.n, self.fired, self.open = k, 0, False, False
    def point(self):
        if not self.open or self.fired: return
        self.n += 1
        if self.n == self.k: self.fired = True; raise KeyboardInterrupt
    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.point()
        return func(*args, **(kwargs or {}))

@pytest.mark.parametrize('k', range(1, 7))
def test_ctrl_c_during_recast_after_mid_fit_save_leaves_learner_intact(tmp_path, monkeypatch, k):
    learn = synth_learner(path=tmp_path).to_mixed(torch.bfloat16)
    hooks = hook_ids(learn.model)
    window = FaultWindow(k)
    real_save = torch.save
    def save(*args, **kwargs):
        real_save(*args, **kwargs)
        window.open = True
    monkeypatch.setattr(torch, 'save', save)
    for name in ('register_forward_pre_hook', 'register_forward_hook'):
        real = getattr(nn.Module, name)
        def register(self, *args, _real=real, **kwargs): window.point(); return _real(self, *args, **kwargs)
        monkeypatch.setattr(nn.Module, name, register)
    class SaveMidFit(Callback):
        order = 90
        def after_epoch(self):
            if self.epoch != 0: return
            with window:
                try: self.learn.save('mid', with_opt=True)
                finally: window.open = False
    try: call_lock_free(learn.fit, 2, 1e-2, cbs=SaveMidFit()); raised = False
    except KeyboardInterrupt: raised = True
    assert raised == window.fired, f"Ctrl-C at window point {k} (fired: {window.fired}) {'was swallowed' if window.fired else 'invented'}"
    monkeypatch.undo()
    assert_fp32_and_intact(learn, hooks)

@pytest.mark.parametrize('exc', [RuntimeError('out of memory'), KeyboardInterrupt()], ids=['error', 'ctrl-c'])
def test_a_fit_whose_masters_cannot_be_built_leaves_learner_intact(exc, monkeypatch):
    "The cast succeeded, then building the rest of the fit's state failed: the cast is undone before the error goes on"
    import mpcallbacks.mixed_fit
    learn = synth_learner().to_mixed(torch.bfloat16)
    snap = snapshot(learn.model)
    def failing(*args, **kwargs): raise exc
    monkeypatch.setattr(mpcallbacks.mixed_fit, 'RankAgreement', failing)
    with pytest.raises(type(exc)): learn.fit(1, 1e-3)
    assert_exactly_as_before(learn.model, snap)
    monkeypatch.undo()
    assert_fp32_and_intact(learn, snap['hooks'])

# ---- a Ctrl-C at the last lines of taking the model: nothing of the cast stays registered

import sys, linecache
from mpcallbacks.cast import cast_holding

def interrupt_at(function:str, line:str):
    "A tracer: a KeyboardInterrupt as `function` reaches its first line that starts with `line` (as a Ctrl-C there)"
    def local(frame, event, arg):
        if event == 'line' and linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip().startswith(line):
            raise KeyboardInterrupt(f'at {line!r}')
        return local
    return lambda frame, event, arg: local if frame.f_code.co_name == function else None

@contextmanager
def traced(tracer):
    sys.settrace(tracer)
    try: yield
    finally: sys.settrace(None)

def test_a_ctrl_c_as_cast_model_returns_leaves_nothing_registered():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.LSTM(4, 4))
    with pytest.raises(KeyboardInterrupt), traced(interrupt_at('cast_model', 'return res')): cast_model(model, torch.bfloat16)
    assert all(cast_holding(m) is None for m in model.modules()) # (it held the model for good: every later fit was refused)
    cast_model(model, torch.bfloat16).restore()

@pytest.mark.parametrize('line', ['always = ', 'self.cast.register()'], ids=['in register', 'before register'])
def test_a_ctrl_c_while_a_fit_takes_the_model_leaves_it_free(line):
    learn = synth_learner().to_mixed(torch.bfloat16, keep_fp32=[nn.Linear])
    function = 'register' if line.startswith('always') else '_cast'
    with pytest.raises(KeyboardInterrupt), traced(interrupt_at(function, line)): learn.fit(1, 1e-3)
    assert all(cast_holding(m) is None for m in learn.model.modules())
    assert_fp32_and_intact(learn)
    learn.fit(1, 1e-3) # (the model is free for the next fit)

def test_a_ctrl_c_before_the_precision_reports_close_leaves_nothing_registered():
    # (at the first line of the `until_done` that closes the probe: its close never started; the report's restore of what
    # it measured lets the probe's cast go)
    def local(frame, event, arg):
        if event == 'line' and frame.f_code.co_name == 'until_done' and frame.f_back.f_code.co_name == '_report' \
           and linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip().startswith('interrupted = None'):
            raise KeyboardInterrupt('as the probe closes')
        return local
    learn = synth_learner().to_mixed(torch.bfloat16)
    with pytest.raises(KeyboardInterrupt), traced(lambda frame, event, arg: local if frame.f_code.co_name == 'until_done' else None):
        learn.precision_report(n_batches=1)
    assert all(cast_holding(m) is None for m in learn.model.modules())
    assert_fp32_and_intact(learn)
