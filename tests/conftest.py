import warnings
import torch
from mpcallbacks.test_utils import synth_dls, synth_model, synth_learner, opt_params, InjectNonFinite # noqa: F401 (the tests' helpers)

warnings.filterwarnings('ignore', message='float16 math is emulated')
torch.set_num_threads(1) # tiny ops: one thread is faster and results do not depend on the thread count
