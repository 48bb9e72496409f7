import warnings
import pytest, torch
import mpcallbacks.all # noqa: F401 (`Learner.to_mixed` and the checkpoint methods, for every test)
from mpcallbacks.cuda_rules import like_cuda
from mpcallbacks.test_utils import synth_dls, synth_model, synth_learner, opt_params, InjectNonFinite # noqa: F401 (the tests' helpers)

warnings.filterwarnings('ignore', message='float16 math is emulated')
torch.set_num_threads(1) # tiny ops: one thread is faster and results do not depend on the thread count

# Known limits: reproductions of what does not work yet, expected to fail (documented under "Limits" in
# nbs/14_supported.ipynb). `strict`: once it works, each fails as XPASS, so its entry here goes with the change.
known_defects = {}

def pytest_collection_modifyitems(items):
    for item in items:
        reason = known_defects.get(f'{item.path.name}::{item.name}')
        if reason: item.add_marker(pytest.mark.xfail(strict=True, reason=reason))

def pytest_configure(config):
    config.addinivalue_line('markers', "cpu_rules(*rules): run the test without these of CUDA's rules (`like_cuda`'s names; none "
                            "given: without any), where it checks what a CPU itself does")

@pytest.fixture(autouse=True)
def cuda_rules(request):
    "Every test runs with the CPU behaving as CUDA does where the two differ (`mpcallbacks.cuda_rules.like_cuda`)"
    marker = request.node.get_closest_marker('cpu_rules')
    off = set(marker.args) if marker and marker.args else {'kernels', 'memory', 'flatten', 'flags'} if marker else set()
    with like_cuda({'kernels', 'memory', 'flatten', 'flags'} - off): yield
    on = [d for d in ('cpu', 'cuda') if torch.is_autocast_enabled(d)]
    for d in on: torch.set_autocast_enabled(d, False) # (so that the next test starts as every test does)
    assert not on, f"the test left autocast on for {on}"
