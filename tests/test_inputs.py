"The input cast keeps every container type intact: namedtuples (two fields and one), PackedSequence into an RNN, OrderedDict subclasses."
from collections import namedtuple, OrderedDict
import pytest, torch
from torch import nn, Tensor
from torch.nn.utils.rnn import pack_padded_sequence, PackedSequence
from fastai.basics import Learner, Callback, CrossEntropyLossFlat
from fastai.learner import CastToTensor
from fastai.callback.progress import ProgressCallback
from mpcallbacks.all import cast_model
from mpcallbacks.test_utils import synth_dls
from intact import assert_fp32_and_intact, hook_ids, call_lock_free

Pair = namedtuple('Pair', 'x mask')
Single = namedtuple('Single', 'x')
class Features(OrderedDict): "An OrderedDict subclass, as some libraries return"

def lengths(bs): return 8 - torch.arange(bs) % 5

containers = {
    'namedtuple2': lambda x: Pair(x, torch.ones(x.shape[0], 2)),
    'namedtuple1': lambda x: Single(x),
    'PackedSequence': lambda x: pack_padded_sequence(x[:, 0], lengths(x.shape[0]), batch_first=True, enforce_sorted=False),
    'OrderedDict_subclass': lambda x: Features(x=x),
}

class Reader(nn.Module):
    "Takes one container and records what it received: kept in FP32, its inputs are cast to FP32 on the way in"
    def __init__(self, kind):
        super().__init__(); self.kind, self.seen = kind, []
        self.gain = nn.Parameter(torch.ones(()))
    def forward(self, inp):
        self.seen.append(inp)
        del self.seen[:-1] # the last input is enough
        if self.kind == 'namedtuple2': return inp.x.flatten(1) * inp.mask.sum(1, keepdim=True) * self.gain
        if self.kind == 'namedtuple1': return inp.x.flatten(1) * self.gain
        if self.kind == 'OrderedDict_subclass': return inp['x'].flatten(1) * self.gain
        return inp.data.sum() * self.gain

class Net(nn.Module):
    "A kept reader of the container, or for a `PackedSequence` an LSTM (its inputs cast to 16 bits), then a linear layer"
    def __init__(self, kind):
        super().__init__(); self.kind = kind
        if kind == 'PackedSequence': self.lstm = nn.LSTM(8, 16, batch_first=True)
        else: self.reader = Reader(kind)
        self.lin = nn.Linear(16 if kind == 'PackedSequence' else 64, 2)
        self.seen = []
        if kind == 'PackedSequence': self.lstm.register_forward_hook(lambda m, args, out: self.seen.append(args[0]))
        else: self.reader.register_forward_hook(lambda m, args, out: self.seen.append(m.seen[-1]))
    def forward(self, inp):
        if self.kind != 'PackedSequence': return self.lin(self.reader(inp))
        _, (h, _) = self.lstm(inp)
        return self.lin(h[-1])

def received_dtype(kind): return torch.bfloat16 if kind == 'PackedSequence' else torch.float32 # (the LSTM's cast, or the kept reader's)
keep = ('reader',)

def floats(inp):
    if isinstance(inp, PackedSequence): return [inp.data]
    return list(inp.values()) if isinstance(inp, dict) else list(inp)

def assert_received(inp, sent, dtype):
    assert type(inp) is type(sent), f"the model received {type(inp).__name__}, not {type(sent).__name__}"
    assert all(isinstance(t, Tensor) and t.dtype == dtype for t in floats(inp)), [(type(t), getattr(t, 'dtype', None)) for t in floats(inp)]
    if isinstance(sent, PackedSequence):
        assert inp.batch_sizes.dtype == torch.int64 and torch.equal(inp.batch_sizes, sent.batch_sizes)
        assert torch.equal(inp.sorted_indices, sent.sorted_indices) and torch.equal(inp.unsorted_indices, sent.unsorted_indices)
    if isinstance(sent, dict): assert list(inp) == list(sent)

