"Hooks registered once: only the modules autocast cannot serve hold hooks of ours, from the fit's start to its end; none is registered or removed while it runs, none is global, and a forward that raises leaves them as they were."
import pytest, torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle
from fastai.basics import Callback, Learner, CrossEntropyLossFlat
from mpcallbacks.all import *
from mpcallbacks.cast import cast_model
from mpcallbacks.test_utils import synth_dls
from intact import assert_fp32_and_intact, hook_ids

def global_hooks() -> int:
    "How many global forward hooks torch runs at every module call of the process"
    return len(torch_module._global_forward_pre_hooks) + len(torch_module._global_forward_hooks)

class Probe(nn.Module):
    "Passes its input on, and records at each call the input's dtype and `look()`"
    def __init__(self, look=lambda: None):
        super().__init__()
        self.look,self.seen = look,[]
    def forward(self, x):
        self.seen.append((x.dtype, self.look()))
        return x

def learner(middle:nn.Module, keep=('6',)) -> Learner:
    "`synth_model` with `middle` after its ReLU and a hidden layer, its head kept in FP32 (hooked), on `synth_dls`, quiet"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), middle, nn.Flatten(), nn.Linear(8*8*8, 16), nn.Linear(16, 2))
    learn = Learner(synth_dls(), model, loss_func=CrossEntropyLossFlat())
    learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ == 'ProgressCallback'])
    return learn.to_mixed(torch.bfloat16, keep_fp32=keep)

class Registrations(Callback):
    "Module hooks registered or removed, anywhere, between the fit's first batch and its end; the hooks on the model during the fit"
    order = MasterMixedPrecision.order + 1
    def __init__(self): self.made,self.removed,self.hooked = 0,0,None
    def before_batch(self):
        if self.hooked is not None: return
        self.hooked = {n for n,m in self.learn.model.named_modules() if m._forward_pre_hooks or m._forward_hooks}
        init,remove = RemovableHandle.__init__,RemovableHandle.remove
        def counted_init(h, *args, **kwargs): self.made += 1; init(h, *args, **kwargs)
        def counted_remove(h): self.removed += 1; remove(h)
        RemovableHandle.__init__,RemovableHandle.remove,self.undo = counted_init,counted_remove,(init, remove)
    def after_epoch(self):
        if self.epoch == self.n_epoch - 1: RemovableHandle.__init__,RemovableHandle.remove = self.undo

def test_no_hook_is_registered_or_removed_while_a_fit_runs():
    "Two epochs, training and validation: the kept head's hooks, registered at the fit's start, are the only ones, all along; none global"
    learn,reg = learner(nn.Identity()),Registrations()
    before = global_hooks()
    learn.fit(2, 1e-2, cbs=reg)
    assert (reg.made, reg.removed) == (0, 0)
    assert reg.hooked == {'6'}
    assert global_hooks() == before
    assert_fp32_and_intact(learn)

def test_inside_a_forward_the_modules_autocast_serves_run_torchs_fast_path():
    "A model with nothing kept has no hook of ours at all: every module runs torch's own call"
    probe = Probe()
    learn,reg = learner(probe, keep=()),Registrations()
    learn.fit(1, 1e-2, cbs=reg)
    assert reg.hooked == set()
    assert len(probe.seen) == len(learn.dls.train) + len(learn.dls.valid)
    assert {dt for dt,_ in probe.seen} == {torch.bfloat16} # (the conv's 16-bit output, through the FP32 BatchNorm)
    assert_fp32_and_intact(learn)

class CallTheHead(Callback):
    "Calls the model's hidden Linear on its own between the forward and the backward: its output dtype then"
    order = MasterMixedPrecision.order + 1
    def __init__(self): self.seen = []
    def after_loss(self):
        if self.training: self.seen.append(self.learn.model[5](torch.randn(2, 8*8*8)).dtype)

def test_a_layer_called_on_its_own_outside_the_forward_runs_in_fp32():
    learn,call = learner(nn.Identity()),CallTheHead()
    learn.fit(1, 1e-2, cbs=call)
    assert call.seen and set(call.seen) == {torch.float32}
    assert_fp32_and_intact(learn)

