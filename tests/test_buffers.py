"A running statistic a model keeps by hand in a buffer stays FP32 and accumulates as in FP32, instead of overflowing in 16 bits."
import pytest, torch
from torch import nn
from fastai.basics import Learner, DataLoaders, CrossEntropyLossFlat, set_seed
from fastai.callback.progress import ProgressCallback
from intact import assert_fp32_and_intact, hook_ids

class RunningRMSNorm(nn.Module):
    "Divide the input by the root mean square of all inputs seen in training: raw data, normalized by a statistic kept by hand"
    def __init__(self):
        super().__init__()
        self.register_buffer('sumsq', torch.zeros(()))
        self.register_buffer('count', torch.zeros(()))
    def forward(self, x):
        if self.training:
            self.sumsq += (x.float()**2).sum()
            self.count += x.numel()
        return x / (self.sumsq / self.count.clamp(min=1)).sqrt().clamp(min=1e-3)

def raw_data_learner():
    "The synthetic problem with unnormalized inputs (std 16): one batch's sum of squares is about 500,000"
    torch.manual_seed(0)
    x = 16 * torch.randn(320, 1, 8, 8); y = (x[:, 0, :4].mean((1, 2)) > 0).long()
    ds = list(zip(x, y)); set_seed(0)
    dls = DataLoaders.from_dsets(ds[:256], ds[256:], bs=32, num_workers=0, device='cpu')
    torch.manual_seed(0)
    model = nn.Sequential(RunningRMSNorm(), nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8*8*8, 2))
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat())
    learn.remove_cb(ProgressCallback)
    return learn

@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16], ids=['float16', 'bfloat16'])
def test_hand_kept_running_statistic_accumulates_in_fp32(dtype):
    fp32 = raw_data_learner(); fp32.fit(2, 1e-2)
    learn = raw_data_learner().to_mixed(dtype)
    hooks = hook_ids(learn.model)
    learn.fit(2, 1e-2)
    got, want = learn.model[0].sumsq, fp32.model[0].sumsq
    assert got.dtype == torch.float32 and learn.model[0].count.dtype == torch.float32
    assert torch.isfinite(got), f"the statistic overflowed to {got.item()} ({learn.master_mixed_precision.skipped} steps skipped, no message)"
    assert abs(got.item() - want.item()) <= 1e-3 * want.item(), f"{got.item():.7g} vs FP32 {want.item():.7g}"
    assert learn.model[0].count.item() == fp32.model[0].count.item()
    losses = [float(l) for l in learn.recorder.losses]
    assert sum(losses[-4:]) < 0.9 * sum(losses[:4]), f"did not learn: {losses[:4]} ... {losses[-4:]}"
    valid, valid32 = learn.recorder.values[-1][1], fp32.recorder.values[-1][1]
    assert valid <= 1.1 * valid32, f"validation loss {valid:.3f} vs FP32 {valid32:.3f}"
    assert_fp32_and_intact(learn, hooks)
