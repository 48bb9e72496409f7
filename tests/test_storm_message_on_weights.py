"The storm stop's note on non-finite weights is true: a step with finite gradients and a huge learning rate writes them, and the message says a step can."
import pytest, torch
from mpcallbacks.all import NonFiniteGradients
from mpcallbacks.test_utils import synth_learner

def test_weights_a_step_overflowed_are_not_said_to_come_from_no_step():
    learn = synth_learner().to_mixed(torch.bfloat16, max_consecutive_skips=3)
    with pytest.raises(NonFiniteGradients) as e: learn.fit(2, 1e38) # the first step's update overflows float32
    runs = learn.master_mixed_precision.scaler.history.runs
    assert runs[0][1] is False, f"a step went ahead first and wrote the weights: {runs}"
    msg = str(e.value)
    assert 'weights are themselves inf or NaN' in msg and 'no step of mixed precision wrote' not in msg
    assert 'A step writes them' in msg and 'learning rate' in msg