def test_a_cast_model_called_inside_another_cast_models_forward_runs_in_16_bits():
    "A second model called inside the first's region runs under its autocast: its Linear on the FP32 master, computed in 16 bits"
    inner = nn.Sequential(nn.Linear(4, 4))
    inner.append(Probe(lambda: inner[0].weight.dtype))
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
        def forward(self, x): return inner(self.fc(x))
    outer = Outer()
    a,b = cast_model(outer, torch.bfloat16),cast_model(inner, torch.bfloat16)
    a.begin()
    try: out = outer(torch.randn(2, 4))
    finally: a.restore(); b.restore()
    assert out.dtype == torch.bfloat16
    assert inner[1].seen == [(torch.bfloat16, torch.float32)] # (the master in the slot; autocast cast it in the op)
    assert not torch.is_autocast_enabled('cpu') and {p.dtype for p in [*outer.parameters(), *inner.parameters()]} == {torch.float32}

class Raises(nn.Module):
    "Raises `exc` at its `at`-th call"
    def __init__(self, exc, at:int=3):
        super().__init__()
        self.exc,self.at,self.calls = exc,at,0
    def forward(self, x):
        self.calls += 1
        if self.calls == self.at: raise self.exc
        return x

@pytest.mark.parametrize('exc', [RuntimeError('boom'), KeyboardInterrupt()], ids=['error', 'ctrl-c'])
def test_a_forward_that_raises_leaves_the_hooks_as_they_were(exc):
    "An error (torch runs `always_call` hooks) or a Ctrl-C (it does not) inside the forward: the fit raises it as it was, and no hook of ours stays"
    learn = learner(Raises(exc))
    seen = []
    handle = learn.model.register_forward_hook(lambda m, args, out: seen.append(getattr(out, 'dtype', None)), always_call=True) # (a user's, on the outermost module)
    hooks,before = hook_ids(learn.model),global_hooks()
    with pytest.raises(type(exc)) as e: learn.fit(1, 1e-2)
    assert e.value is exc
    assert global_hooks() == before
    assert_fp32_and_intact(learn, hooks)
    assert len(seen) > 2 and seen[:2] == [torch.float32] * 2 and handle.id in learn.model._forward_hooks # (the user's hook ran on the FP32 head's output, and stays)

def test_a_compiled_model_is_not_recompiled_at_each_step():
    "The hooks are registered once, before the first forward: dynamo, which guards a compiled model on its hooks, compiles it once for training and once for validation"
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    learn = learner(nn.Identity())
    learn.model = torch.compile(learn.model, backend='eager')
    learn.fit(2, 1e-2)
    assert counters['stats']['unique_graphs'] <= 4, dict(counters['stats'])
    assert_fp32_and_intact(learn, fit=False)

def test_a_forward_after_one_that_raised_runs_as_any_other():
    "A forward that raised, its error caught by the caller: the region stays open, the kept module's hook undid its call, and the next forward runs as any other"
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), Raises(RuntimeError('boom'), at=1), nn.Linear(4, 2))
    hooks = hook_ids(model)
    mc = cast_model(model, torch.bfloat16, (nn.LayerNorm, '3'))
    mc.begin()
    try:
        with pytest.raises(RuntimeError, match='boom'): model(torch.randn(3, 4))
        assert torch.is_autocast_enabled('cpu') and mc.casting
        out = model(torch.randn(3, 4))
        assert out.dtype == torch.float32 and model[0](torch.randn(3, 4)).dtype == torch.bfloat16 # (the kept head: FP32)
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    finally: mc.restore()
    assert hook_ids(model) == hooks and not torch.is_autocast_enabled('cpu')

class WithReplica(nn.Module):
    "Calls a replica of its kept layer as `nn.DataParallel` makes them: a shallow copy sharing the layer's hook dictionaries"
    def __init__(self):
        super().__init__()
        self.fc,self.head = nn.Linear(4, 4),nn.Linear(4, 2)
        r = self.fc._replicate_for_data_parallel()
        r._parameters = {'weight': self.fc.weight, 'bias': self.fc.bias} # (what `replicate` gives it: the tensors, not the slots)
        self.replicas = [r] # (not a submodule)
    def forward(self, x): return self.head(self.replicas[0](self.fc(x)))

def test_a_replica_sharing_a_layers_hooks_is_left_alone():
    "The hooks on a kept layer also sit in its replica's dictionaries: they leave the replica alone"
    model = WithReplica()
    assert model.replicas[0]._forward_pre_hooks is model.fc._forward_pre_hooks
    hooks = hook_ids(model)
    mc = cast_model(model, torch.bfloat16, ('fc',))
    mc.begin()
    try: out = model(torch.randn(3, 4))
    finally: mc.restore()
    assert out.dtype == torch.bfloat16 and hook_ids(model) == hooks and not model.replicas[0]._forward_pre_hooks
