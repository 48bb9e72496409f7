"""What the inf/NaN check of one step costs on a GPU, against a whole step: bench.gpu's GPT (52M parameters, 77 tensors),
its FP32 gradients checked by `LossScaler.unscale_` at bfloat16's scale of 1 and at a float16 scale, by torch's fused
kernel alone, and by foreach norms; the GPU time (CUDA events) and the host time of each, median of 50.

On a CUDA machine, from the repository root, with the wheels of tools/gpu_wheels.sh on PYTHONPATH (and `.`):
`python3 bench/gpu_unscale_probe.py`. Its output on an H200 is in bench/results/gpu_unscale_probe.txt."""
import torch, statistics, sys
from torch.nn import functional as F
from mpcallbacks.scaler import LossScaler
from bench.gpu import GPT
dev = 'cuda'
m = GPT().to(dev)
ps = [p for p in m.parameters()]
grads = [torch.randn_like(p) for p in ps]
print('params', sum(p.numel() for p in ps), 'tensors', len(ps), 'large', sum(p.numel() >= 2**16 for p in ps))
def timeit(f, n=50):
    for _ in range(5): f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a,b = torch.cuda.Event(enable_timing=True),torch.cuda.Event(enable_timing=True)
        a.record(); f(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)
import time
def host(f, n=50):
    for _ in range(5): f()
    torch.cuda.synchronize(); t=time.perf_counter()
    for _ in range(n): f()
    h=(time.perf_counter()-t)/n*1e3; torch.cuda.synchronize(); return h
bf = LossScaler.from_loss_scale(torch.bfloat16)
f16 = LossScaler.from_loss_scale(torch.float16, 'dynamic', init_scale=1024.)
one = torch.ones((), device=dev)
alts = {
 'unscale_ bf16 (scale 1: sums of large, foreach of small)': lambda: bf.unscale_(grads),
 'unscale_ f16 (foreach check+unscale all)': lambda: f16.unscale_(grads),
 'foreach check+unscale, inv 1, all': lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros((), device=dev), one),
 'foreach_norm ord 1 -> stack isfinite': lambda: torch.stack(torch._foreach_norm(grads, 1)).isfinite().all(),
 'foreach_norm ord inf -> stack isfinite': lambda: torch.stack(torch._foreach_norm(grads, float('inf'))).isfinite().all(),
}
for k,f in alts.items(): print(f"{k}: GPU {timeit(f):.3f} ms, host {host(f):.3f} ms")
# NaN / inf semantics of the foreach norms on CUDA
for bad in (float('nan'), float('inf'), -float('inf')):
    g = [t.clone() for t in grads[:3]]; g[1].view(-1)[12345] = bad
    print('bad', bad, 'norm1', torch.stack(torch._foreach_norm(g, 1)).isfinite().all().item(), 'norminf', torch.stack(torch._foreach_norm(g, float('inf'))).isfinite().all().item())
# a bf16 autocast training step of the GPT at bs 32, for scale
opt = torch.optim.AdamW(m.parameters(), fused=True)
x = torch.randint(0, 32000, (32, 512), device=dev)
def step():
    with torch.autocast('cuda', dtype=torch.bfloat16): out = m(x)
    loss = F.cross_entropy(out.float().view(-1, 32000), x.view(-1))
    loss.backward(); opt.step(); opt.zero_grad()
print(f"bf16 autocast GPT step: GPU {timeit(step, 20):.2f} ms")
