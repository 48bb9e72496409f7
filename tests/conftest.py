import warnings
import pytest, torch
from fastai.basics import *
from fastai.callback.schedule import *
from fastai.callback.progress import ProgressCallback
from mpcallbacks.all import *

warnings.filterwarnings('ignore', message='float16 math is emulated')
torch.set_num_threads(1) # tiny ops: one thread is faster and results do not depend on the thread count

def synth_dls(n=320, bs=32, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(n, 1, 8, 8)
    y = (x[:, 0, :4].mean((1, 2)) > 0).long()
    ds = list(zip(x, y))
    set_seed(seed)
    return DataLoaders.from_dsets(ds[:256], ds[256:], bs=bs, num_workers=0, device='cpu')

def synth_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8*8*8, 2))

def synth_learner(seed=0, **kwargs):
    "A small CNN with BatchNorm on a two-class problem: fast enough for float16 on a CPU"
    learn = Learner(synth_dls(seed=seed), synth_model(seed), loss_func=CrossEntropyLossFlat(), metrics=accuracy, **kwargs)
    learn.remove_cb(ProgressCallback)
    return learn

def opt_params(learn): return [p for pg in learn.opt.param_lists for p in pg]

class InjectNonFinite(Callback):
    "Put an inf (or NaN) into one 16-bit gradient at the chosen optimizer steps, before the mixed-precision callback runs"
    order = MasterMixedPrecision.order - 1
    def __init__(self, at, value=float('inf')): self.at,self.value,self.step = set(at),value,0
    def before_step(self):
        if self.step in self.at: next(p for p in self.model.parameters() if p.grad is not None).grad.view(-1)[0] = self.value
        self.step += 1
