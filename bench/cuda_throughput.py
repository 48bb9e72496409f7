"""Section 5 (CUDA only): `bench.gpu`'s throughput table, as `make bench` runs it: ResNet-50 at 224 px and a small GPT on
synthetic data, FP32 (TF32 off), fastai's `to_fp16()` and `to_bf16()`, `to_mixed()` in float16 and bfloat16, every config
with fused AdamW and the AMP ones with fastai's Adam too; throughput, peak memory, the largest batch, host syncs, energy.
`python -m bench.gpu` runs the same table with its preflight checks and the CUDA-only tests, within a time budget."""
from __future__ import annotations
import torch
from .gpu import run_table, throughput_section, tf32_off, sizes_for

def run_cuda_throughput(device, quick:bool=False) -> list:
    "One row per (model, config, optimizer): see `bench.gpu.run_table`; FP32 matmuls and convolutions without TF32 while it runs"
    if torch.device(device).type != 'cuda': raise ValueError(f"run_cuda_throughput needs a CUDA device, got {device!r}")
    with tf32_off(): return run_table(device, sizes=sizes_for['quick' if quick else 'default'])

def cuda_section(rows:list|None) -> str:
    if rows is None: return ('### 5. CUDA throughput\n\nSkipped: no CUDA device here. The last GPU table is in [gpu.md](gpu.md), '
                             'from `python -m bench.gpu` on a GPU machine.')
    return throughput_section(rows, heading='### 5. CUDA throughput: ResNet-50 and a small GPT (TF32 off)')
