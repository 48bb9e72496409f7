"""The invariant at once, whatever ends a call: a second Ctrl-C while the first unwinds, an error between the backward and
the step; and learners fitting in several threads at once, each in its own type."""
import sys, threading
import pytest, torch
from torch import nn
from fastai.basics import Callback
from mpcallbacks.all import MasterMixedPrecision
from mpcallbacks.mixed_fit import FitPhase
from mpcallbacks.test_utils import synth_learner
from intact import assert_at_rest, assert_fp32_and_intact, RaiseOnce

class SecondInterrupt:
    "A tracer that raises a KeyboardInterrupt at the `k`-th line run in the package's `file` once `armed` (the first one raised)"
    def __init__(self, k:int, file:str='mpcallbacks/mixed_fit.py'): self.k,self.file,self.armed,self.n,self.fired = k,file,False,0,False
    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.endswith(self.file): return None
        return self.line
    def line(self, frame, event, arg):
        if event == 'line' and self.armed and not self.fired:
            self.n += 1
            if self.n == self.k:
                self.fired = True
                raise KeyboardInterrupt('second')
        return self.line

class FirstInterrupt(Callback):
    "Raise a KeyboardInterrupt at the first training batch's `after_backward`, and arm the second"
    def __init__(self, second): self.second = second
    def after_backward(self):
        self.second.armed = True
        raise KeyboardInterrupt('first')

@pytest.mark.parametrize('k', range(1, 13))
def test_a_second_ctrl_c_while_the_first_unwinds_still_closes_the_fit(k):
    "The k-th line of the fit's lifetime code run after the first Ctrl-C gets a second one: the fit closes all the same, at once"
    learn = synth_learner().to_mixed(torch.float16)
    second = SecondInterrupt(k)
    sys.settrace(second)
    threading.settrace(second)
    try:
        with pytest.raises(KeyboardInterrupt): learn.fit(1, 1e-2, cbs=FirstInterrupt(second))
    finally: sys.settrace(None); threading.settrace(None)
    mf = learn.master_mixed_precision.mixed_fit
    assert (mf.phase, mf.fits, mf.cast) == (FitPhase.IDLE, 0, None), (k, second.fired, mf.phase, mf.fits)
    assert all(p.grad is None for p in learn.model.parameters())
    assert_fp32_and_intact(learn)

def test_an_error_between_the_backward_and_the_step_leaves_no_gradient_for_the_next_fit():
    "The step that never came drops its gradients, which the next fit would otherwise add to its first step's"
    learn = synth_learner().to_mixed(torch.bfloat16)
    with pytest.raises(RuntimeError, match='boom'): learn.fit(1, 1e-2, cbs=RaiseOnce('before_step', RuntimeError('boom'), order=5))
    assert all(p.grad is None for p in learn.model.parameters())
    assert_fp32_and_intact(learn)

class OutputDtypes(Callback):
    "What the model's first layer computed in, at each training batch (in the fit's own thread)"
    def __init__(self): self.seen,self.threads = set(),set()
    def before_fit(self): self.h = self.learn.model[0].register_forward_hook(self.look)
    def look(self, m, args, out):
        if self.training: self.seen.add(out.dtype); self.threads.add(threading.get_ident())
    def after_fit(self): self.h.remove()

def test_learners_fitting_in_several_threads_at_once_each_compute_in_their_own_type():
    "A float16, a bfloat16 and an FP32 learner, each fit in a thread of its own, all at once: no leak, no crash"
    learns = [synth_learner().to_mixed(torch.float16), synth_learner().to_mixed(torch.bfloat16), synth_learner()]
    looks,errors = [OutputDtypes() for _ in learns],[]
    barrier = threading.Barrier(len(learns))
    def run(learn, look):
        try:
            barrier.wait()
            learn.fit(2, 1e-2, cbs=look)
        except BaseException as e: errors.append(e)
    threads = [threading.Thread(target=run, args=a) for a in zip(learns, looks)]
    for t in threads: t.start()
    for t in threads: t.join(300)
    assert not errors, errors
    assert [l.seen for l in looks] == [{torch.float16}, {torch.bfloat16}, {torch.float32}]
    assert len({t for l in looks for t in l.threads}) == 3
    for learn in learns: assert_at_rest(learn)
    assert not torch.is_autocast_enabled('cpu')

def test_a_16bit_inference_beside_a_fit_in_another_thread_is_that_of_the_call_alone():
    "get_preds in 16 bits in one thread while another learner fits: the same predictions as the same call alone"
    fit_learn = synth_learner().to_mixed(torch.float16)
    pred_learn = synth_learner().to_mixed(torch.bfloat16, mixed_inference=True)
    alone = pred_learn.get_preds()[0]
    done = threading.Event()
    def fit():
        try: fit_learn.fit(3, 1e-2)
        finally: done.set()
    t = threading.Thread(target=fit)
    t.start()
    beside = []
    while not done.is_set() or not beside: beside.append(pred_learn.get_preds()[0])
    t.join(300)
    assert all(torch.equal(b, alone) for b in beside), len(beside)
    assert_at_rest(fit_learn); assert_at_rest(pred_learn)

