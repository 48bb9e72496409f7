"""One rank of the sharded scenarios that `test_sharded.py` checks: FSDP2 over gloo on CPU, results saved to files.

Run as torchrun would start it (env RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):
    torchrun --nproc_per_node 4 tests/sharded_worker.py OUT_DIR SCENARIO...
`launch` does the same with plain subprocesses, as `distributed_worker.launch` does."""
import copy, datetime, math, os, sys, warnings
from collections import Counter
from functools import partial
from pathlib import Path
warnings.filterwarnings('ignore', message='float16 math is emulated')
warnings.filterwarnings('ignore', message='`torch.jit.script` is deprecated')
import torch, torch.distributed as dist
from torch import nn
from fastai.basics import Learner, Callback, DataLoaders, CrossEntropyLossFlat, SGD, Adam, rank_distrib, noop
from fastai.data.core import Datasets
from fastai.data.transforms import ItemGetter
from fastai.callback.progress import ProgressCallback
from mpcallbacks.all import *
from mpcallbacks.scaler import LossScaler
import distributed_worker as dw

counts = Counter() # calls to `dist.all_reduce` (ours: FSDP2's collectives do not go through it)
_all_reduce = dist.all_reduce

def count_calls():
    def counting(*args, **kwargs):
        counts['all_reduce'] += 1
        return _all_reduce(*args, **kwargs)
    dist.all_reduce = counting

def learner(rank, world, bs, split=True, n_train=64, n_valid=32, opt_func=Adam, cbs=(), **mixed):
    "The MLP on `rank`'s share of the data (`split`), or on all of it (every rank the same batches); mixed if `mixed`"
    items = dw.synth_items(n_train + n_valid)
    share = (lambda its: dw.rank_share(its, bs, rank, world)) if split else (lambda its: its)
    dsets = [Datasets(share(its), [[ItemGetter(0)], [ItemGetter(1)]]) for its in (items[:n_train], items[n_train:])]
    dls = DataLoaders.from_dsets(*dsets, bs=bs, shuffle=False, num_workers=0, device='cpu')
    learn = Learner(dls, dw.mlp(), loss_func=CrossEntropyLossFlat(), opt_func=opt_func, cbs=list(cbs))
    learn.remove_cb(ProgressCallback)
    learn.logger = noop
    return learn.to_mixed(**{'dtype': torch.float16, **mixed}) if mixed else learn

def gathered(learn) -> list:
    "The FP32 masters, gathered (every rank calls it; rank 0 gets the tensors)"
    return [gather_state(p.detach()) for p in learn.model.parameters()]

mixed = dict(dtype=torch.bfloat16, keep_fp32=nn.LayerNorm, loss_scale='dynamic', init_scale=2.**8, growth_interval=3)

class History(Callback):
    "After each training batch: the scale's history length, the all-reduces of ours"
    order = 50
    def before_fit(self): self.batches = []
    def before_batch(self): self.seen = counts['all_reduce']
    def after_batch(self):
        if self.training: self.batches.append(counts['all_reduce'] - self.seen)

class InfInLocalShard(Callback):
    "On rank `rank` only, write an inf into this rank's shard of the first gradient at the chosen steps: only this rank sees it"
    order = MasterMixedPrecision.order - 1
    def __init__(self, at, rank=1): self.at,self.rank,self.i = set(at),rank,0
    def after_backward(self):
        if self.i in self.at and rank_distrib() == self.rank:
            g = next(local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None and local_tensor(p.grad).numel())
            g.view(-1)[0] = math.inf
    def before_step(self): self.i += 1

# ---- the scenarios

def same_data(rank, world, out):
    "Every rank trains on the same batches (bs 16, Adam, 2 epochs), to_sharded before to_mixed: compared with one process"
    learn = learner(rank, world, bs=16, split=False).to_sharded(distribute_data=False).to_mixed(**{'dtype': torch.float16, **mixed})
    hist = History()
    learn.fit(2, 1e-2, cbs=hist)
    return dict(masters=gathered(learn), history=list(learn.master_mixed_precision.scaler.history), all_reduce=hist.batches,
                dtypes=sorted({str(p.dtype) for p in learn.model.parameters()}),
                kinds=sorted({type(p).__name__ for p in learn.model.parameters()}))

def grad_accumulation(rank, world, out):
    "fastai's `GradientAccumulation` (two batches a step) on the same batches everywhere: each backward adds to the sharded gradients"
    from fastai.callback.training import GradientAccumulation
    learn = learner(rank, world, bs=16, split=False, cbs=[GradientAccumulation(n_acc=32)], **mixed).to_sharded(distribute_data=False)
    learn.fit(2, 1e-2)
    return dict(masters=gathered(learn), history=list(learn.master_mixed_precision.scaler.history))

def split_data(rank, world, out):
    "Each rank its share of each batch (bs 8 per rank, plain SGD): compared with one process and bs 8*world"
    learn = learner(rank, world, bs=8, opt_func=SGD, **mixed).to_sharded(distribute_data=False)
    learn.fit(2, 0.1)
    return dict(masters=gathered(learn), history=list(learn.master_mixed_precision.scaler.history))

