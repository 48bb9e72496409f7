"""What the precision doctor used to miss: a parameterless module, or an operation between modules, whose own 16-bit
arithmetic overflows (the doctor keeps what makes the overflow, not only what receives it); a layer that keeping in
FP32 does not bring back within reach of FP32 (the doctor says to train the model in FP32); and a compiled model,
which the measurement must not make compile more graphs."""
import warnings
import pytest, torch
from torch import nn
from torch._dynamo.utils import counters
import mpcallbacks.all # noqa: F401 (`Learner.to_mixed`, `Learner.precision_report`)
from mpcallbacks.test_utils import synth_learner

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

# ---- a compiled model

def graphs_of_a_compiled_fit(keep_fp32) -> int:
    "Graphs dynamo compiled for one fit of a compiled MLP (the eager backend: what dynamo captures, no code generated)"
    torch._dynamo.reset()
    counters.clear()
    learn = synth_learner()
    learn.model = torch.compile(mlp(), backend='eager')
    learn.to_mixed(torch.bfloat16, keep_fp32=keep_fp32).fit(1, 1e-3)
    return counters['stats']['unique_graphs']

@pytest.mark.skipif(not hasattr(torch.compiler, 'set_stance'), reason='torch 2.6 and later run a compiled model eagerly while measured')
def test_auto_on_a_compiled_model_compiles_no_more_graphs():
    plain,auto = graphs_of_a_compiled_fit(()),graphs_of_a_compiled_fit('auto')
    assert plain > 0 and auto == plain, (plain, auto)
    torch._dynamo.reset()
    counters.clear()
    learn = synth_learner()
    learn.model = torch.compile(mlp(), backend='eager')
    rep = learn.precision_report(torch.bfloat16)
    assert counters['stats']['unique_graphs'] == 0 and set(rep.verdict) == {'fine'}, rep
