"""Fault sweep: interrupt every entry point of a mixed learner at every line of the package it runs, once and twice, and
raise at every fastai event and inside the forward and the backward; after each call, check that the learner is at rest
at once (not at the next call): every parameter its FP32 master and the optimizer's, no hook of ours, autocast as before,
no fit open and no cast held, and the optimizer, DataLoaders and callbacks those the learner had (or, for a call that completed, made).

Not part of `make test`: it runs thousands of calls. From the repository root, with the package importable:

    python tools/fault_sweep.py                # every entry point, every line, doubles at a few offsets
    python tools/fault_sweep.py --quick        # every 7th line, fewer doubles and events
    python tools/fault_sweep.py --only fit,get_preds
    python tools/fault_sweep.py --list         # the entry points
    python tools/fault_sweep.py --no-lines --only fit,get_preds_16bit   # the exceptions alone

Entry points: fit, fit_one_cycle, fine_tune, lr_find, get_preds/validate/predict with and without 16-bit inference,
`with learn:`, save_atomic, export_atomic, load_checked, to_mixed/to_unmixed, precision_report and a sharded fit
(`to_sharded`, in a process group of one rank); exceptions at every fastai event and inside the forward and the backward.

It prints one row per entry point and kind of fault: injections made, and how many left the learner not at rest (with
the first few, for a reproduction). Its exit status is the number of such rows."""
from __future__ import annotations
import argparse, os, sys, tempfile, threading, time, traceback, warnings
from collections import Counter
from pathlib import Path
warnings.filterwarnings('ignore')
import torch
from torch import nn
from fastai.basics import Callback, CancelBatchException, CancelEpochException, CancelFitException, CancelStepException, \
    CancelTrainException, CancelValidException, Learner
import fastai.callback.schedule # fit_one_cycle, fine_tune, lr_find
import mpcallbacks.all # noqa: F401
from mpcallbacks.all import MasterMixedPrecision
from mpcallbacks.cast import cast_holding
from mpcallbacks.distributed import fsdp_sharded
from mpcallbacks.test_utils import synth_learner

torch.set_num_threads(1)
PKG = str(Path(mpcallbacks.all.__file__).parent)
EXCLUDE = ('cuda_rules.py', 'test_utils.py', '_modidx.py')

class Injector:
    "A tracer: a KeyboardInterrupt at the `at`-th line run in the package, and another `then` lines after it (0: none)"
    def __init__(self, at:int|None, then:int=0): self.at,self.then,self.n,self.fired = at,then,0,0
    def __call__(self, frame, event, arg):
        f = frame.f_code.co_filename
        return self.line if f.startswith(PKG) and not f.endswith(EXCLUDE) else None
    def line(self, frame, event, arg):
        if event != 'line': return self.line
        self.n += 1
        if self.at is not None and self.fired < (2 if self.then else 1) and self.n == self.at + (self.then if self.fired else 0):
            self.fired += 1
            raise KeyboardInterrupt(f'injected #{self.fired} at line {self.n}')
        return self.line

def traced(f, tracer):
    sys.settrace(tracer); threading.settrace(tracer)
    try: return f()
    finally: sys.settrace(None); threading.settrace(None)

# ---- the learner and what "at rest" means

def learner(mixed_inference=False, opt=True):
    learn = synth_learner().to_mixed(torch.float16, mixed_inference=mixed_inference)
    if opt: learn.create_opt()
    return learn

def snapshot(learn) -> dict:
    return dict(opt=learn.opt, opt_state=None if learn.opt is None else {id(p):{k:v.clone() if isinstance(v, torch.Tensor) else v for k,v in s.items()}
                for p,s in getattr(getattr(learn.opt, 'opt', learn.opt), 'state', {}).items()},
                loaders=list(learn.dls.loaders), cbs=list(learn.cbs), hooks=our_hooks(learn.model), model=learn.model)

def our_hooks(model) -> dict:
    "The hooks of ours on each module (another library's, FSDP2's after `to_sharded`, are its own)"
    ours = lambda f: getattr(getattr(f, '__func__', f), '__module__', '').startswith('mpcallbacks')
    return {n:[h for d in (m._forward_pre_hooks, m._forward_hooks) for h in d.values() if ours(h)] for n,m in model.named_modules()}

