import warnings
import pytest, torch
from mpcallbacks.test_utils import synth_dls, synth_model, synth_learner, opt_params, InjectNonFinite # noqa: F401 (the tests' helpers)

warnings.filterwarnings('ignore', message='float16 math is emulated')
torch.set_num_threads(1) # tiny ops: one thread is faster and results do not depend on the thread count

# Known defects: reproductions of what is still open, expected to fail. `strict`: once fixed, each fails as XPASS, so its
# entry here goes with the fix.
writes = "issue 12 item 3: writes to the 16-bit copies during a fit (weight constraints, WGAN clipping) do not reach the masters yet"
known_defects = {
    'test_applications.py::test_family_trains_as_in_fp32[wgan]': writes,
    'test_applications.py::test_wgan_generator_moves_and_fp32_critic_is_clipped_as_in_fp32[0.01]': writes,
    'test_applications.py::test_wgan_generator_moves_and_fp32_critic_is_clipped_as_in_fp32[0.05]': writes,
    **{f'test_changes_to_the_model_during_fit.py::test_weight_constraint_written_by_a_callback_holds_on_the_fp32_model_after_fit[{c}-{e}]': writes
       for c in ('clamp-0.03', 'max_norm-0.5') for e in ('after_step', 'after_batch')},
    'test_tensors_made_in_forward.py::test_fp32_tensors_made_in_forward_train_as_in_fp32[PositionsTimesOwnWeight]':
        "issue 12 item 4: an FP32 tensor made in forward that meets a module's own 16-bit weight inside that module's forward",
}

def pytest_collection_modifyitems(items):
    for item in items:
        reason = known_defects.get(f'{item.path.name}::{item.name}')
        if reason: item.add_marker(pytest.mark.xfail(strict=True, reason=reason))
