"""What a fastai user does out of habit works as `to_mixed()` does: the callback passed in `cbs`, an export loaded where
mpcallbacks is not installed, `summary()`, a deep copy, `plot_loss_scale` around `lr_find`, and near-miss arguments."""
import copy, subprocess, sys, textwrap
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
import pytest, torch
from fastai.basics import Learner, Callback, CrossEntropyLossFlat, Optimizer, Adam, SGD, accuracy
import fastai.callback.schedule, fastai.callback.hook # (`Learner.lr_find`, `Learner.summary`)
from mpcallbacks.all import *
from mpcallbacks.fused import OptimizerWithScaler, scaler_key
from mpcallbacks.digits import digits_dls, digits_cnn
from mpcallbacks.test_utils import synth_learner, InjectNonFinite

def weights(learn): return [p.detach().clone() for p in learn.model.parameters()]

# ---- the callback in `cbs`, as fastai's callbacks are passed

@pytest.mark.parametrize('how', ['Learner(cbs=)', 'fit(cbs=)', 'add_cb'])
def test_the_callback_in_cbs_trains_as_to_mixed_does(tmp_path, how):
    ref = synth_learner(path=tmp_path).to_mixed(torch.float16, init_scale=2.**10)
    ref.fit(2, 1e-2, cbs=InjectNonFinite(at=[3]))
    cb = MasterMixedPrecision(torch.float16, init_scale=2.**10)
    learn = synth_learner(path=tmp_path, cbs=cb if how == 'Learner(cbs=)' else None)
    if how == 'add_cb': learn.add_cb(cb)
    seen = []
    class Look(Callback):
        order = 100
        def before_step(self): seen.append(type(self.learn.opt))
    learn.fit(2, 1e-2, cbs=[InjectNonFinite(at=[3]), Look()] + ([cb] if how == 'fit(cbs=)' else []))
    assert set(seen) == {OptimizerWithScaler} # fastai's Adam stepped by the fused kernels, as to_mixed's
    assert all(torch.equal(a, b) for a, b in zip(weights(learn), weights(ref))) # the same fit, bit for bit
    assert cb.skipped == 1 and cb.loss_scale == ref.master_mixed_precision.loss_scale
    if how == 'fit(cbs=)': # removed with the fit: the learner is as it was
        assert type(learn.opt) is Optimizer and learn.opt_func is Adam and not hasattr(learn, 'master_mixed_precision')
    else: # the scaler travels in the checkpoint
        learn.save('ckpt')
        assert torch.load(tmp_path/'models'/'ckpt.pth', weights_only=False)['opt'][scaler_key]['skipped'] == 1
        learn.remove_cb(cb)
        assert type(learn.opt) is Optimizer and learn.opt_func is Adam

def test_to_mixed_replaces_a_callback_given_in_cbs():
    first = MasterMixedPrecision(torch.float16)
    learn = synth_learner(cbs=first).to_mixed(torch.bfloat16)
    cbs = learn._grab_cbs(MasterMixedPrecision)
    assert len(cbs) == 1 and cbs[0] is not first and first.learn is None
    assert learn.opt_func.scaler is cbs[0].scaler
    learn.fit(1, 1e-2)
    assert learn.opt.scaler is cbs[0].scaler

def test_removing_one_callback_keeps_the_other_ones_scaler():
    a, b = MasterMixedPrecision(torch.float16), MasterMixedPrecision(torch.float16)
    learn = synth_learner()
    learn.add_cb(a); learn.add_cb(b) # (the learner carries the last added)
    learn.remove_cb(a)
    assert learn.opt_func.scaler is b.scaler

# ---- the export

def export_learner(path):
    learn = Learner(digits_dls(), digits_cnn(), loss_func=CrossEntropyLossFlat(), path=path,
                    metrics=[accuracy, LossScale(), SkippedSteps()]).to_mixed(torch.float16) # the README's metrics
    learn.fit(1, 1e-2)
    return learn

