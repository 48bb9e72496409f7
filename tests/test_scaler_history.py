"The loss-scale history stays small over a learner's life, and `plot_loss_scale` still draws the trajectory."
import pickle
import pytest, torch
from mpcallbacks.all import LossScaler
from mpcallbacks.test_utils import synth_learner, InjectNonFinite

@pytest.mark.parametrize('dynamic', [True, False], ids=['dynamic', 'static'])
def test_history_stays_small_after_100k_steps(dynamic):
    scaler = LossScaler(2.**8, dynamic=dynamic, growth_interval=2000)
    for _ in range(100_000): scaler.update(False)
    size = len(pickle.dumps(scaler))
    assert size < 20_000, f"a scaler after 100,000 steps pickles to {size:,} bytes"

def step_values(ax):
    "The y value the plotted line has at each integer step (a step plot drawn 'post', or one point per step)"
    line, = ax.get_lines()
    xs, ys = list(line.get_xdata()), list(line.get_ydata())
    return lambda i: ys[max(j for j, x in enumerate(xs) if x <= i)]

def test_plot_draws_the_trajectory():
    learn = synth_learner().to_mixed(torch.float16, init_scale=2.**10, growth_interval=2)
    learn.fit(1, 1e-2, cbs=InjectNonFinite(at=[1, 5])) # 8 steps: 2^10, skip -> 2^9, 2^9, 2^9 -> 2^10, 2^10, skip -> 2^9 ...
    expected = [2.**10, 2.**10, 2.**9, 2.**9, 2.**10, 2.**10, 2.**9, 2.**9] # the scale each step used
    ax = learn.master_mixed_precision.plot_loss_scale()
    at = step_values(ax)
    assert [at(i) for i in range(8)] == expected
    marks = [tuple(o) for c in ax.collections for o in c.get_offsets().tolist()]
    assert sorted(marks) == [(1, 2.**10), (5, 2.**10)] # the skipped steps, at the scale they used

def test_plot_after_100k_steps_ends_at_the_current_scale():
    learn = synth_learner().to_mixed(torch.float16, init_scale=2.**10, growth_interval=2)
    learn.fit(1, 1e-2, cbs=InjectNonFinite(at=[1]))
    scaler = learn.master_mixed_precision.scaler
    for i in range(100_000): scaler.update(i % 50_000 == 0) # two more skips, far apart
    ax = learn.master_mixed_precision.plot_loss_scale()
    line, = ax.get_lines()
    assert list(line.get_ydata())[-1] == learn.master_mixed_precision.loss_scale
