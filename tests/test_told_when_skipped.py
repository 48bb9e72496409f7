"A fit that skipped steps says so at its end, in one line; a fit that skipped every step raises; a non-finite first loss is said at once"
import math, warnings
import pytest, torch
from fastai.callback.core import Callback
from mpcallbacks.test_utils import synth_learner, InjectNonFinite, lagging_flags
from mpcallbacks.scaler import NonFiniteGradients
from mpcallbacks.callback import SkippedStepsWarning, LossScale, SkippedSteps, MasterMixedPrecision

def skipped_warnings(record): return [str(w.message) for w in record if issubclass(w.category, SkippedStepsWarning)]

class InfLoss(Callback):
    "An inf loss at every training batch, as a broken loss function or inputs would give"
    order = 0
    def after_loss(self):
        if self.training: self.learn.loss_grad = self.loss_grad * float('inf')

@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_some_steps_skipped_one_line_at_the_end(dtype):
    learn = synth_learner().to_mixed(dtype)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter('always')
        learn.fit(1, 1e-2, cbs=InjectNonFinite(at=[1, 4]))
    scale = learn.master_mixed_precision.loss_scale
    assert skipped_warnings(record) == [f"Mixed precision skipped 2 of 8 optimizer steps for inf/NaN gradients; the loss "
                                        f"scale is now {scale:g}. See `learn.plot_loss_scale()`."]

def test_a_fit_without_skips_says_nothing():
    learn = synth_learner().to_mixed(torch.bfloat16)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter('always')
        learn.fit(1, 1e-2)
    assert skipped_warnings(record) == []

def test_the_line_counts_this_fits_skips_only():
    learn = synth_learner().to_mixed(torch.bfloat16)
    learn.fit(1, 1e-2, cbs=InjectNonFinite(at=[0]))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter('always')
        learn.fit(1, 1e-2, cbs=InjectNonFinite(at=[2, 3, 5]))
    assert [m.split(';')[0] for m in skipped_warnings(record)] == ["Mixed precision skipped 3 of 8 optimizer steps for inf/NaN gradients"]

def test_a_short_fit_whose_every_step_overflows_raises():
    "40 float16 steps with an inf loss each: the storm stop needs 41 in a row, yet the fit must not end silently"
    learn = synth_learner().to_mixed(torch.float16) # 8 steps an epoch
    before = [p.detach().clone() for p in learn.model.parameters()]
    with pytest.raises(NonFiniteGradients, match=r"All 40 optimizer steps of this fit .* the loss is inf"):
        learn.fit(5, 1e-2, cbs=InfLoss())
    assert all(torch.equal(a, p) for a, p in zip(before, learn.model.parameters()))
    assert learn.master_mixed_precision.fit_state is None # the fit ended in order

@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
def test_every_step_skipped_by_overflowing_gradients_raises(dtype):
    learn = synth_learner().to_mixed(dtype)
    with pytest.raises(NonFiniteGradients, match="All 8 optimizer steps"):
        learn.fit(1, 1e-2, cbs=InjectNonFinite(at=range(8)))

class NaNInputs(Callback):
    "NaN inputs in every training batch, as a broken data set gives"
    order = -5
    def before_batch(self):
        if self.training: self.learn.xb = (self.xb[0] * float('nan'),)

class WhenSaid(Callback):
    "The training batch (counted over the fit) after which the non-finite loss was first said"
    order = 100
    def __init__(self, record): self.record,self.at = record,None
    def after_batch(self):
        if self.training and self.at is None and any('with a loss of nan' in m for m in skipped_warnings(self.record)): self.at = self.train_iter

@pytest.mark.parametrize('opt,lag', [('fastai Adam', 0), ('torch AdamW', 0), ('fused AdamW', 0), ('fused AdamW', 2)])
def test_nan_inputs_are_said_early(opt, lag):
    "NaN inputs: a warning at the first skipped step, or once its flag has landed on the host (a device `lag` steps behind); long before the storm stop (41 skips in a row for float16)"
    from functools import partial
    from fastai.basics import OptimWrapper
    kw = {'fastai Adam':{}, 'torch AdamW':dict(opt_func=partial(OptimWrapper, opt=torch.optim.AdamW)),
          'fused AdamW':dict(opt_func=partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True)))}[opt]
    learn = synth_learner(**kw).to_mixed(torch.float16)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter('always')
        said = WhenSaid(record)
        with lagging_flags(lag), pytest.raises(NonFiniteGradients, match='the loss is nan'): learn.fit(5, 1e-2, cbs=[NaNInputs(), said])
    assert said.at is not None and said.at <= 1 + lag, said.at
    assert sum('with a loss of nan' in m for m in skipped_warnings(record)) == 1 # said once