def test_an_export_loads_and_predicts_where_mpcallbacks_is_not_installed(tmp_path):
    learn = export_learner(tmp_path)
    learn.export('export.pkl')
    x = learn.dls.valid_ds[0][0]
    expected = learn.model.eval()(x[None]).argmax(1).item()
    torch.save(x, tmp_path/'x.pt')
    code = textwrap.dedent(f"""
        import sys, torch
        sys.modules['mpcallbacks'] = None # not installed: any import of it fails
        from fastai.learner import load_learner
        learn = load_learner({str(tmp_path/'export.pkl')!r})
        pred = learn.predict((torch.load({str(tmp_path/'x.pt')!r}),))
        print('#', sorted(type(c).__module__.split('.')[0] for c in learn.cbs), hasattr(learn, 'master_mixed_precision'))
        print('#', learn.recorder.metric_names[1:-1], learn.opt_func.__name__)
        print('#', int(pred[1]), {{p.dtype for p in learn.model.parameters()}})
        """)
    res = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    cbs, metrics, pred = [l[2:] for l in res.stdout.splitlines() if l.startswith('# ')]
    assert 'mpcallbacks' not in cbs and cbs.endswith('False') # no stand-in callback, no attribute
    assert metrics == "['train_loss', 'valid_loss', 'accuracy', 'loss_scale', 'skipped_steps'] Adam"
    assert pred == f"{expected} {{torch.float32}}"

def test_the_exporting_learner_stays_mixed_and_a_deep_copy_is_mixed(tmp_path):
    learn = export_learner(tmp_path)
    learn.export('export.pkl')
    assert learn.opt.scaler is learn.master_mixed_precision.scaler and learn.opt_func.scaler is learn.opt.scaler
    twin = copy.deepcopy(learn)
    cb = twin.master_mixed_precision
    assert cb is not learn.master_mixed_precision and cb.learn is twin and twin.opt.scaler is cb.scaler
    assert twin.opt_func.scaler is cb.scaler and twin.opt.opt.param_lists[0][0] is next(twin.model.parameters())
    twin.fit(1, 1e-2)
    assert len(cb.scaler.history) == 2 * len(learn.master_mixed_precision.scaler.history)

# ---- what the learner shows

def test_summary_names_the_optimizer_as_the_user_gave_it():
    learn = synth_learner(opt_func=SGD).to_mixed(torch.bfloat16)
    assert f"Optimizer used: {SGD!r}" in learn.summary()

def test_plot_loss_scale_before_any_step_says_so():
    learn = synth_learner().to_mixed(torch.float16)
    with pytest.raises(ValueError, match='no step was taken yet'): learn.plot_loss_scale()

def test_plot_loss_scale_leaves_out_lr_find_steps(tmp_path):
    learn = synth_learner(path=tmp_path).to_mixed(torch.float16)
    learn.lr_find(num_it=20, show_plot=False)
    assert len(learn.master_mixed_precision.scaler.history) == 0 # the learner loaded back as it was, its scaler too
    learn.fit(1, 1e-2)
    n = len(learn.dls.train)
    ax = learn.plot_loss_scale()
    assert ax.get_lines()[0].get_xdata()[-1] == n

def test_plot_loss_scale_keeps_its_labels_inside_the_saved_figure(tmp_path):
    learn = synth_learner().to_mixed(torch.float16)
    learn.fit(1, 1e-2)
    ax = learn.plot_loss_scale()
    fig = ax.figure
    fig.savefig(tmp_path/'scale.png') # (no bbox_inches: the figure as the user saves it)
    box = fig.bbox
    for label in (ax.xaxis.label, ax.yaxis.label):
        b = label.get_window_extent()
        assert box.x0 <= b.x0 and b.x1 <= box.x1 and box.y0 <= b.y0 and b.y1 <= box.y1, label.get_text()
    plt.close(fig)

# ---- near misses get a message that names the fix

def test_keep_fp32_Auto_asks_whether_auto_was_meant():
    with pytest.raises(ValueError, match="keep_fp32='Auto': did you mean 'auto'"): synth_learner().to_mixed(keep_fp32='Auto')

def test_loss_scale_errors_list_every_allowed_value():
    for bad, err in [('Dynamic', ValueError), ('static', ValueError), ([1.], TypeError), (True, TypeError)]:
        with pytest.raises(err, match=r"loss_scale must be 'auto' \(dynamic for float16, None for bfloat16\), 'dynamic', a positive number"):
            synth_learner().to_mixed(torch.float16, loss_scale=bad)

def test_a_second_positional_argument_names_the_keyword():
    with pytest.raises(TypeError, match=r"pass the others by name, e.g. to_mixed\(torch.bfloat16, loss_scale='dynamic'\)"):
        synth_learner().to_mixed(torch.bfloat16, 'dynamic')

def test_the_example_data_on_a_device_named_by_a_string_gives_fastai_a_device():
    # the README's advice for a Mac, `digits_dls(device='cpu')`: fastai's own code reads `dls.device.type`
    for device in ('cpu', torch.device('cpu')):
        dls = digits_dls(device=device)
        assert isinstance(dls.device, torch.device) and dls.device.type == 'cpu'
        assert dls.one_batch()[0].device.type == 'cpu'
