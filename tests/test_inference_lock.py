"An inference whose start fails (a Ctrl-C or an error in a before_fit) leaves learn.lock free and the learner as it was"
import pytest, torch
from fastai.basics import Callback
from mpcallbacks.callback import MasterMixedPrecision
from mpcallbacks.test_utils import synth_learner
from intact import assert_fp32_and_intact

class RaisesAtInferenceStart(Callback):
    order = MasterMixedPrecision.order + 1 # (after ours: our before_fit opened the inference)
    def __init__(self, exc): self.exc,self.done = exc,False
    def before_fit(self):
        if not self.training and not self.done:
            self.done = True
            raise self.exc

@pytest.mark.parametrize('exc', [KeyboardInterrupt('at before_fit'), RuntimeError('at before_fit')], ids=['ctrl-c', 'error'])
@pytest.mark.parametrize('entry', ['get_preds', 'validate'])
def test_a_failed_start_of_an_inference_leaves_the_lock_free(entry, exc):
    learn = synth_learner().to_mixed(torch.bfloat16)
    learn.add_cb(RaisesAtInferenceStart(exc))
    logger = learn.logger
    with pytest.raises(type(exc)): getattr(learn, entry)()
    assert learn.lock.acquire(blocking=False), "learn.lock held: the next get_preds would wait for it for good"
    learn.lock.release()
    assert learn.logger is logger and learn.create_mbar # (fastai's no_logging and no_mbar unwound too)
    assert_fp32_and_intact(learn)
    assert getattr(learn, entry)() is not None # (the next one runs)
