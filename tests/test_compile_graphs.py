"A compiled model under to_mixed: as many graphs as in FP32, no graph break, no warning of torch's"
import warnings
import pytest, torch
from torch import nn
from torch._dynamo.utils import counters
from fastai.basics import Learner, DataLoaders, CrossEntropyLossFlat, noop
from fastai.data.core import DataLoader
import mpcallbacks.all # noqa: F401
OLD_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14) # see the supported page's limits

pytestmark = pytest.mark.skipif(OLD_TORCH, reason="torch.compile with to_mixed is tested on torch 2.14 and newer") # (under CUDA's rules, as every test)

def dls():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 3, 8, 8, generator=g)
    ds = list(zip(x, (x.mean((1, 2, 3)) > 0).long()))
    return DataLoaders(DataLoader(ds[:64], bs=32, shuffle=True), DataLoader(ds[64:], bs=32))

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.LayerNorm([8, 8, 8]), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))

def graphs(how:str, mixed:bool, keep=None, fits:int=3) -> tuple:
    "Graphs dynamo made, graph breaks, and torch's warnings, over `fits` fits and a get_preds ('eager' backend: the graphs are dynamo's)"
    m = model()
    if how == 'torch.compile': m = torch.compile(m, backend='eager')
    else: m.compile(backend='eager')
    learn = Learner(dls(), m, loss_func=CrossEntropyLossFlat())
    learn.logger = noop
    if mixed: learn.to_mixed(torch.bfloat16, keep_fp32=keep, mixed_inference=True) # (16-bit inference: the validation's graph serves it)
    torch._dynamo.reset(); counters.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for _ in range(fits): learn.fit(1, 1e-3)
        learn.get_preds()
    ours = [str(x.message) for x in w if 'torch' in x.filename and 'emulat' not in str(x.message)]
    return counters['stats']['unique_graphs'], sum(counters['graph_break'].values()), ours

@pytest.mark.parametrize('how,keep', [('torch.compile', None), ('torch.compile', [nn.Linear]), ('module.compile', None)],
                         ids=['torch.compile', 'torch.compile-kept', 'module.compile'])
def test_as_many_graphs_as_fp32(how, keep):
    fp32, mixed = graphs(how, False), graphs(how, True, keep)
    assert fp32[0] == 2 # one for training, one for evaluation
    assert mixed == (fp32[0], 0, []), mixed

def test_module_compile_with_hooked_modules_never_breaks_its_graph():
    # module.compile() traces the hooks of modules kept in FP32 too: their inputs cast without a graph break (a dict's
    # `copy.copy` broke it), and compiles the model once for training and once for evaluation, whatever the fits (torch
    # guarded its graphs on the ids of `always_call` hooks, new at each fit: every fit compiled both again)
    n, breaks, warned = graphs('module.compile', True, [nn.Linear], fits=2)
    assert (breaks, warned) == (0, [])
    assert n == 2 # as in FP32
