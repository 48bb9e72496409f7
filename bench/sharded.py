"""Section 3b: per-rank bytes per parameter of training state, sharded (FSDP2, `to_sharded`) against data-parallel (DDP), at
1, 2 and 4 ranks: gloo processes on this machine's CPU.

Each (mode, ranks) runs in fresh processes, one per rank, started as `torchrun` would start them. On each rank, at the
fit's events, every live tensor that `gc` finds (and its `.grad`; a `DTensor`: its local shard) is counted once per storage,
leaving out what existed before the learner (the data set): exactly the bytes of this rank's masters (or their shards),
gradients and optimizer state. DDP's gradient buckets live in C++, out of `gc`'s sight: they are added, one FP32 byte-for-byte
copy of the gradients. Divided by the model's parameter count (all ranks together): per-rank bytes per parameter; the largest
rank is reported. (Section 3's allocator total is not used here: with gloo's threads allocating and freeing, torch's
profiler misses frees made on threads it does not follow, and its running total drifted by 1-4 bytes/param between runs.)"""
from __future__ import annotations
import gc, json, os, socket, subprocess, sys, time, warnings
from pathlib import Path
import torch, torch.distributed as dist
from .common import md_table, as_bpp

modes = ('sharded', 'DDP') # `to_mixed(bfloat16)`, with `to_sharded()` or wrapped in DistributedDataParallel
world_sizes = (1, 2, 4)

def held_bytes(exclude:set=frozenset()) -> tuple: # (bytes, {storage key})
    "Bytes of every CPU storage reachable from a live tensor or its `.grad` (a `DTensor`: its local shard), each storage once"
    seen,n = set(),0
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        objs = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for o in objs:
        for t in (o, o.grad if o.is_leaf else None):
            if t is None: continue
            if hasattr(t, 'placements') and hasattr(t, 'to_local'): t = t.to_local()
            if t.device.type != 'cpu' or t.is_sparse: continue
            s = t.untyped_storage()
            if s.data_ptr() == 0 or s.data_ptr() in seen or s.data_ptr() in exclude: continue
            seen.add(s.data_ptr())
            n += s.nbytes()
    return n,seen

def measure(mode:str, n_batches:int=4, bs:int=4) -> dict:
    "One rank's bytes per parameter between steps and at the step's peak, in a fit of `mode` (the process group is up)"
    from fastai.basics import Learner, Callback, CrossEntropyLossFlat, Adam
    from torch.nn.parallel import DistributedDataParallel
    import mpcallbacks.all
    from .common import linear_norm_stack, synthetic_dls, quiet, n_params

    class DDPTrainer(Callback): # fastai's `DistributedTrainer` on a CPU: wraps the model for the fit
        order = 11
        def before_fit(self): self.learn.model = DistributedDataParallel(self.model)
        def after_fit(self): self.learn.model = self.model.module

    class Census(Callback):
        "The bytes held at a training batch's events: `at` runs before every other callback's, `after_batch` after them all"
        def __init__(self, order, at): self.order,self.at,self.rows,self.buckets = order,at,[],0
        def _count(self, name):
            if not self.training or self.iter == 0: return # the first batch creates the optimizer state
            self.rows.append((name, held_bytes(exclude)[0]))
            if isinstance(self.model, DistributedDataParallel): # DDP's gradient buckets live in C++, where `gc` does not look
                self.buckets = _bucket_bytes(self.model)
        def after_backward(self):
            if 'after_backward' in self.at: self._count('after_backward')
        def after_step(self):
            if 'after_step' in self.at: self._count('after_step')
        def after_batch(self):
            if 'after_batch' in self.at: self._count('after_batch')

    gc.collect()
    _,exclude = held_bytes()
    dls = synthetic_dls(n_in=256, bs=bs, n_train_batches=n_batches, device=torch.device('cpu'))
    _,exclude = held_bytes() # (the data set is not training state)
    model = linear_norm_stack(n_blocks=16, width=256)
    n = n_params(model)
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat(), opt_func=Adam).to_mixed(torch.bfloat16)
    if mode == 'sharded': learn.to_sharded(distribute_data=False) # (the same random batches on every rank: memory is what counts)
    else: learn.add_cb(DDPTrainer())
    early,late = Census(-1000, ('after_backward', 'after_step')),Census(1000, ('after_batch',))
    with quiet(learn): learn.fit(1, 1e-3, cbs=[early, late])
    kinds = sorted({type(p).__name__ for p in learn.model.parameters()})
    buckets = max(early.buckets, late.buckets)
    return dict(mode=mode, ranks=dist.get_world_size(), rank=dist.get_rank(), params=n, param_kinds='/'.join(kinds),
                between=(max(b for _,b in late.rows) + buckets) / n, peak_step=(max(b for _,b in early.rows) + buckets) / n,
                buckets=buckets / n)

