"The package's own example data exports with a learner: `learn.export()` of a `digits_dls` learner, mixed or not, loads back with fastai's `load_learner` and predicts."
import pytest, torch
from fastai.basics import Learner, CrossEntropyLossFlat, load_learner
from mpcallbacks.all import *
from mpcallbacks.digits import digits_dls, digits_cnn

pytest.importorskip('sklearn')

@pytest.mark.parametrize('mixed', [False, True])
def test_a_digits_learner_exports_and_its_export_predicts(tmp_path, mixed):
    dls = digits_dls()
    learn = Learner(dls, digits_cnn(), loss_func=CrossEntropyLossFlat(), path=tmp_path)
    if mixed: learn.to_mixed(torch.bfloat16)
    learn.fit(1, 1e-2)
    x, y = dls.valid_ds[0]
    expected = learn.model.eval()(x[None]).argmax(1).item()
    learn.export_atomic('export.pkl') if mixed else learn.export('export.pkl') # raised 'list' object has no attribute 'new_empty'
    assert len(learn.dls.train_ds) > 0, "the learner keeps its data"
    loaded = load_learner(tmp_path/'export.pkl')
    pred, idx, probs = loaded.predict((x,))
    assert probs.shape == (10,) and int(idx) == expected
