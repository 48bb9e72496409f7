"PNG plots of the benchmark's sections, written next to results.md."
from __future__ import annotations
from pathlib import Path
import matplotlib
matplotlib.use('Agg') # no display: files only
import matplotlib.pyplot as plt
import numpy as np

def _grouped_bars(ax, groups:list, series:dict, ylabel:str, log:bool=False):
    "One cluster of bars per group, one bar per series (series -> values in group order)"
    x,width = np.arange(len(groups)),0.8 / max(1, len(series))
    for i,(name,vals) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, label=name)
    ax.set_xticks(x, groups, fontsize=8)
    ax.set_ylabel(ylabel)
    if log: ax.set_yscale('log')
    ax.legend(fontsize=7)

def _save(fig, path:Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

def plot_bookkeeping(rows:list, out:Path) -> Path:
    variants = list(rows[0]['ms'])
    fig,ax = plt.subplots(figsize=(9, 4))
    _grouped_bars(ax, variants, {f"{r['model']} ({r['tensors']} tensors)": [r['ms'][v] for v in variants] for r in rows}, 'ms per step (median)')
    ax.tick_params(axis='x', labelrotation=25)
    ax.set_title('1. Master-weight bookkeeping, float16')
    return _save(fig, out/'bookkeeping.png')

def plot_whole_step(rows:list, bound:dict, out:Path) -> Path:
    configs = list(rows[0]['ms'])
    fig,(ax1,ax2) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw=dict(width_ratios=[3, 1]))
    _grouped_bars(ax1, [f"{r['model']}\n{r['dtype']}" for r in rows], {c:[r['ms'][c] for r in rows] for c in configs},
                  'ms per training step (median)', log=True)
    ax1.set_title('2. Whole training step (fastai AMP trains FP32 on CPU)')
    names = list(bound['ms'])
    ax2.bar(range(len(names)), [bound['ms'][n] for n in names], color=['C0', 'C1', 'C3'][:len(names)])
    ax2.set_xticks(range(len(names)), [n.replace(' (', '\n(') for n in names], fontsize=7)
    ax2.set_ylabel('ms per training step (median)')
    ax2.set_title('202 tensors, SGD, float16', fontsize=9)
    return _save(fig, out/'whole_step.png')

def plot_memory(rows:list, out:Path) -> Path:
    "Bytes per parameter between steps (solid) and at the peak of a step (hatched), per mode and optimizer"
    ok = [r for r in rows if r['available']]
    modes,opts = list(dict.fromkeys(r['mode'] for r in ok)),list(dict.fromkeys(r['opt'] for r in ok))
    by = {(r['mode'], r['opt']):r for r in ok}
    fig,ax = plt.subplots(figsize=(10, 4.5))
    x,width = np.arange(len(modes)),0.8 / (2 * len(opts))
    for j,o in enumerate(opts):
        for k,(key,hatch) in enumerate((('between', None), ('peak_step', '//'))):
            i = 2 * j + k
            vals = [by[(m, o)][key] if (m, o) in by else 0 for m in modes]
            ax.bar(x + (i - (2 * len(opts) - 1) / 2) * width, vals, width, color=f'C{j}', alpha=1 if hatch is None else .55,
                   hatch=hatch, edgecolor='k', lw=.3, label=f"{o}: {'between steps' if hatch is None else 'peak of a step'}")
    fp32 = by.get(('FP32', opts[0]))
    if fp32: ax.axhline(fp32['between'], color='k', ls='--', lw=1, label=f"FP32, {opts[0]}, between steps")
    ax.set_xticks(x, [m.replace(' masters', '\nmasters').replace('to_mixed ', 'to_mixed\n') for m in modes], fontsize=8)
    ax.set_ylabel('bytes per parameter')
    ax.set_title(f"3. Params + grads + optimizer state ({ok[0]['params'] / 1e6:.1f}M params, {ok[0]['tensors']} tensors), allocator bytes",
                 fontsize=10)
    ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1))
    return _save(fig, out/'memory.png')

def plot_syncs(rows:list, out:Path) -> Path:
    models = list(dict.fromkeys(r['model'] for r in rows))
    configs = [c for c in dict.fromkeys(r['config'] for r in rows) if c != 'FP32']
    per = {(r['model'], r['config']):r['extra_per_step'] for r in rows}
    fig,ax = plt.subplots(figsize=(8, 4))
    _grouped_bars(ax, models, {c:[max(per[(m, c)], 1e-2) for m in models] for c in configs},
                  'extra host syncs per training step vs FP32', log=True)
    ax.set_ylim(bottom=0.1) # bars at 1.0 stay visible on the log scale
    ax.axhline(1, color='k', ls='--', lw=1)
    ax.set_title('4. Host syncs over a whole fit (dashed: the budget, one per step)')
    return _save(fig, out/'syncs.png')

def plot_cuda(rows:list, out:Path) -> Path:
    "Section 5: each config's throughput and largest batch over FP32's (fused AdamW), model by model"
    models = list(dict.fromkeys(r['model'] for r in rows))
    series = list(dict.fromkeys((r['config'], r['opt']) for r in rows))
    val = {(r['model'], r['config'], r['opt']):r for r in rows}
    def rel(m, c, o, get):
        r,fp32 = val.get((m, c, o)),val.get((m, 'FP32', 'fused AdamW'))
        a,b = (get(r) if r else None),(get(fp32) if fp32 else None)
        return a / b if a and b else 0.
    rate = lambda r: r.get('rate')
    largest = lambda r: (r.get('largest') or {}).get('predicted')
    fig,(ax1,ax2) = plt.subplots(1, 2, figsize=(12, 4))
    _grouped_bars(ax1, models, {f'{c}, {o}':[rel(m, c, o, rate) for m in models] for c,o in series}, 'throughput / FP32 (TF32 off)')
    _grouped_bars(ax2, models, {f'{c}, {o}':[rel(m, c, o, largest) for m in models] for c,o in series}, 'largest batch (predicted) / FP32')
    fig.suptitle('5. CUDA throughput')
    return _save(fig, out/'cuda_throughput.png')