def test_the_epoch_table_can_show_the_scale_and_the_skips():
    learn = synth_learner().to_mixed(torch.float16, init_scale=2.**10)
    learn.metrics = [LossScale(), SkippedSteps()]
    learn.fit(2, 1e-2, cbs=InjectNonFinite(at=[1, 2, 9]))
    names = learn.recorder.metric_names
    assert 'loss_scale' in names and 'skipped_steps' in names
    rows = [dict(zip(names[1:-1], v)) for v in learn.recorder.values]
    assert [r['skipped_steps'] for r in rows] == [2, 3] # so far in the fit
    assert [r['loss_scale'] for r in rows] == [2.**8, 2.**7]

def test_the_epoch_table_prints_a_whole_scale_without_decimals():
    # fastai's table prints a float with 6 decimals (65536.000000) and an int as it is
    learn = synth_learner().to_mixed(torch.float16, init_scale=2.**16)
    learn.metrics = [LossScale()]
    learn.fit(1, 1e-2)
    scale = learn.recorder.values[-1][-1]
    assert scale == 2**16 and isinstance(scale, int)
    learn = synth_learner().to_mixed(torch.float16, init_scale=1000.5, growth_interval=10**6)
    learn.metrics = [LossScale()]
    learn.fit(1, 1e-2)
    assert learn.recorder.values[-1][-1] == 1000.5 # a scale that is not whole keeps its decimals

def test_plot_loss_scale_on_the_learner():
    import matplotlib; matplotlib.use('Agg')
    learn = synth_learner().to_mixed(torch.float16, init_scale=2.**10)
    learn.fit(1, 1e-2, cbs=InjectNonFinite(at=[3]))
    ax = learn.plot_loss_scale()
    assert ax.get_ylabel() == 'loss scale' and 'skipped steps (1)' in [t.get_text() for t in ax.get_legend().get_texts()]
    short = MasterMixedPrecision(torch.float16) # three steps: matplotlib's own ticks would be 0, 0.5, 1, ...
    for found_inf in (False, True, False): short.scaler.update(found_inf)
    ticks = short.plot_loss_scale().get_xticks()
    assert all(float(t).is_integer() for t in ticks), ticks # optimizer steps are whole

@pytest.mark.parametrize('dtype,opt,lag', [(torch.float16, 'fastai Adam', 0), (torch.float16, 'fused AdamW', 0),
                                           (torch.float16, 'fused AdamW', 2), (torch.bfloat16, 'fastai Adam', 0)])
def test_a_run_of_skips_begun_by_a_nan_loss_names_that_loss_first(dtype, opt, lag):
    "Stopped by max_consecutive_skips, a run of skips whose first step's loss was NaN says so as its first likely cause"
    from functools import partial
    from fastai.basics import OptimWrapper
    kw = dict(opt_func=partial(OptimWrapper, opt=partial(torch.optim.AdamW, fused=True))) if opt == 'fused AdamW' else {}
    learn = synth_learner(**kw).to_mixed(dtype, max_consecutive_skips=20)
    with warnings.catch_warnings(), lagging_flags(lag), pytest.raises(NonFiniteGradients) as e:
        warnings.simplefilter('ignore')
        learn.fit(5, 1e-2, cbs=NaNInputs())
    msg = str(e.value)
    assert msg.startswith('20 optimizer steps in a row'), msg
    assert msg.split('Likely causes: ')[1].startswith('the loss was nan at the first of them, which no loss scale fixes'), msg

def test_a_run_of_skips_with_a_finite_loss_names_no_loss():
    "Overflowing gradients with finite losses: the stop message keeps its causes, and speaks of no loss"
    learn = synth_learner().to_mixed(torch.float16, max_consecutive_skips=20)
    with warnings.catch_warnings(), pytest.raises(NonFiniteGradients) as e:
        warnings.simplefilter('ignore')
        learn.fit(5, 1e-2, cbs=InjectNonFinite(at=range(40)))
    msg = str(e.value)
    assert msg.startswith('20 optimizer steps in a row') and 'the loss was' not in msg, msg
    assert 'the loss or the inputs/targets are non-finite' in msg, msg