def not_at_rest(learn, before:dict, completed:bool) -> list: # What is wrong, a phrase each
    bad = []
    ps = list(learn.model.parameters())
    if any(p.dtype != torch.float32 for p in ps): bad.append('16-bit parameter')
    opt = learn.opt
    if opt is not None:
        op = [p for pg in opt.param_lists for p in pg]
        if not all(any(a is b for b in ps) for a in op): bad.append("the optimizer's tensors are not the model's")
    if our_hooks(learn.model) != before['hooks']: bad.append('hooks left')
    held = [cast_holding(m) for m in learn.model.modules() if cast_holding(m) is not None]
    if held: bad.append('model still registered in a cast' + ('' if any(c.model is learn.model for c in held) else
                                                               " (by another model's cast, under a module's reused id)"))
    if torch.is_autocast_enabled('cpu'): bad.append('autocast left on')
    cbs = learn._grab_cbs(MasterMixedPrecision)
    for cb in cbs:
        mf = cb.mixed_fit
        # (a phase left INFERRING or CLOSING with nothing held, by an inference whose `after_fit` an interrupt in
        # `after_epoch` kept fastai from dispatching, is closed by the next call, and nothing of it can be seen)
        if mf.phase.name == 'FITTING' or mf.fits or mf.cast is not None: bad.append(f'fit left {mf.phase.name} ({mf.fits} running, cast {mf.cast})')
    if not learn.lock.acquire(blocking=False): bad.append('learn.lock held')
    else: learn.lock.release()
    from mpcallbacks.fused import ScalerOptFunc, OptimizerWithScaler
    mixed = (bool(learn._grab_cbs(MasterMixedPrecision)), isinstance(learn.opt_func, ScalerOptFunc),
             learn.opt is None or isinstance(learn.opt, OptimizerWithScaler))
    if mixed not in ((True, True, True), (False, False, learn.opt is None)): bad.append(f'half mixed (callback, opt_func, optimizer): {mixed}')
    if not completed:
        same = learn.opt is before['opt'] or getattr(learn.opt, 'opt', None) is before['opt'] or learn.opt is getattr(before['opt'], 'opt', None)
        same = same or (learn.opt is not None and getattr(learn.opt, 'opt', None) is getattr(before['opt'], 'opt', False)) # (to_mixed over to_mixed: a new wrapper of the same optimizer)
        sharded = fsdp_sharded(learn.model) # (the sweep's learners start unsharded; a sharded fit's sharding is whole: the shards' optimizer, checked above)
        if not same and not sharded: bad.append('the optimizer was replaced') # (to_mixed/to_unmixed completed: it wraps or unwraps the same one)
        if list(learn.dls.loaders) != before['loaders'] or not all(len(l) for l in learn.dls.loaders if hasattr(l, '__len__')): bad.append('the DataLoaders changed')
    if len(learn._grab_cbs(MasterMixedPrecision)) > 1: bad.append('two MasterMixedPrecision callbacks')
    return bad

# ---- the entry points

def _ckpt(learn):
    learn.path = Path(tempfile.mkdtemp())
    return learn

ENTRY = {
    'fit': (lambda: learner(), lambda l: l.fit(1, 1e-3)),
    'fit_one_cycle': (lambda: learner(), lambda l: l.fit_one_cycle(1, 1e-3)),
    'fine_tune': (lambda: learner(), lambda l: l.fine_tune(1, 1e-3, freeze_epochs=1)),
    'lr_find': (lambda: learner(), lambda l: l.lr_find(num_it=6, show_plot=False)),
    'get_preds': (lambda: learner(), lambda l: l.get_preds()),
    'get_preds_16bit': (lambda: learner(mixed_inference=True), lambda l: l.get_preds()),
    'validate': (lambda: learner(), lambda l: l.validate()),
    'predict': (lambda: learner(mixed_inference=True), lambda l: l.get_preds(dl=l.dls.valid.new(n=1))),
    'with_learn': (lambda: learner(), lambda l: _with(l)),
    'save_atomic': (lambda: _ckpt(learner()), lambda l: l.save_atomic('m')),
    'export_atomic': (lambda: _ckpt(_exportable()), lambda l: l.export_atomic('e.pkl')),
    'load_checked': (lambda: _saved(learner()), lambda l: l.load_checked('m')),
    'to_mixed': (lambda: learner(), lambda l: l.to_mixed(torch.bfloat16)),
    'to_unmixed': (lambda: learner(), lambda l: l.to_unmixed()),
    'precision_report': (lambda: learner(), lambda l: l.precision_report(n_batches=1)),
    'to_sharded': (lambda: learner(), lambda l: _sharded_fit(l)), # (one rank: a process group of one, started by `main`)
}