# ---- the precision report leaves the learner as it was, however it is cut short

def bn_state(learn): return {n:b.clone() for n,b in learn.model.named_buffers()}

@pytest.mark.parametrize('at', [1, 2, 3])
def test_a_ctrl_c_while_the_report_registers_its_probe_leaves_no_hook(at, monkeypatch):
    "The at-th hook the probe registers raises a Ctrl-C: none of its hooks stays, and the BatchNorm statistics are as they were"
    from intact import hook_ids
    learn = synth_learner()
    hooks,before = hook_ids(learn.model),bn_state(learn)
    register,n = nn.Module.register_forward_pre_hook,[0]
    def interrupted(self, *args, **kwargs):
        n[0] += 1
        if n[0] == at: raise KeyboardInterrupt
        return register(self, *args, **kwargs)
    monkeypatch.setattr(nn.Module, 'register_forward_pre_hook', interrupted)
    with pytest.raises(KeyboardInterrupt): learn.precision_report(torch.float16, n_batches=1)
    monkeypatch.undo()
    assert hook_ids(learn.model) == hooks
    assert all(torch.equal(b, before[k]) for k,b in bn_state(learn).items())
    learn.model(torch.randn(2, 1, 8, 8)) # (a forward reruns no module: the statistics move once, as FP32's)

class Interrupts:
    "A tracer: a KeyboardInterrupt at the `first`-th line run in `file`, and a second at the `second`-th line after it"
    def __init__(self, first:int, second:int, file:str): self.first,self.second,self.file,self.n,self.fired = first,second,file,0,0
    def __call__(self, frame, event, arg): return self.line if frame.f_code.co_filename.endswith(self.file) else None
    def line(self, frame, event, arg):
        if event != 'line' or self.fired == 2: return self.line
        self.n += 1
        if self.n in (self.first, self.first + self.second):
            self.fired += 1
            raise KeyboardInterrupt(f'#{self.fired}')
        return self.line

@pytest.mark.parametrize('second', [1, 3, 6, 10, 15])
@pytest.mark.parametrize('first', [40, 400])
def test_a_double_ctrl_c_in_the_report_leaves_the_learner_as_it_was(first, second):
    "A Ctrl-C in the middle of the measure and a second while it unwinds: no hook stays, the statistics and the model are as before"
    from intact import hook_ids
    learn = synth_learner()
    hooks,before = hook_ids(learn.model),bn_state(learn)
    tracer = Interrupts(first, second, 'mpcallbacks/doctor.py')
    sys.settrace(tracer)
    try:
        with pytest.raises(KeyboardInterrupt): learn.precision_report(torch.float16, n_batches=1)
    finally: sys.settrace(None)
    assert tracer.fired >= 1
    assert hook_ids(learn.model) == hooks
    assert all(torch.equal(b, before[k]) for k,b in bn_state(learn).items())
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32} and not torch.is_autocast_enabled('cpu')

# ---- to_mixed and to_unmixed are whole: the callback and its optimizer wrapper go together

def mixed_state(learn) -> tuple: # (the callback is on, the opt_func carries the scaler, the optimizer does)
    from mpcallbacks.fused import ScalerOptFunc, OptimizerWithScaler
    return (bool(learn._grab_cbs(MasterMixedPrecision)), isinstance(learn.opt_func, ScalerOptFunc), isinstance(learn.opt, OptimizerWithScaler))

@pytest.mark.parametrize('call', ['to_mixed', 'to_mixed_again', 'to_unmixed'])
@pytest.mark.parametrize('k', range(1, 30, 2))
def test_a_ctrl_c_inside_to_mixed_or_to_unmixed_leaves_it_whole(call, k):
    "A Ctrl-C at the k-th line of the learner module's code: the learner is mixed or not, never a callback without its optimizer wrapper or the reverse"
    learn = synth_learner()
    learn.create_opt()
    if call != 'to_mixed': learn.to_mixed(torch.bfloat16)
    tracer = Interrupts(k, 10**6, 'mpcallbacks/learner.py')
    sys.settrace(tracer)
    try:
        if call == 'to_unmixed': learn.to_unmixed()
        else: learn.to_mixed(torch.float16)
    except KeyboardInterrupt: pass
    finally: sys.settrace(None)
    assert mixed_state(learn) in ((True, True, True), (False, False, False)), (k, tracer.fired, mixed_state(learn))
    assert len(learn._grab_cbs(MasterMixedPrecision)) <= 1
    assert_fp32_and_intact(learn)
