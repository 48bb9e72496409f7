"""One rank of the data-parallel scenarios that `test_distributed.py` checks: DDP over gloo on CPU, results saved to files.

Run as torchrun would start it (env RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):
    torchrun --nproc_per_node 2 tests/distributed_worker.py OUT_DIR SCENARIO...
`launch` does the same with two plain subprocesses (no torchrun agent: faster to start, and a rank that fails takes the
others down)."""
import copy, hashlib, math, os, socket, subprocess, sys, time, traceback, warnings
from collections import Counter
from functools import partial
from pathlib import Path
warnings.filterwarnings('ignore', message='float16 math is emulated')
warnings.filterwarnings('ignore', message='`torch.jit.script` is deprecated')
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from fastai.basics import Learner, Callback, DataLoaders, CrossEntropyLossFlat, SGD, Adam, rank_distrib, noop
from fastai.data.core import Datasets
from fastai.data.transforms import ItemGetter
from fastai.callback.progress import ProgressCallback
from fastai.callback.training import GradientAccumulation, GradientClip
from mpcallbacks.all import *
from mpcallbacks.scaler import LossScaler
from mpcallbacks.test_utils import synth_model, opt_params, InjectNonFinite

# ---- the CPU recipe: what fastai's `DistributedTrainer` does, without accelerate, CUDA or NCCL

class CPUDistributedTrainer(Callback):
    "Wrap the model in `DistributedDataParallel` for the fit, as fastai's `DistributedTrainer` does on GPUs"
    order = 11 # fastai's `DistributedTrainer`: after `MasterMixedPrecision` (10) has cast the model to 16 bits
    def __init__(self, **ddp_kwargs): self.ddp_kwargs = ddp_kwargs
    def before_fit(self):
        self.learn.model = DistributedDataParallel(self.model, **self.ddp_kwargs)
        if rank_distrib(): self.learn.logger = noop
    def after_fit(self): self.learn.model = self.model.module

def rank_share(items, bs, rank, world):
    "`rank`'s `bs` items of each global batch of `bs*world` items, in order: a one-process batch of `bs*world` is their union"
    g = bs*world
    return [items[i] for k in range(0, len(items) - len(items)%g, g) for i in range(k + rank*bs, k + (rank+1)*bs)]

def synth_items(n, seed=0):
    "The two-class problem of `mpcallbacks.test_utils.synth_dls`"
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=gen)
    return list(zip(x, (x[:, 0, :4].mean((1, 2)) > 0).long()))

def mlp(seed=0):
    "Per-sample forward (no BatchNorm); its LayerNorm is kept FP32, so DDP reduces float16 and FP32 buckets"
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 2))

def make_learner(model, rank, world, bs, ddp=True, n_train=128, n_valid=32, opt_func=SGD, cbs=(), **mixed):
    "A mixed-precision learner on `rank`'s share of the data, wrapped in DDP for each fit if `ddp`"
    items = synth_items(n_train + n_valid)
    dsets = [Datasets(rank_share(its, bs, rank, world), [[ItemGetter(0)], [ItemGetter(1)]]) # `Datasets`: `export` needs `new_empty`
             for its in (items[:n_train], items[n_train:])]
    dls = DataLoaders.from_dsets(*dsets, bs=bs, shuffle=False, num_workers=0, device='cpu')
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=opt_func,
                    cbs=[CPUDistributedTrainer()]*ddp + list(cbs))
    learn.remove_cb(ProgressCallback)
    learn.logger = noop
    return learn.to_mixed(**{'dtype': torch.float16, **mixed})

# ---- what each rank records

counts = Counter() # calls to `dist.all_reduce` (ours: DDP's reducer does not go through it), `LossScaler.unscale_`, DDP buckets

def _counting(key, f):
    def _inner(*args, **kwargs):
        counts[key] += 1
        return f(*args, **kwargs)
    return _inner

_all_reduce = dist.all_reduce

def count_calls():
    "Count, in this process, the calls to `dist.all_reduce` and to `LossScaler.unscale_`"
    dist.all_reduce = _counting('all_reduce', _all_reduce)
    LossScaler.unscale_ = _counting('unscale_', LossScaler.unscale_)

def counting_allreduce_hook(state, bucket):
    "DDP's default all-reduce (divide by world size, sum), counting buckets and gradient elements"
    buf = bucket.buffer()
    counts['buckets'] += 1
    counts['reduced'] += buf.numel()
    counts['reduced_bytes'] += buf.numel() * buf.element_size()
    buf.div_(dist.get_world_size())
    return _all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])

class CountBuckets(Callback):
    "Route DDP's gradient all-reduce through `counting_allreduce_hook`"
    order = CPUDistributedTrainer.order + 1
    def before_fit(self): self.model.register_comm_hook(None, counting_allreduce_hook)