def _sharded_fit(l):
    l.to_sharded()
    l.fit(1, 1e-3)

def _exportable():
    "A mixed learner fastai can export: the digits in fastai `Datasets` (fastai's export empties its data with `new_empty`)"
    from fastai.basics import CrossEntropyLossFlat
    from mpcallbacks.digits import digits_dls, digits_cnn
    learn = Learner(digits_dls(), digits_cnn(), loss_func=CrossEntropyLossFlat()).to_mixed(torch.float16)
    learn.create_opt()
    return learn

def _with(l):
    with l: l.model(torch.randn(2, 1, 8, 8))

def _saved(learn):
    _ckpt(learn)
    learn.fit(1, 1e-3)
    learn.save_atomic('m')
    return learn

# ---- exceptions at events, in the forward and in the backward

EVENTS = ['before_fit', 'before_epoch', 'before_train', 'before_batch', 'after_pred', 'after_loss', 'before_backward',
          'after_backward', 'before_step', 'after_step', 'after_batch', 'after_train', 'before_validate', 'after_validate',
          'after_epoch', 'after_fit', 'after_cancel_batch', 'after_cancel_train', 'after_cancel_epoch', 'after_cancel_fit',
          'after_cancel_step', 'after_cancel_validate', 'after_cancel_fit']
EXCEPTIONS = [RuntimeError, KeyboardInterrupt, CancelBatchException, CancelEpochException, CancelFitException, CancelStepException,
              CancelTrainException, CancelValidException, ValueError]

class RaiseAt(Callback):
    def __init__(self, event, exc, order):
        self.order,self.exc,self.done = order,exc,False
        setattr(self, event, self._raise)
    def _raise(self):
        if self.done: return
        self.done = True
        raise self.exc('injected')

class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mod): ctx.mod = mod; return x.view_as(x)
    @staticmethod
    def backward(ctx, g):
        ctx.mod.n += 1
        if ctx.mod.n == ctx.mod.at: raise ctx.mod.exc('injected in the backward')
        return g, None

class RaisesInBackward(nn.Module):
    "Passes its input on; the `at`-th backward through it raises `exc`"
    def __init__(self, at:int, exc): super().__init__(); self.at,self.exc,self.n = at,exc,0
    def forward(self, x): return _RaiseInBackward.apply(x, self)

class RaisesInForward(nn.Module):
    def __init__(self, at:int): super().__init__(); self.at,self.n = at,0
    def forward(self, x):
        self.n += 1
        if self.n == self.at: raise KeyboardInterrupt('injected in the forward')
        return x

def run_one(name, make, call, inject) -> tuple: # (completed, what is wrong)
    learn = make()
    before = snapshot(learn)
    completed,err = False,None
    try:
        inject(learn, lambda: call(learn))
        completed = True
    except BaseException as e: err = e
    res = completed,not_at_rest(learn, before, completed),err
    torch.set_autocast_enabled('cpu', False); torch.clear_autocast_cache() # (a call that left autocast on is counted, not passed on to the next)
    return res

