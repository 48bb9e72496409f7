import warnings
import pytest, torch
from mpcallbacks.test_utils import synth_dls, synth_model, synth_learner, opt_params, InjectNonFinite # noqa: F401 (the tests' helpers)

warnings.filterwarnings('ignore', message='float16 math is emulated')
torch.set_num_threads(1) # tiny ops: one thread is faster and results do not depend on the thread count

# Known defects: reproductions of what is still open, expected to fail. `strict`: once fixed, each fails as XPASS, so its
# entry here goes with the fix.
known_defects = {
    'test_tensors_made_in_forward.py::test_fp32_tensors_made_in_forward_train_as_in_fp32[PositionsTimesOwnWeight]':
        "issue 12 item 4: an FP32 tensor made in forward that meets a module's own 16-bit weight inside that module's forward",
}

def pytest_collection_modifyitems(items):
    for item in items:
        reason = known_defects.get(f'{item.path.name}::{item.name}')
        if reason: item.add_marker(pytest.mark.xfail(strict=True, reason=reason))
