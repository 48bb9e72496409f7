"""Inference after a mixed-precision fit gives the same predictions on the live learner and on the exported one. The default encoded here: outside a fit the live learner predicts in FP32, with the FP32 model the fit left (as
the exported learner does); `get_preds`/`validate` do not cast the model."""
import pytest, torch
from fastai.basics import Callback, Learner, DataLoaders, CrossEntropyLossFlat, load_learner
from mpcallbacks.test_utils import synth_model
from like_fp32 import fit_once

class TensorPairs(torch.utils.data.Dataset):
    "Inputs and targets; `new_empty` lets fastai's `export` keep an empty copy"
    def __init__(self, x, y): self.x, self.y = x, y
    def __len__(self): return len(self.x)
    def __getitem__(self, i): return self.x[i], self.y[i]
    def new_empty(self): return type(self)(self.x[:0], self.y[:0])

def exportable_learner():
    "synth_learner's data and model, in datasets fastai can export"
    x = torch.randn(320, 1, 8, 8)
    y = (x[:, 0, :4].mean((1, 2)) > 0).long()
    dls = DataLoaders.from_dsets(TensorPairs(x[:256], y[:256]), TensorPairs(x[256:], y[256:]), bs=32, num_workers=0, device='cpu')
    return Learner(dls, synth_model(), loss_func=CrossEntropyLossFlat())

class ParamDtypes(Callback):
    "The dtypes of the model's parameters during each batch of an inference call"
    def __init__(self): self.seen = set()
    def before_batch(self): self.seen |= {p.dtype for p in self.learn.model.parameters()}

def plain_fp32_preds(model, dl) -> torch.Tensor:
    "Softmax of the FP32 model's outputs on `dl`, in eval mode, with nothing of fastai or ours in the way"
    model.eval()
    with torch.no_grad(): return torch.cat([torch.softmax(model(xb), 1) for xb, _ in dl])

@pytest.fixture(scope='module')
def mixed_fit():
    return fit_once(exportable_learner, dict(dtype=torch.bfloat16), 2, 1e-2)

def test_get_preds_after_fit_runs_the_fp32_model(mixed_fit):
    learn = mixed_fit.learn
    seen = ParamDtypes()
    learn.get_preds(cbs=seen)
    assert seen.seen == {torch.float32}, f"get_preds after fit ran the model as {seen.seen}"

def test_live_and_exported_learner_predict_the_same(mixed_fit, tmp_path):
    learn = mixed_fit.learn
    dl = learn.dls.valid
    live, targs = learn.get_preds(dl=dl)
    live_loss = float(learn.validate(dl=dl)[0])
    learn.path = tmp_path
    learn.export('export.pkl')
    loaded = load_learner(tmp_path/'export.pkl', cpu=True)
    assert not any(type(cb).__name__ == 'MasterMixedPrecision' for cb in loaded.cbs) # the export infers in FP32
    exported, _ = loaded.get_preds(dl=dl)
    torch.testing.assert_close(live, exported, rtol=0, atol=1e-6, msg=lambda m: f"live vs exported predictions: {m}")
    torch.testing.assert_close(live, plain_fp32_preds(learn.model, dl), rtol=0, atol=1e-6,
                               msg=lambda m: f"live predictions vs the FP32 model's own: {m}")
    exported_loss = float(loaded.validate(dl=dl)[0])
    assert abs(live_loss - exported_loss) <= 1e-6, f"validate: live {live_loss}, exported {exported_loss}"

# ---- tta runs the model as get_preds does, in both settings (it always ran FP32)

class ForwardDtypes(Callback):
    "What the model's layers with parameters computed in, as each forward of an inference call ran them"
    def __init__(self): self.seen = set()
    def before_fit(self):
        def look(m, args, out):
            if isinstance(out, torch.Tensor) and out.is_floating_point(): self.seen.add(out.dtype)
        self.handles = [m.register_forward_hook(look) for m in self.learn.model.modules() if next(m.parameters(recurse=False), None) is not None]
    def after_fit(self):
        for h in self.handles: h.remove()

@pytest.mark.parametrize('mixed_inference', [False, True])
def test_tta_runs_the_model_as_get_preds_does(mixed_inference):
    from test_entry_points import block_learner # fastai Datasets: tta switches their split
    from intact import assert_at_rest, hook_ids
    learn = block_learner().to_mixed(torch.bfloat16, mixed_inference=mixed_inference)
    learn.fit(1, 1e-2)
    hooks = hook_ids(learn.model)
    look = ForwardDtypes()
    learn.get_preds(cbs=look)
    via_get_preds, look.seen = look.seen, set()
    learn.add_cb(look)
    learn.tta(n=2)
    learn.remove_cb(look)
    assert via_get_preds == ({torch.bfloat16} if mixed_inference else {torch.float32}) # (BatchNorm's FP32 kernel too: 16-bit output)
    assert look.seen == via_get_preds, f"tta ran the model as {look.seen}, get_preds as {via_get_preds}"
    assert_at_rest(learn, hooks)