def inf_on_one_rank(rank, world, out):
    "Rank 1's loss is inf at step 2; an inf lands in rank 1's local gradient shard only at step 5"
    hist = History()
    learn = learner(rank, world, bs=8, n_train=64*world, cbs=[dw.InfLoss(at=[2]), InfInLocalShard(at=[5])], **mixed).to_sharded(distribute_data=False)
    learn.fit(1, 1e-2, cbs=hist)
    return dict(history=list(learn.master_mixed_precision.scaler.history), all_reduce=hist.batches,
                skipped=learn.master_mixed_precision.skipped)

def checkpoint(rank, world, out):
    "Fit, save, fit on (A); load the checkpoint, fit on again (B): B must be A. Then export"
    here = out/f'checkpoint_w{world}'
    learn = learner(rank, world, bs=8, opt_func=partial(Adam, wd=0.01), **mixed).to_sharded(distribute_data=False)
    learn.path = here
    learn.fit(1, 1e-2)
    saved = dict(masters=gathered(learn), scaler=learn.master_mixed_precision.scaler.state_dict())
    learn.save('mid')
    learn.fit(1, 1e-2)
    a = dict(masters=gathered(learn), scaler=learn.master_mixed_precision.scaler.state_dict())
    learn.load('mid')
    loaded = dict(masters=gathered(learn), scaler=learn.master_mixed_precision.scaler.state_dict())
    learn.fit(1, 1e-2)
    b = dict(masters=gathered(learn), scaler=learn.master_mixed_precision.scaler.state_dict())
    learn.export('export.pkl')
    learn.save_atomic('atomic')
    return dict(saved=saved, a=a, loaded=loaded, b=b, path=str(here),
                opt_is_sharded=all(type(p).__name__ == 'DTensor' for p in dw.opt_params(learn)))

def storm_float16(rank, world, out):
    "float16 (its scale matters): from step 1 on, an inf in rank 1's own gradient shard only; the third skip in a row stops the fit"
    learn = learner(rank, world, bs=8, n_train=64*world, cbs=[InfInLocalShard(at=range(1, 100))], dtype=torch.float16,
                    keep_fp32=nn.LayerNorm, init_scale=4., min_scale=1., max_consecutive_skips=3).to_sharded(distribute_data=False)
    try:
        learn.fit(1, 1e-2)
        err = None
    except Exception as e: err = type(e).__name__
    ps = list(learn.model.parameters())
    return dict(error=err, history=list(learn.master_mixed_precision.scaler.history), kinds=sorted({type(p).__name__ for p in ps}),
                dtypes=sorted({str(p.dtype) for p in ps}), masters=gathered(learn))

class RaiseAt(Callback):
    "On rank `rank`, raise after the loss of training batch `at`: between the forward and the backward"
    order = 60
    def __init__(self, at, rank=1): self.at,self.rank,self.i = at,rank,0
    def after_loss(self):
        if not self.training: return
        if self.i == self.at and rank_distrib() == self.rank: raise ValueError('raised on one rank')
        self.i += 1

def exception_on_one_rank(rank, world, out):
    "Rank 1 raises between the forward and the backward of batch 2; the other ranks' backward waits on it until the group's timeout"
    from torch.distributed.device_mesh import DeviceMesh
    group = dist.new_group(backend='gloo', timeout=datetime.timedelta(seconds=3)) # a group of its own: the default one stays usable
    mesh = DeviceMesh.from_group(group, 'cpu')
    learn = learner(rank, world, bs=8, n_train=32*world, cbs=[RaiseAt(at=2)], **mixed).to_sharded(mesh=mesh, distribute_data=False)
    try:
        learn.fit(1, 1e-2)
        err = None
    except Exception as e: err = type(e).__name__
    ps,opt = list(learn.model.parameters()),{id(p) for p in dw.opt_params(learn)}
    return dict(error=err, kinds=sorted({type(p).__name__ for p in ps}), dtypes=sorted({str(p.dtype) for p in ps}),
                local_dtypes=sorted({str(local_tensor(p).dtype) for p in ps}), are_masters=all(id(p) in opt for p in ps),
                fit_state=learn.master_mixed_precision.fit_state is None)

scenarios = {f.__name__: f for f in (same_data, grad_accumulation, split_data, inf_on_one_rank, storm_float16, checkpoint, exception_on_one_rank)}

def main(out, names): dw.run(out, names, scenarios, count_calls, '{name}.w{world}.rank{rank}.pt')

def launch(out, names, world):
    "Run scenarios `names` in `world` processes; returns (ok, log)"
    return dw.launch(out, names, world, script=__file__)

if __name__ == '__main__': # run from the module, so that pickles (the exported learner) name `sharded_worker`, not `__main__`
    sys.path.insert(0, str(Path(__file__).parent))
    import sharded_worker
    sharded_worker.main(Path(sys.argv[1]), sys.argv[2:])