def sweep(names, quick:bool, lines:bool=True) -> dict:
    rows = {}
    for name in (names if lines else []):
        make,call = ENTRY[name]
        counter = Injector(None)
        learn = make(); traced(lambda: call(learn), counter)
        n = counter.n
        ks = range(1, n + 1, 7 if quick else 1)
        for kind,injections in [
            ('single Ctrl-C', [(k, 0) for k in ks]),
            ('double Ctrl-C', [(k, j) for k in ks[::(3 if quick else 1)] for j in ((1, 5) if quick else (1, 2, 3, 5, 8, 13))])]:
            made,bad = 0,[]
            for k,j in injections:
                tracer = Injector(k, j)
                done,wrong,err = run_one(name, make, call, lambda l, f: traced(f, tracer))
                made += 1
                if wrong:
                    bad.append((k, j, wrong, repr(err)[:80]))
                    print(f"  {name}, {kind}: not at rest after an interrupt at line {k} (then {j}): {wrong}; raised {err!r}", flush=True)
            rows[(name, kind)] = (made, bad, n)
            print(f"{name:18} {kind:14} {made:5} injections over {n} lines: {len(bad)} not at rest", flush=True)
    for name in [n for n in ('fit', 'get_preds_16bit') if n in names]: # exceptions at every fastai event, both sides of ours
        make,call = ENTRY[name]
        made,bad = 0,[]
        for event in (EVENTS[::2] if quick else EVENTS):
            for exc in (EXCEPTIONS[:3] if quick else EXCEPTIONS):
                for order in (MasterMixedPrecision.order - 1, MasterMixedPrecision.order + 1):
                    def inject(l, f, event=event, exc=exc, order=order):
                        l.add_cb(RaiseAt(event, exc, order))
                        return f()
                    done,wrong,err = run_one(name, make, call, inject)
                    made += 1
                    if wrong: bad.append((event, exc.__name__, order, wrong))
        rows[(name, 'event exceptions')] = (made, bad, None)
        print(f"{name:18} {'event exceptions':14} {made:5} injections: {len(bad)} not at rest", flush=True)
        made,bad = 0,[]
        for at in range(1, 12):
            def make_f(at=at):
                l = make()
                l.model = nn.Sequential(*l.model[:3], RaisesInForward(at), *l.model[3:])
                return l
            done,wrong,err = run_one(name, make_f, call, lambda l, f: f())
            made += 1
            if wrong: bad.append(('forward call', at, wrong))
        rows[(name, 'forward interrupts')] = (made, bad, None)
        print(f"{name:18} {'forward':14} {made:5} injections: {len(bad)} not at rest", flush=True)
        if name != 'fit': continue # (no backward in inference)
        made,bad = 0,[]
        for exc in (RuntimeError, KeyboardInterrupt, CancelBatchException, CancelStepException):
            for at in range(1, 7):
                def make_b(at=at, exc=exc):
                    l = make()
                    l.model = nn.Sequential(*l.model[:3], RaisesInBackward(at, exc), *l.model[3:])
                    return l
                done,wrong,err = run_one(name, make_b, call, lambda l, f: f())
                made += 1
                if wrong: bad.append(('backward call', exc.__name__, at, wrong))
        rows[(name, 'backward exceptions')] = (made, bad, None)
        print(f"{name:18} {'backward':14} {made:5} injections: {len(bad)} not at rest", flush=True)
    return rows

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--quick', action='store_true')
    ap.add_argument('--only', default=','.join(ENTRY))
    ap.add_argument('--list', action='store_true', help='print the entry points and exit')
    ap.add_argument('--no-lines', action='store_true', help="only the exceptions (fit's and get_preds_16bit's), no line-level interrupts")
    args = ap.parse_args()
    if args.list: return print('\n'.join(ENTRY))
    names = args.only.split(',')
    unknown = [n for n in names if n not in ENTRY]
    if unknown: ap.error(f"--only takes entry points of {list(ENTRY)}, got {unknown}")
    if 'to_sharded' in names: # a process group of one rank, as torchrun would start it
        os.environ.setdefault('MASTER_ADDR', '127.0.0.1'); os.environ.setdefault('MASTER_PORT', '29517')
        torch.distributed.init_process_group('gloo', rank=0, world_size=1)
    start = time.perf_counter()
    rows = sweep(names, args.quick, lines=not args.no_lines)
    total = sum(m for m,_,_ in rows.values())
    failing = {k:v for k,v in rows.items() if v[1]}
    lock_only = sum(1 for _,b,_ in rows.values() for x in b if [w for w in x[-2 if len(x) == 4 and isinstance(x[-1], str) else -1] if w != 'learn.lock held'] == [])
    print(f"\n{total} injections in {time.perf_counter() - start:.0f} s; {sum(len(b) for _,b,_ in rows.values())} left the learner not at rest, "
          f"{lock_only} of them with fastai's `learn.lock` alone held (a failed `validation_context` enter)")
    for (name, kind),(made,bad,_) in failing.items():
        print(f"  {name}, {kind}: {len(bad)} of {made}; first: {bad[:3]}")
    sys.exit(len(failing))

if __name__ == '__main__': main()
