"Inside a forward of a cast model only the modules that act run a hook of ours, the others torch's fast path; between forwards torch's global hooks are back, and cast any module of the model called on its own."
import pytest, torch
from torch import nn
from torch.nn.modules import module as torch_module
from fastai.basics import Callback, Learner, CrossEntropyLossFlat
from mpcallbacks.all import *
from mpcallbacks.cast import cast_model
from mpcallbacks.test_utils import synth_dls
from intact import assert_fp32_and_intact, hook_ids

def global_hooks() -> int:
    "How many global forward hooks torch runs at every module call of the process"
    return len(torch_module._global_forward_pre_hooks) + len(torch_module._global_forward_hooks)

class Probe(nn.Module):
    "Passes its input on, and records at each call the global hooks torch runs, the input's dtype and `look()`"
    def __init__(self, look=lambda: None):
        super().__init__()
        self.look,self.seen = look,[]
    def forward(self, x):
        self.seen.append((global_hooks(), x.dtype, self.look()))
        return x

def learner(middle:nn.Module) -> Learner:
    "`synth_model` with `middle` after its ReLU, on `synth_dls`, quiet"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), middle, nn.Flatten(), nn.Linear(8*8*8, 2))
    learn = Learner(synth_dls(), model, loss_func=CrossEntropyLossFlat())
    learn.remove_cbs([cb for cb in learn.cbs if type(cb).__name__ == 'ProgressCallback'])
    return learn.to_mixed(torch.bfloat16)

def test_inside_a_forward_a_module_with_nothing_to_do_runs_no_hook_of_ours():
    "The training and validation forwards of a fit run the ReLU, a module of the user's and the Linear with no global hook"
    probe = Probe()
    learn = learner(probe)
    before = global_hooks()
    learn.fit(1, 1e-2)
    assert len(probe.seen) == len(learn.dls.train) + len(learn.dls.valid)
    assert {n for n,_,_ in probe.seen} == {before}, "torch ran global hooks inside the forward"
    assert {dt for _,dt,_ in probe.seen} == {torch.bfloat16} # (the conv's 16-bit output, through the FP32 BatchNorm)
    assert global_hooks() == before
    assert_fp32_and_intact(learn)

class CallTheHead(Callback):
    "Calls the model's last Linear on its own between the forward and the backward: its output dtype, the global hooks then"
    order = MasterMixedPrecision.order + 1
    def __init__(self): self.seen = []
    def after_loss(self):
        if self.training: self.seen.append((self.learn.model[-1](torch.randn(2, 8*8*8)).dtype, global_hooks()))

def test_a_layer_called_on_its_own_between_forwards_is_cast():
    learn,call = learner(nn.Identity()),CallTheHead()
    before = global_hooks()
    learn.fit(1, 1e-2, cbs=call)
    assert call.seen and set(call.seen) == {(torch.bfloat16, before + 2)}
    assert_fp32_and_intact(learn)

def test_a_cast_model_called_inside_another_cast_models_forward_is_cast():
    "A second cast model called inside the first's forward: torch's global hooks stay on for it, and it runs on its casts"
    inner = nn.Sequential(nn.Linear(4, 4))
    inner.append(Probe(lambda: inner[0].weight.dtype))
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
        def forward(self, x): return inner(self.fc(x))
    outer = Outer()
    before = global_hooks()
    a,b = cast_model(outer, torch.bfloat16),cast_model(inner, torch.bfloat16)
    a.begin(); b.begin()
    try: out = outer(torch.randn(2, 4))
    finally: a.restore(); b.restore()
    assert out.dtype == torch.bfloat16
    assert inner[1].seen == [(before + 2, torch.bfloat16, torch.bfloat16)] # (the weight the inner model's Linear ran on: its cast)
    assert global_hooks() == before and {p.dtype for p in [*outer.parameters(), *inner.parameters()]} == {torch.float32}

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
    "An error (torch runs `always_call` hooks) or a Ctrl-C (it does not) inside the forward: the fit raises it as it was, and no hook of ours stays, global or on a module"
    learn = learner(Raises(exc))
    seen = []
    handle = learn.model.register_forward_hook(lambda m, args, out: seen.append(getattr(out, 'dtype', None)), always_call=True) # (a user's, on the outermost module)
    hooks,before = hook_ids(learn.model),global_hooks()
    with pytest.raises(type(exc)) as e: learn.fit(1, 1e-2)
    assert e.value is exc # (not an error of torch's hook loop, which a hook removed during it would raise instead)
    assert global_hooks() == before
    assert_fp32_and_intact(learn, hooks)
    assert len(seen) > 2 and seen[:2] == [torch.bfloat16] * 2 and handle.id in learn.model._forward_hooks # (the user's hook ran, and stays)

def test_a_compiled_model_is_not_recompiled_at_each_step():
    "A model wrapped by `torch.compile` keeps torch's global hooks in its forward: dynamo guards on a module's hooks, and hooks registered for each call would recompile it at each step"
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    learn = learner(nn.Identity())
    learn.model = torch.compile(learn.model, backend='eager')
    learn.fit(2, 1e-2)
    assert counters['stats']['unique_graphs'] <= 2, dict(counters['stats']) # (2: the training and the validation forward; 8 with hooks made per call)
    assert_fp32_and_intact(learn, fit=False)

def test_a_forward_after_one_that_raised_runs_as_any_other():
    "A forward that raised, its error caught by the caller: the next one casts once, and ends with the masters back and no hook of ours left"
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), Raises(RuntimeError('boom'), at=1), nn.Linear(4, 2))
    model.register_forward_hook(lambda m, args, out: None, always_call=True) # (a user's, on the outermost module)
    hooks,before = hook_ids(model),global_hooks()
    mc = cast_model(model, torch.bfloat16)
    mc.begin()
    try:
        with pytest.raises(RuntimeError, match='boom'): model(torch.randn(3, 4))
        out = model(torch.randn(3, 4))
        assert out.dtype == torch.bfloat16 and mc.depth == 0
        assert {p.dtype for p in model.parameters()} == {torch.float32} and hook_ids(model) == hooks
    finally: mc.restore()
    assert hook_ids(model) == hooks and global_hooks() == before

class OwnLinear(nn.Linear):
    "A Linear of the user's own type: a module that acts (it keeps its hooks inside a forward)"

class WithReplica(nn.Module):
    "Calls a replica of its own layer as `nn.DataParallel` makes them: a shallow copy sharing the layer's hook dictionaries"
    def __init__(self):
        super().__init__()
        self.fc,self.head = OwnLinear(4, 4),nn.Linear(4, 2)
        r = self.fc._replicate_for_data_parallel()
        r._parameters = {'weight': self.fc.weight, 'bias': self.fc.bias} # (what `replicate` gives it: the tensors, not the slots)
        self.replicas = [r] # (not a submodule)
    def forward(self, x): return self.head(self.replicas[0](self.fc(x)))

def test_a_replica_sharing_a_layers_hooks_is_not_cast_as_the_layer():
    "The hooks a forward puts on a layer also sit in its replica's dictionaries: they leave the replica alone, as the global hooks did"
    model = WithReplica()
    assert model.replicas[0]._forward_pre_hooks is model.fc._forward_pre_hooks
    hooks = hook_ids(model)
    mc = cast_model(model, torch.bfloat16)
    mc.begin()
    try: out = model(torch.randn(3, 4))
    finally: mc.restore()
    assert out.dtype == torch.bfloat16 and hook_ids(model) == hooks and not model.replicas[0]._forward_pre_hooks
