"The invariant every path must keep: after any call returns or raises, the learner holds an FP32 model that its optimizer steps, no hook of ours, no lock, and the next fit trains every layer."
import torch
from fastai.basics import Callback, Learner
from mpcallbacks.test_utils import opt_params

def hook_ids(model) -> dict:
    "Each submodule's forward and forward-pre hook ids: compare before and after to find hooks left behind"
    return {n:(list(m._forward_pre_hooks), list(m._forward_hooks)) for n,m in model.named_modules()}

def call_lock_free(f, *args, **kwargs):
    """Call `f` in the test's own thread, once its learner's `lock` is seen free: fastai's `validate` and `get_preds` take
    that lock, so a call made while a failed path still holds it would wait forever instead of failing. A hang of any
    other kind is caught by pytest-timeout (pyproject.toml), which fails the test with every thread's stack."""
    learn = next((o for o in (getattr(f, '__self__', None), *args[:1]) if isinstance(o, Learner)), None)
    assert learn is not None, f"`{getattr(f, '__name__', f)}` is neither a Learner's method nor called with a Learner first"
    assert learn.lock.acquire(blocking=False), "learn.lock is held: this call would wait for it forever"
    learn.lock.release()
    return f(*args, **kwargs)

def split_params(learn) -> list:
    "What `learn.create_opt` gives the optimizer: the splitter's parameters, flattened"
    groups = learn.splitter(learn.model)
    groups = [groups] if isinstance(next(iter(groups), None), torch.Tensor) else groups
    return [p for g in groups for p in g]

def not_fp32(model) -> list:
    "Names of the floating-point parameters and buffers of `model` that are not float32"
    return [n for n,t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
            if t.is_floating_point() and t.dtype != torch.float32]

def assert_at_rest(learn, hooks=None):
    "FP32 model, optimizer on the model's own tensors, no leftover hook, lock free"
    bad = not_fp32(learn.model)
    assert not bad, f"tensors left in 16 bits: {bad}"
    if getattr(learn, 'opt', None) is not None:
        got, want = opt_params(learn), split_params(learn)
        assert len(got) == len(want) and all(a is b for a, b in zip(got, want)), \
            "the optimizer does not step the model's own parameters"
    got = list(learn.parameters()) # fastai forwards this to the model (GradientClip reads it)
    want = list(learn.model.parameters())
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want)), "learn.parameters() is not the model's"
    now = hook_ids(learn.model)
    before = hooks if hooks is not None else {n:([], []) for n in now}
    left = {n:h for n,h in now.items() if h != before.get(n, ([], []))}
    assert not left, f"hooks left on {sorted(left)}"
    from mpcallbacks.cast import cast_holding
    ours = [m for m in learn.model.modules() if cast_holding(m) is not None]
    assert not ours, f"modules left in a registered cast: {[type(m).__name__ for m in ours][:3]}"
    on = [d for d in ('cpu', 'cuda') if torch.is_autocast_enabled(d)]
    assert not on, f"autocast left on for {on}"
    assert learn.lock.acquire(blocking=False), "learn.lock is still held: the next get_preds/validate would hang"
    learn.lock.release()

def assert_fp32_and_intact(learn, hooks=None, fit=True, lr=1e-3):
    "`assert_at_rest`, then the next `fit(1)` moves every trainable parameter and leaves the learner at rest again"
    assert_at_rest(learn, hooks)
    if not fit: return
    before = [(n, p.detach().clone()) for n,p in learn.model.named_parameters() if p.requires_grad]
    call_lock_free(learn.fit, 1, lr)
    now = dict(learn.model.named_parameters())
    still = [n for n,p0 in before if torch.equal(p0, now[n].detach().float())]
    assert not still, f"the next fit did not train {still}"
    assert all(torch.isfinite(p).all() for p in learn.model.parameters()), "the next fit gave non-finite weights"
    assert_at_rest(learn, hooks)

def moved(before, after) -> bool:
    "Whether a weight changed by more than rounding it to 16 bits could explain"
    return not torch.allclose(before.float(), after.detach().float(), rtol=2**-7, atol=1e-7)

class RaiseOnce(Callback):
    "Raise `exc` the first time `event` fires (then never again, so the learner stays usable)"
    def __init__(self, event, exc, order=None):
        self.exc, self.done = exc, False
        if order is not None: self.order = order
        setattr(self, event, self._raise)
    def _raise(self):
        if self.done: return
        self.done = True
        raise self.exc

class ForwardDtypes(Callback):
    "Inside the forward, by name: the dtypes of each module's own parameters and buffers in their slots (`seen`), and of its output (`outs`, what it computed in)"
    order = 50
    def __init__(self): self.seen,self.outs = {},{}
    def before_fit(self):
        def look(name):
            def f(m, args):
                for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
                    self.seen.setdefault(f'{name}.{n}' if name else n, set()).add(t.dtype)
            return f
        def out(name):
            def f(m, args, o):
                if isinstance(o, torch.Tensor) and o.is_floating_point(): self.outs.setdefault(name, set()).add(o.dtype)
            return f
        ms = [(n, m) for n, m in self.learn.model.named_modules() if n]
        self.handles = [m.register_forward_pre_hook(look(n)) for n, m in ms] + [m.register_forward_hook(out(n)) for n, m in ms]
    def after_fit(self):
        for h in self.handles: h.remove()