@pytest.mark.parametrize('kind', containers)
def test_cast_model_passes_the_container_type_through(kind):
    "A hooked module gets the container it was sent, its tensors cast: 16-bit ones to FP32 for a kept module, FP32 ones to 16 bits for an LSTM"
    torch.manual_seed(0)
    model = Net(kind)
    x = torch.randn(4, 1, 8, 8)
    sent = containers[kind](x if kind == 'PackedSequence' else x.bfloat16())
    if kind == 'namedtuple2': sent = Pair(sent.x, sent.mask.bfloat16())
    cast = cast_model(model, torch.bfloat16, (nn.LayerNorm,) + (() if kind == 'PackedSequence' else keep))
    cast.begin() # a region, as the callback opens one for a batch
    out = model(sent)
    cast.end()
    assert out.dtype == torch.bfloat16
    assert_received(model.seen[-1], sent, received_dtype(kind))
    cast.restore()
    assert {p.dtype for p in model.parameters()} == {torch.float32}

class MakeContainer(Callback):
    order = CastToTensor.order + 0.5 # fastai's CastToTensor turns any tuple into a plain tuple: build the container after it
    def __init__(self, kind): self.kind = kind
    def before_batch(self): self.learn.xb = (containers[self.kind](self.xb[0]),)

class CheckReceived(Callback):
    "The container reaches the hooked module intact during training"
    def __init__(self, kind): self.kind, self.checked = kind, 0
    def after_pred(self):
        if not self.training: return
        assert_received(self.model.seen[-1], self.xb[0], received_dtype(self.kind))
        self.checked += 1

@pytest.mark.parametrize('kind', containers)
def test_fit_with_container_inputs(kind):
    torch.manual_seed(0)
    learn = Learner(synth_dls(), Net(kind), loss_func=CrossEntropyLossFlat(), cbs=MakeContainer(kind))
    learn.to_mixed(torch.bfloat16, keep_fp32=() if kind == 'PackedSequence' else keep)
    learn.remove_cb(ProgressCallback)
    hooks = hook_ids(learn.model)
    check = CheckReceived(kind)
    call_lock_free(learn.fit, 1, 1e-2, cbs=check)
    assert check.checked == 8
    assert_fp32_and_intact(learn, hooks)

# ---- outputs: the loss function gets the model's own container, its tensors in FP32

Out = namedtuple('Out', 'logits aux')
class ModelOutput(OrderedDict):
    "As Hugging Face's: an OrderedDict whose keys are attributes too"
    def __getattr__(self, k):
        try: return self[k]
        except KeyError: raise AttributeError(k) from None

outputs = {'namedtuple': lambda logits, aux: Out(logits, aux), 'ModelOutput': lambda logits, aux: ModelOutput(logits=logits, aux=aux)}

class OutNet(nn.Module):
    def __init__(self, kind): super().__init__(); self.kind,self.lin = kind,nn.Linear(64, 2)
    def forward(self, x):
        logits = self.lin(x.flatten(1))
        return outputs[self.kind](logits, logits.sum(1))

class OutLoss:
    "Reads the output by attribute, as such losses do, and records what it was handed"
    def __init__(self): self.seen = set()
    def __call__(self, out, y):
        self.seen.add((type(out).__name__, out.logits.dtype, out.aux.dtype))
        return nn.functional.cross_entropy(out.logits, y) + 0. * out.aux.mean()

@pytest.mark.parametrize('kind', outputs)
def test_fit_with_a_container_output(kind):
    def fit(mixed):
        torch.manual_seed(0)
        loss = OutLoss()
        learn = Learner(synth_dls(), OutNet(kind), loss_func=loss)
        learn.remove_cb(ProgressCallback)
        if mixed: learn.to_mixed(torch.bfloat16)
        call_lock_free(learn.fit, 1, 1e-2)
        return learn, loss
    ref, ref_loss = fit(False)
    learn, loss = fit(True)
    assert loss.seen == ref_loss.seen == {(type(outputs[kind](torch.zeros(1), torch.zeros(1))).__name__, torch.float32, torch.float32)}
    torch.testing.assert_close(learn.model.lin.weight, ref.model.lin.weight, rtol=0.05, atol=0.02)
    assert_fp32_and_intact(learn)
