"""Fault sweep: interrupt every entry point of a mixed learner at every line of the package it runs, once and twice, and
raise at every fastai event and inside the forward and the backward; after each call, check that the learner is at rest
at once (not at the next call): every parameter its FP32 master and the optimizer's, no hook of ours, autocast as before,
no fit open, and the optimizer, DataLoaders and callbacks those the learner had (or, for a call that completed, made).

Not part of `make test`: it runs thousands of calls. From the repository root, with the package importable:

    python tools/fault_sweep.py                # every entry point, every line, doubles at a few offsets
    python tools/fault_sweep.py --quick        # every 7th line, fewer doubles and events
    python tools/fault_sweep.py --only fit,get_preds

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
                loaders=list(learn.dls.loaders), cbs=list(learn.cbs), hooks={n:(list(m._forward_pre_hooks), list(m._forward_hooks))
                for n,m in learn.model.named_modules()}, model=learn.model)

def not_at_rest(learn, before:dict, completed:bool) -> list: # What is wrong, a phrase each
    bad = []
    ps = list(learn.model.parameters())
    if any(p.dtype != torch.float32 for p in ps): bad.append('16-bit parameter')
    opt = learn.opt
    if opt is not None:
        op = [p for pg in opt.param_lists for p in pg]
        if not all(any(a is b for b in ps) for a in op): bad.append("the optimizer's tensors are not the model's")
    hooks = {n:(list(m._forward_pre_hooks), list(m._forward_hooks)) for n,m in learn.model.named_modules()}
    if hooks != before['hooks']: bad.append('hooks left')
    if any(cast_holding(m) is not None for m in learn.model.modules()): bad.append('model still registered in a cast')
    if torch.is_autocast_enabled('cpu'): bad.append('autocast left on')
    cbs = learn._grab_cbs(MasterMixedPrecision)
    for cb in cbs:
        mf = cb.mixed_fit
        if mf.phase.name != 'IDLE' or mf.fits: bad.append(f'fit left {mf.phase.name} ({mf.fits} running)')
    if not learn.lock.acquire(blocking=False): bad.append('learn.lock held')
    else: learn.lock.release()
    from mpcallbacks.fused import ScalerOptFunc, OptimizerWithScaler
    mixed = (bool(learn._grab_cbs(MasterMixedPrecision)), isinstance(learn.opt_func, ScalerOptFunc),
             learn.opt is None or isinstance(learn.opt, OptimizerWithScaler))
    if mixed not in ((True, True, True), (False, False, learn.opt is None)): bad.append(f'half mixed (callback, opt_func, optimizer): {mixed}')
    if not completed:
        same = learn.opt is before['opt'] or getattr(learn.opt, 'opt', None) is before['opt'] or learn.opt is getattr(before['opt'], 'opt', None)
        if not same: bad.append('the optimizer was replaced') # (to_mixed/to_unmixed completed: it wraps or unwraps the same one)
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
    'export_atomic': (lambda: _ckpt(learner(opt=True)), lambda l: l.export_atomic('e.pkl')),
    'load_checked': (lambda: _saved(learner()), lambda l: l.load_checked('m')),
    'to_mixed': (lambda: learner(), lambda l: l.to_mixed(torch.bfloat16)),
    'to_unmixed': (lambda: learner(), lambda l: l.to_unmixed()),
    'precision_report': (lambda: learner(), lambda l: l.precision_report(n_batches=1)),
}

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

def sweep(names, quick:bool) -> dict:
    rows = {}
    for name in names:
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
                if wrong: bad.append((k, j, wrong, repr(err)[:80]))
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
    return rows

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--quick', action='store_true')
    ap.add_argument('--only', default=','.join(ENTRY))
    args = ap.parse_args()
    names = args.only.split(',')
    unknown = [n for n in names if n not in ENTRY]
    if unknown: ap.error(f"--only takes entry points of {list(ENTRY)}, got {unknown}")
    start = time.perf_counter()
    rows = sweep(names, args.quick)
    total = sum(m for m,_,_ in rows.values())
    failing = {k:v for k,v in rows.items() if v[1]}
    lock_only = sum(1 for _,b,_ in rows.values() for x in b if [w for w in x[-2 if len(x) == 4 and isinstance(x[-1], str) else -1] if w != 'learn.lock held'] == [])
    print(f"\n{total} injections in {time.perf_counter() - start:.0f} s; {sum(len(b) for _,b,_ in rows.values())} left the learner not at rest, "
          f"{lock_only} of them with fastai's `learn.lock` alone held (a failed `validation_context` enter: documented)")
    for (name, kind),(made,bad,_) in failing.items():
        print(f"  {name}, {kind}: {len(bad)} of {made}; first: {bad[:3]}")
    sys.exit(len(failing))

if __name__ == '__main__': main()