def _bucket_bytes(ddp) -> int:
    "The bytes of DDP's gradient buckets: one FP32 buffer per bucket, as large as the gradients it holds"
    return 4 * sum(p.numel() for p in ddp.module.parameters() if p.requires_grad) # (FP32 masters: FP32 gradients)

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

def _launch(mode:str, world:int) -> list:
    "Run `measure(mode)` on `world` ranks; each rank's row"
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, MASTER_ADDR='127.0.0.1', MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore')
    procs = [subprocess.Popen([sys.executable, '-m', 'bench.sharded', mode], cwd=root, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    outs = [p.communicate() for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"sharded memory ({mode}, {world} ranks) failed:\n" + '\n'.join(e[-3000:] for _,e in outs))
    return [json.loads(o.strip().splitlines()[-1]) for o,_ in outs]

def run_sharded_memory() -> list:
    "For each mode and number of ranks: the largest rank's row"
    rows = []
    for world in world_sizes:
        for mode in modes:
            rs = _launch(mode, world)
            rows.append(dict(max(rs, key=lambda r: r['between']), **{k:max(r[k] for r in rs) for k in ('between', 'peak_step')}))
    return rows

def target(ranks:int) -> float: return 12 / ranks + 1 # bytes/param between steps: FP32 masters and Adam's two moments, sharded, + 1

def sharded_section(rows:list) -> str:
    "Per-rank bytes per parameter, sharded against DDP, at 1, 2 and 4 ranks"
    cols = ['ranks', 'mode', 'parameters are', 'between steps', 'peak of the step', 'of which DDP buckets', 'target between steps (12/ranks + 1)', 'met']
    body = [[r['ranks'], r['mode'], r['param_kinds'], as_bpp(r['between']), as_bpp(r['peak_step']), as_bpp(r['buckets']),
             as_bpp(target(r['ranks'])) if r['mode'] == 'sharded' else '-',
             ('yes' if round(r['between'], 2) <= target(r['ranks']) else '**no**') if r['mode'] == 'sharded' else '-'] for r in rows]
    n = rows[0]['params']
    return ('### 3b. Sharded (FSDP2) against data-parallel (DDP): per-rank bytes per parameter\n\n'
            f'`to_mixed(torch.bfloat16)` with fastai\'s Adam on a {n/1e6:.2f}M-parameter Linear+LayerNorm stack (16 blocks of 256), '
            'sharded with `to_sharded()` or wrapped in `DistributedDataParallel`, on 1, 2 and 4 gloo processes of this CPU. '
            'Bytes of the storages of every live tensor and gradient (a DTensor: its local shard), the data set left out, plus '
            "DDP's C++ gradient buckets; divided by the model's parameter count; the largest rank. Between steps: at "
            '`after_batch`. Peak of the step: the larger of the end of the backward and the end of the optimizer step (the '
            'gradients not yet freed). Transient buffers (activations, gathered 16-bit parameters, reduce buffers) are not '
            'counted.\n\n' + md_table(cols, body))

if __name__ == '__main__':
    torch.set_num_threads(1)
    if len(sys.argv) == 2 and 'RANK' in os.environ: # one rank of `_launch`
        warnings.filterwarnings('ignore')
        dist.init_process_group('gloo')
        try: print(json.dumps(measure(sys.argv[1])))
        finally: dist.destroy_process_group()
    else: # `python -m bench.sharded`: this section alone, printed
        print(sharded_section(run_sharded_memory()))
