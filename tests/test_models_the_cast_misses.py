"""Models whose code reaches past the module calls the cast hooks see: a checkpointed method that reads a parameter
directly, `torch.func.functional_call` with parameters of its own, tensors passed by keyword, a tensor made with the
dtype of the model's first parameter (a normalization layer's), and TorchScript. Each trains as in FP32, or is refused
at `to_mixed()` with a remedy that works."""
import pytest, torch
from torch import nn
from torch.func import functional_call, vmap, grad
from torch.utils.checkpoint import checkpoint
from fastai.basics import Learner, DataLoaders, CrossEntropyLossFlat, Callback
from like_fp32 import fit_once, assert_like_fp32, quiet
from intact import assert_fp32_and_intact, not_fp32

D = 16
BF16 = dict(dtype=torch.bfloat16)

def make_learner(model_cls, n=256, seq=False):
    def make():
        x = torch.randn(n, D)
        y = ((x[:, 0] + x[:, 1]) > 0).long()
        if seq: x = x[:, None].expand(-1, 4, -1).contiguous()
        ds = list(zip(x, y))
        dls = DataLoaders.from_dsets(ds[:n*3//4], ds[n*3//4:], bs=16, num_workers=0, device='cpu')
        return Learner(dls, model_cls(), loss_func=CrossEntropyLossFlat())
    return make

# ---- torch.utils.checkpoint of a method that reads a parameter directly: the recompute in the backward reads the casts

class CheckpointedLayerScale(nn.Module):
    "A residual body with a layer-scale `gamma`, checkpointed as a method: `gamma` is read outside any module call"
    def __init__(self, reentrant=False):
        super().__init__()
        self.stem,self.lin,self.head,self.reentrant = nn.Linear(D, D),nn.Linear(D, D),nn.Linear(D, 2),reentrant
        self.gamma = nn.Parameter(torch.full((D,), 0.5))
    def _body(self, x): return self.gamma * torch.relu(self.lin(x))
    def forward(self, x):
        x = self.stem(x) # (reentrant checkpointing gives gradients only through an input that needs them)
        return self.head(x + checkpoint(self._body, x, use_reentrant=self.reentrant))

class CheckpointedMatmul(CheckpointedLayerScale):
    "The checkpointed method multiplies by a parameter of its own: a matmul with no module call around it"
    def __init__(self, reentrant=False):
        super().__init__(reentrant)
        self.w = nn.Parameter(torch.randn(D, D) * 0.2)
    def _body(self, x): return torch.relu(self.lin(x) @ self.w) * self.gamma

class ParamsAreMasters(Callback):
    "Every parameter is its FP32 master at each event around the backward, whatever the callback's order"
    def __init__(self, order): self.order,self.seen = order,[]
    def _look(self): self.seen += [n for n in not_fp32(self.learn.model)]
    before_backward = after_backward = before_step = after_batch = _look

CHECKPOINTED = [CheckpointedLayerScale, CheckpointedMatmul]

@pytest.mark.parametrize('reentrant', [False, True], ids=['non_reentrant', 'reentrant'])
@pytest.mark.parametrize('model_cls', CHECKPOINTED, ids=[m.__name__ for m in CHECKPOINTED])
def test_a_checkpointed_method_reading_a_parameter_trains_as_in_fp32(model_cls, reentrant):
    make = make_learner(lambda: model_cls(reentrant))
    looks = [ParamsAreMasters(0), ParamsAreMasters(20)]
    ref = fit_once(make, None, 2, 1e-2)
    mix = fit_once(make, BF16, 2, 1e-2, cbs=looks)
    assert_like_fp32(ref, mix, loss_rtol=0.03, cos_min=0.95)
    assert not [n for cb in looks for n in cb.seen], "a parameter was not its FP32 master outside the forward and backward"
    assert_fp32_and_intact(mix.learn)

class CheckpointedLarge(nn.Module):
    "The checkpointed method reads large weights (65,536 elements: each cast an autograd node of its own, freed as the backward makes its gradient)"
    def __init__(self, reentrant=False):
        super().__init__()
        W = 256
        self.stem,self.lin,self.head,self.reentrant = nn.Linear(D, W),nn.Linear(W, W),nn.Linear(W, 2),reentrant
        self.w = nn.Parameter(torch.randn(W, W) * W**-0.5)
    def _body(self, x): return torch.relu(self.lin(x) @ self.w)
    def forward(self, x):
        x = self.stem(x)
        return self.head(x + checkpoint(self._body, x, use_reentrant=self.reentrant))

@pytest.mark.parametrize('reentrant', [False, True], ids=['non_reentrant', 'reentrant'])
def test_a_checkpointed_method_reading_large_weights_trains_as_in_fp32(reentrant):
    make = make_learner(lambda: CheckpointedLarge(reentrant))
    ref = fit_once(make, None, 2, 3e-3) # (at 1e-2 this model's FP32 and bfloat16 fits part ways, checkpointed or not)
    looks = [ParamsAreMasters(0), ParamsAreMasters(20)]
    mix = fit_once(make, BF16, 2, 3e-3, cbs=looks)
    assert_like_fp32(ref, mix, loss_rtol=0.03, cos_min=0.95)
    assert not [n for cb in looks for n in cb.seen], "a parameter was not its FP32 master outside the forward and backward"
    assert_fp32_and_intact(mix.learn)

# ---- torch.func.functional_call uses the parameters it is given

def mlp(): return nn.Sequential(nn.Linear(D, 32), nn.ReLU(), nn.Linear(32, 2))

class CallWith(Callback):
    "At the first training batch's `after_pred` and the first validation batch: the model called on all-zero parameters, and per-sample gradients"
    order = 50
    def __init__(self): self.zero_out,self.per_sample = {},None
    def after_pred(self):
        m,x = self.learn.model,self.xb[0]
        phase = 'train' if self.training else 'valid'
        if phase in self.zero_out: return
        zeros = {k:torch.zeros_like(v) for k,v in m.named_parameters()}
        self.zero_out[phase] = functional_call(m, zeros, (x,)).abs().max().item()
        if not self.training: return
        params = {k:v.detach() for k,v in m.named_parameters()}
        def loss(p, xi, yi): return nn.functional.cross_entropy(functional_call(m, p, (xi[None],)).float(), yi[None])
        self.per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, self.yb[0])

def test_functional_call_uses_the_parameters_it_is_given():
    "All-zero parameters give an output of 0 in a training batch and in a validation pass; per-sample gradients are FP32's"
    ref,mix = CallWith(),CallWith()
    fit_once(make_learner(mlp), None, 1, 1e-2, cbs=[ref])
    run = fit_once(make_learner(mlp), BF16, 1, 1e-2, cbs=[mix])
    assert mix.zero_out == {'train': 0., 'valid': 0.}, mix.zero_out
    for k,g in ref.per_sample.items():
        assert g.dtype == mix.per_sample[k].dtype == torch.float32
        rel = ((mix.per_sample[k] - g).norm() / g.norm()).item()
        assert rel < 0.05, f"per-sample gradients of {k}: {rel:.3f} of FP32's norm apart"
    assert_fp32_and_intact(run.learn)

# ---- tensors passed by keyword are cast as positional ones

class LSTMWithKeywordState(nn.Module):
    "The initial state is made with `torch.zeros` and passed as `hx=`"
    def __init__(self):
        super().__init__()
        self.lstm,self.head = nn.LSTM(D, 32, batch_first=True),nn.Linear(32, 2)
    def forward(self, x):
        h0 = torch.zeros(1, x.shape[0], 32)
        out,_ = self.lstm(x, hx=(h0, torch.zeros_like(h0)))
        return self.head(out[:, -1])

class LinearByKeyword(nn.Module):
    "Every layer called with its input by keyword"
    def __init__(self):
        super().__init__()
        self.hidden,self.head = nn.Linear(D, 32),nn.Linear(32, 2)
    def forward(self, x): return self.head(input=torch.relu(self.hidden(input=x)))

@pytest.mark.parametrize('model_cls,seq', [(LSTMWithKeywordState, True), (LinearByKeyword, False)], ids=['lstm_hx', 'linear_input'])
def test_tensors_passed_by_keyword_train_as_in_fp32(model_cls, seq):
    make = make_learner(model_cls, seq=seq)
    ref,mix = fit_once(make, None, 2, 1e-2),fit_once(make, BF16, 2, 1e-2)
    assert_like_fp32(ref, mix, loss_rtol=0.03, cos_min=0.95)
    assert_fp32_and_intact(mix.learn)

# ---- a tensor made with the dtype of the model's first parameter, a normalization layer's (FP32 in the forward)

class DtypeFromFirstParameter(nn.Module):
    "`next(self.parameters()).dtype`, HF's `self.dtype` idiom: FP32 here, whose first parameter is a LayerNorm's"
    def __init__(self):
        super().__init__()
        self.norm,self.lin,self.head = nn.LayerNorm(D),nn.Linear(D, D),nn.Linear(D, 2)
    def forward(self, x):
        mix = torch.eye(D, dtype=next(self.parameters()).dtype) * 0.5 # a fixed mixing matrix, made in the forward
        return self.head(torch.relu(self.lin(self.norm(x))) @ mix + x)

def test_the_model_dtype_idiom_with_a_norm_first_trains_as_in_fp32():
    make = make_learner(DtypeFromFirstParameter)
    ref,mix = fit_once(make, None, 2, 1e-2),fit_once(make, BF16, 2, 1e-2)
    assert_like_fp32(ref, mix, loss_rtol=0.03, cos_min=0.95)

class KeptHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body,self.head = nn.Linear(D, 32),nn.Linear(32, 2)
    def forward(self, x): return self.head(torch.relu(self.body(x)))

def test_a_module_kept_in_fp32_computes_in_fp32_inside_the_16bit_forward():
    "The 16-bit forward's autocast does not reach into a module the user keeps in FP32: its matmul stays FP32"
    learn = quiet(make_learner(KeptHead)()).to_mixed(torch.bfloat16, keep_fp32=['head'])
    seen = {}
    class Look(Callback):
        order = 50
        def before_fit(self):
            def head(m, a, o): seen.setdefault('head', (a[0].dtype, m.weight.dtype, o.dtype))
            def body(m, a, o): seen.setdefault('body', o.dtype)
            self.hs = [self.learn.model.head.register_forward_hook(head), self.learn.model.body.register_forward_hook(body)]
        def after_fit(self): [h.remove() for h in self.hs]
    learn.fit(1, 1e-2, cbs=[Look()])
    assert seen == {'body': torch.bfloat16, 'head': (torch.float32,)*3}, seen

# ---- TorchScript runs no Python hooks: refused at to_mixed, and scripting after training works

def scripted_top(): return torch.jit.script(mlp())
def scripted_layer(): return nn.Sequential(torch.jit.script(nn.Linear(D, 32)), nn.ReLU(), nn.Linear(32, 2))

@pytest.mark.parametrize('make_model,name', [(scripted_top, 'The model'), (scripted_layer, '`0`')], ids=['model', 'layer'])
def test_a_scripted_model_is_refused_at_to_mixed_and_scripting_after_training_works(make_model, name):
    learn = make_learner(make_model)()
    with pytest.raises(ValueError) as e: learn.to_mixed(torch.bfloat16)
    assert f"{name} is TorchScript" in str(e.value) and "script it after training" in str(e.value), str(e.value)
    assert not learn.cbs.filter(lambda cb: type(cb).__name__ == 'MasterMixedPrecision')
    # the remedy: train the Python model mixed, script it afterwards
    learn = quiet(make_learner(mlp)()).to_mixed(torch.bfloat16)
    learn.fit(1, 1e-2)
    x = torch.randn(4, D)
    with torch.no_grad(): test = torch.jit.script(learn.model)(x), learn.model(x)
    assert test[0].dtype == torch.float32 and torch.equal(*test)

# ---- what a callback's forward computes in, by its event and order

@pytest.mark.parametrize('event,order,dtype', [('after_pred', 0, torch.bfloat16), ('after_pred', 20, torch.float32),
                                                ('after_batch', 0, torch.float32), ('after_batch', 20, torch.float32)],
                         ids=['after_pred_before_ours', 'after_pred_after_ours', 'after_batch_before_ours', 'after_batch_after_ours'])
def test_a_callbacks_forward_is_16bit_inside_the_batchs_region_only(event, order, dtype):
    "As the docs say: a batch's region ends at the callback's own `after_pred` (order 10); the parameters are the masters throughout"
    seen = []
    class Sample(Callback):
        def look(self):
            if not self.training: return
            with torch.no_grad(): seen.append((self.learn.model(self.xb[0]).dtype, not_fp32(self.learn.model)))
    s = Sample(); s.order = order
    setattr(s, event, s.look)
    learn = quiet(make_learner(mlp)()).to_mixed(torch.bfloat16)
    learn.fit(1, 1e-2, cbs=[s])
    assert seen and all(o == (dtype, []) for o in seen), seen[:3]

# ---- a backward that raises leaves the masters as they are (they never left their slots)

class RaisesInBackward(nn.Module):
    "The first training backward raises, after the casts were put in for it"
    def __init__(self):
        super().__init__()
        self.lin,self.head,self.raised = nn.Linear(D, 32),nn.Linear(32, 2),False
    def forward(self, x):
        h = self.lin(x)
        if self.training and torch.is_grad_enabled() and not self.raised:
            self.raised = True
            def boom(g):
                self.held = self.lin.weight.dtype # (the backward finds the masters in the slots)
                raise RuntimeError('raised in the backward')
            h.register_hook(boom)
        return self.head(torch.relu(h))

def test_a_backward_that_raises_leaves_the_masters_in_their_slots():
    learn = quiet(make_learner(RaisesInBackward)()).to_mixed(torch.bfloat16)
    with pytest.raises(RuntimeError, match='raised in the backward'): learn.fit(1, 1e-2)
    assert learn.model.held == torch.float32
    assert_fp32_and_intact(learn)
