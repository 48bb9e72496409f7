"Every test runs with the CPU behaving as CUDA does where the two differ (`mpcallbacks.cuda_rules`): each rule still acts."
from collections import Counter
import pytest, torch
import torch.nn.functional as F
from torch import nn
from mpcallbacks.scaler import LossScaler, InFlightFlag
from mpcallbacks.test_utils import count_syncs

x,w,b = torch.randn(4, 8, dtype=torch.bfloat16),torch.ones(8),torch.zeros(8)

def test_a_norm_kernel_refuses_16bit_input_with_fp32_weights_unless_autocast_upcasts_it():
    with pytest.raises(RuntimeError, match='expected scalar type BFloat16 but found Float'): nn.LayerNorm(8)(x)
    with pytest.raises(RuntimeError, match='expected scalar type Half but found Float'): nn.GroupNorm(2, 8)(x.half().view(4, 8, 1))
    with torch.autocast('cpu', torch.bfloat16): assert nn.LayerNorm(8)(x).dtype == torch.float32 # CUDA's autocast: FP32

def test_autocast_runs_cudas_fp32_ops_in_fp32_and_refuses_binary_cross_entropy():
    with torch.autocast('cpu', torch.bfloat16):
        assert [x.softmax(-1).dtype, x.exp().dtype, x.sum().dtype, F.linear(x, w.view(1, 8)).dtype] == [torch.float32]*3 + [torch.bfloat16]
        with pytest.raises(RuntimeError, match='unsafe to autocast'): F.binary_cross_entropy(torch.rand(3), torch.rand(3))

def test_empty_memory_is_recycled_and_rnn_weights_are_flattened_by_cudnn():
    assert torch.empty(3).isnan().all()
    assert len({w.untyped_storage().data_ptr() for w in nn.LSTM(4, 4).half()._flat_weights}) == 1

def test_flags_land_a_step_late_in_pinned_host_memory():
    assert LossScaler.flag_type is not InFlightFlag
    s = LossScaler(2.**10)
    with count_syncs() as n:
        for _ in range(3): s.update(torch.zeros(()))
        assert s.pending_steps == 1 and sum(n.values()) == 0

@pytest.mark.cpu_rules
def test_without_the_rules_the_cpu_forgives():
    assert nn.LayerNorm(8)(x).dtype == torch.bfloat16 # the CPU's kernel takes mixed types
    assert len({w.untyped_storage().data_ptr() for w in nn.LSTM(4, 4).half()._flat_weights}) == 4
    assert LossScaler.flag_type is InFlightFlag

@pytest.mark.cpu_rules('kernels')
def test_one_rule_off_leaves_the_others_on():
    assert nn.LayerNorm(8)(x).dtype == torch.bfloat16
    assert torch.empty(3).isnan().all()