def digest(ts):
    "A hash of the tensors' bytes: equal digests, bit-identical tensors"
    h = hashlib.sha256()
    for t in ts: h.update(t.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

def masters(learn) -> list:
    "The optimizer's parameters: the FP32 masters, which are the model's parameters"
    return opt_params(learn)

def inner(model): return model.module if isinstance(model, DistributedDataParallel) else model

class Trace(Callback):
    "After each training batch: digests of the masters and of the 16-bit weights its forward used, the scale, and the counts"
    order = 50
    def before_fit(self): self.batches = []
    def before_batch(self): self.seen = Counter(counts)
    def after_pred(self):
        if self.training: self.weights = digest(inner(self.model).parameters())
    def after_loss(self):
        if self.training: self.loss_finite = bool(torch.isfinite(self.loss_grad).all())
    def after_batch(self):
        if not self.training: return
        delta = {k: counts[k] - self.seen[k] for k in ('all_reduce', 'unscale_', 'buckets', 'reduced', 'reduced_bytes')}
        mmp = self.learn.master_mixed_precision
        self.batches.append(dict(masters=digest(masters(self.learn)), weights=self.weights,
            steps=len(mmp.scaler.history), scale=mmp.loss_scale, loss_finite=self.loss_finite, **delta))
    def after_fit(self):
        self.history = list(self.learn.master_mixed_precision.scaler.history)
        self.grad_numel = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
    def result(self): return dict(batches=self.batches, history=self.history, grad_numel=self.grad_numel)

class InfLoss(Callback):
    "On rank `rank` only, make the loss of the chosen training batches inf: its backward fills the gradients with inf/NaN"
    order = MasterMixedPrecision.order - 1
    def __init__(self, at, rank=1): self.at,self.rank,self.i = set(at),rank,0
    def after_loss(self):
        if not self.training: return
        if self.i in self.at and rank_distrib() == self.rank: self.learn.loss_grad = self.loss_grad * math.inf
        self.i += 1

class NoSyncAt(Callback):
    "Run the forward and backward of the chosen training batches under DDP's `no_sync` (what `no_sync()` sets)"
    order = CPUDistributedTrainer.order + 1
    def __init__(self, at): self.at,self.i = set(at),0
    def before_batch(self):
        if not self.training: return
        if self.i in self.at: self.model.require_backward_grad_sync = False
        self.i += 1
    def after_batch(self): self.model.require_backward_grad_sync = True

def on_rank(rank, *cbs): return list(cbs) if rank_distrib() == rank else []

# ---- the scenarios: each returns what the tests compare across ranks

def sync_every_step(rank, world, out):
    "A CNN with BatchNorm, DDP syncing every backward; rank 1's loss is inf at step 5"
    trace = Trace()
    learn = make_learner(synth_model(), rank, world, bs=8, n_train=64, init_scale=2.**8, growth_interval=3,
                         cbs=[CountBuckets(), trace, InfLoss(at=[5])])
    learn.fit(2, 1e-2)
    return trace.result()

def no_sync_step(rank, world, out):
    "The MLP; step 2 runs under `no_sync`, and an inf lands in rank 1's gradient after that backward"
    trace = Trace()
    learn = make_learner(mlp(), rank, world, bs=8, keep_fp32=nn.LayerNorm, init_scale=2.**8, growth_interval=3,
                         cbs=[trace, NoSyncAt(at=[2])] + on_rank(1, InjectNonFinite(at=[2])))
    learn.fit(1, 1e-2)
    return trace.result()

def grad_accumulation(rank, world, out):
    "fastai's `GradientAccumulation` (two batches a step), DDP syncing every backward; rank 1's loss is inf in batch 4"
    trace = Trace()
    learn = make_learner(mlp(), rank, world, bs=8, keep_fp32=nn.LayerNorm, init_scale=2.**8, growth_interval=2,
                         cbs=[CountBuckets(), trace, GradientAccumulation(n_acc=16), InfLoss(at=[4])])
    learn.fit(1, 1e-2)
    return trace.result()

def grad_accumulation_no_sync(rank, world, out):
    "Accumulation that skips DDP's all-reduce on the first batch of each step (`no_sync`); rank 1's loss is inf in batch 4"
    trace = Trace()
    learn = make_learner(mlp(), rank, world, bs=8, keep_fp32=nn.LayerNorm, init_scale=2.**8, growth_interval=2,
                         cbs=[trace, GradientAccumulation(n_acc=16), NoSyncAt(at=[0, 2, 4, 6]), InfLoss(at=[4])])
    learn.fit(1, 1e-2)
    return trace.result()

def different_init(rank, world, out):
    "Each rank builds its model from its own seed, as scripts without a fixed seed do: DDP broadcasts rank 0's weights"
    trace = Trace()
    learn = make_learner(mlp(seed=rank), rank, world, bs=8, n_train=32, cbs=[trace])
    learn.fit(1, 1e-2)
    return trace.result()

class SaveAt(Callback):
    "Save a checkpoint after training batch `at` and keep what it should hold"
    order = 60
    def __init__(self, at, file): self.at,self.file,self.i = at,file,0
    def after_batch(self):
        if not self.training: return
        if self.i == self.at:
            self.learn.save(self.file)
            self.saved = dict(masters=[p.detach().clone() for p in opt_params(self.learn)],
                              scaler=self.learn.master_mixed_precision.scaler.state_dict(), opt=copy.deepcopy(self.learn.opt.state_dict()))
        self.i += 1

def checkpoint(rank, world, out):
    "Save in the middle of a DDP fit and export after it (each rank into its own folder), then both ranks load rank 0's file"
    here = out/f'checkpoint_rank{rank}'
    save = SaveAt(at=2, file=here/'mid')
    learn = make_learner(mlp(), rank, world, bs=8, n_train=64, keep_fp32=nn.LayerNorm, init_scale=2.**8, growth_interval=3,
                         opt_func=partial(SGD, mom=0.9), cbs=[save, InfLoss(at=[1])])
    learn.path = here
    learn.fit(1, 1e-2)
    learn.export(here/'export.pkl')
    end = dict(masters=[p.detach().clone() for p in opt_params(learn)], scaler=learn.master_mixed_precision.scaler.state_dict())
    learn.load(out/'checkpoint_rank0'/'mid') # `Learner.load` waits at a barrier: rank 0 wrote it before
    loaded = dict(masters=[p.detach().clone() for p in learn.model.parameters()],
                  scaler=learn.master_mixed_precision.scaler.state_dict(), opt=copy.deepcopy(learn.opt.state_dict()))
    trace = Trace()
    learn.fit(1, 1e-2, cbs=trace) # training goes on in step from the loaded state
    files = sorted(str(p.relative_to(here)) for p in here.rglob('*') if p.is_file())
    return dict(saved=save.saved, end=end, loaded=loaded, files=files, resumed=trace.result())

def batch_equivalence(rank, world, out):
    "The MLP, `bs` 8 per rank, plain SGD: compared in the test with one process and `bs` 16"
    trace = Trace()
    learn = make_learner(mlp(), rank, world, bs=8, keep_fp32=nn.LayerNorm, init_scale=2.**8, cbs=[trace])
    learn.fit(2, 0.1)
    return dict(trace.result(), masters=[p.detach().clone() for p in opt_params(learn)])

scenarios = {f.__name__: f for f in (sync_every_step, no_sync_step, grad_accumulation, grad_accumulation_no_sync,
                                     different_init, checkpoint, batch_equivalence)}

def run(out, names, scenarios, count_calls, file_name='{name}.rank{rank}.pt'):
    "On this rank (torchrun's environment): each scenario of `names`, its result saved in `out`, then a barrier"
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    count_calls()
    rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    dist.init_process_group('gloo', rank=rank, world_size=world) # (a rank that fails is killed with the others by `launch`)
    try:
        for name in names:
            t = time.monotonic()
            torch.save(scenarios[name](rank, world, out), out/file_name.format(name=name, rank=rank, world=world))
            dist.barrier()
            print(f'rank {rank}: {name} {time.monotonic()-t:.1f}s', flush=True)
    except BaseException:
        (out/f'error.rank{rank}.txt').write_text(traceback.format_exc())
        raise
    finally: dist.destroy_process_group()

def main(out, names): run(out, names, scenarios, count_calls)

# ---- the launcher

def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

def launch(out, names, world=2, script=__file__):
    "Run scenarios `names` of `script` in `world` processes, as torchrun would; kill the others as soon as one fails. Returns (ok, log)"
    ok, log = _launch(out, names, world, script)
    if not ok and 'address already in use' in log.lower(): ok, log = _launch(out, names, world, script) # the free port was taken
    return ok, log

def _launch(out, names, world, script):
    out = Path(out); out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MASTER_ADDR='127.0.0.1', MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore')
    logs = [open(out/f'log.rank{r}.txt', 'w') for r in range(world)]
    procs = [subprocess.Popen([sys.executable, script, str(out), *names], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=logs[r], stderr=subprocess.STDOUT) for r in range(world)]
    try: # no deadline of its own: a rank that fails ends the launch, and a hang is pytest-timeout's (pyproject.toml)
        while any(p.poll() is None for p in procs) and not any(p.poll() not in (None, 0) for p in procs): time.sleep(0.1)
    finally: # also when the test is interrupted: no rank outlives it
        for p in procs:
            if p.poll() is None: p.kill()
        for p in procs: p.wait()
        for f in logs: f.close()
    ok = all(p.returncode == 0 for p in procs)
    log = '\n'.join(f'--- rank {r} (exit {p.returncode}):\n' + (out/f'log.rank{r}.txt').read_text()[-3000:]
                    for r, p in enumerate(procs))
    return ok, f'{"ok" if ok else "a rank failed"}\n{log}'

if __name__ == '__main__': # run from the module, so that pickles (the exported learner) name `distributed_worker`, not `__main__`
    import distributed_worker
    distributed_worker.main(Path(sys.argv[1]), sys.argv[2:])
