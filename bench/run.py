"`make bench`: every section side by side on the device present; prints markdown tables, writes bench/results/, ends with the headline."
from __future__ import annotations
import argparse, os, platform, time, warnings
warnings.filterwarnings('ignore', category=FutureWarning, message='.*torch.jit.script') # torchvision's, at import
from datetime import datetime, timezone
from pathlib import Path
import torch, fastai
from .bookkeeping import run_bookkeeping
from .step import run_whole_step, run_bookkeeping_bound_fit
from .memory import run_memory
from .sharded import run_sharded_memory, target as sharded_target
from .syncs import run_syncs
from .cuda_throughput import run_cuda_throughput
from .norms import run_norms
from .doctor import run_doctor
from . import plots

results_dir = Path(__file__).resolve().parent / 'results'

def md_table(headers:list, rows:list) -> str:
    "A markdown table; floats get 3 significant digits"
    fmt = lambda v: f'{v:.3g}' if isinstance(v, float) else str(v)
    lines = ['| ' + ' | '.join(headers) + ' |', '|' + '|'.join('---' for _ in headers) + '|']
    return '\n'.join(lines + ['| ' + ' | '.join(fmt(v) for v in r) + ' |' for r in rows])

def _x(v:float) -> str: return f'{v:.2f}x'
def _mib(b) -> str: return '-' if b is None else f'{b / 2**20:.1f}'

def bookkeeping_section(rows:list) -> str:
    variants = list(rows[0]['ms'])
    cols = ['ms per step (median)'] + [f"{r['model']} ({r['tensors']} tensors, {r['params_M']:.1f}M)" for r in rows]
    body = [[v] + [f"{r['ms'][v]:.2f}" for r in rows] for v in variants]
    body += [['**ours grad path / copy_ 16->32**'] + [_x(r['grad_vs_copy']) for r in rows],
             ['**fastai grad path / ours**'] + [_x(r['fastai_vs_ours']) for r in rows],
             ['fastai grad path / copy_ 16->32 (the most a grad path could gain)'] + [_x(r['fastai_vs_copy']) for r in rows],
             ['**ours copy-back / copy_ 32->16**'] + [_x(r['back_vs_copy']) for r in rows],
             ['ours copy-back / copy_ 16->32'] + [_x(r['back_vs_copy16']) for r in rows]]
    return ('### 1. Bookkeeping per optimizer step (float16 parameters)\n\n'
            'ours grad path = `MasterParams.after_backward()` (`LossScaler.unscale_()` on the FP32 gradients autograd wrote into '
            'the masters, the model\'s own parameters) + one `.item()`; ours copy-back = the cast the next forward makes in its '
            'place: every master cast to 16 bits (`ModelCast`) and put into the model\'s slots, and the masters put back. '
            'fastai grad path = `grad_overflow` + `to_master_grads` + per-parameter `div_` (as `NonNativeMixedPrecision.before_step`); '
            'fastai copy-back = `to_model_params`. copy_ = one flat tensor of the same number of values. '
            'The `ref:` rows are variants of our grad path, for where its time goes.\n\n' + md_table(cols, body))

def whole_step_section(rows:list, bound:dict, device) -> str:
    configs,r0 = list(rows[0]['ms']),rows[0]
    cols = ['model', 'dtype'] + [f'{c} ms' for c in configs] + [
        'to_mixed / hand loop', 'FP32 Learner / FP32 hand loop', "callback's own ms (to_mixed - hand) - (FP32 - hand FP32)"]
    body = [[r['model'], r['dtype']] + [f"{r['ms'][c]:.2f}" for c in configs]
            + [_x(r['mixed_vs_hand']), _x(r['learner_vs_hand_fp32']), f"{r['callback_own_ms']:+.2f}"] for r in rows]
    note = ("**fastai AMP (`to_fp16()`/`to_bf16()`) trains FP32 on this CPU**: it uses `autocast('cuda')`, disabled without CUDA.\n\n"
            if device.type != 'cuda' else '')
    b_rows = [[k, f'{v:.2f}'] for k,v in bound['ms'].items()] + [['**to_mixed / fastai non-native**', _x(bound['mixed_vs_nonnative'])]]
    return ('### 2. Whole training step inside `fit` (median ms per training batch, data loading and validation excluded)\n\n'
            f"Digits, bs 64, Adam (wd=0); {r0['rounds']} rounds of short fits ({r0['steps']} training steps, the first "
            f"{r0['skip']} not timed), the configs taking turns in a rotating order. "
            'hand loop = the same math as `to_mixed()` written out (same cast, FP32 loss, scaled backward, `_foreach_copy_` + '
            'fused unscale/check + one `.item()`, step on the masters, copy back), over the same DataLoader, without a Learner. '
            "hand loop FP32 = a plain FP32 loop, to show the Learner's own overhead; the last column is what `to_mixed()` "
            'costs beyond that overhead.\n\n'
            + note + md_table(cols, body) +
            f"\n\n#### 2b. Bookkeeping-bound fit: {bound['model']}, bs {bound['bs']}, float16, SGD without momentum\n\n"
            f"{bound['rounds']} rounds of short fits ({bound['steps']} steps, the first {bound['skip']} not timed), in turn. "
            'fastai non-native = `ModelToHalf` + `NonNativeMixedPrecision(max_loss_scale=2**16)` with only the CUDA assert removed '
            '(the same initial scale as ours).\n\n' + md_table(['config', 'ms per training step'], b_rows))

def _bpp(v:float) -> str: return f'{v:.2f}'

def memory_section(rows:list) -> str:
    ok = [r for r in rows if r['available']]
    r0 = ok[0]
    cols = ['mode', 'optimizer', 'forward computes in', '**between steps**', '**peak of a step**', 'peak with forward/backward',
            'activations MiB', 'gc: between steps', 'gc / allocator: end of backward']
    body = [[r['mode'], r['opt'], r['forward_dtype'], f"**{_bpp(r['between'])}**", f"**{_bpp(r['peak_step'])}**", _bpp(r['peak_batch']),
             f"{r['activations_MiB']:.1f}", _bpp(r['gc_between']), f"{_bpp(r['gc_after_backward'])} / {_bpp(r['alloc_after_backward'])}"]
            if r['available'] else [r['mode'], r['opt'], 'not available', '-', '-', '-', '-', '-', f"({r['reason']})"] for r in rows]
    tgt = memory_targets(rows)
    fp16 = [r for r in ok if r['mode'] == 'fastai to_fp16()']
    fp16_note = (" **fastai's `to_fp16()` trains FP32 here**: its first Linear layer computes in float32, as `autocast('cuda')` "
                 "is disabled without CUDA." if fp16 and fp16[0]['forward_dtype'] == 'float32' else '')
    gap = max(r['params'] * max(abs(r['gc_between'] - r['alloc_between_last']), abs(r['gc_after_backward'] - r['alloc_after_backward']))
              for r in ok) # bytes
    return ('### 3. Memory: bytes per parameter of training state (params + grads + optimizer state)\n\n'
            f"Linear+LayerNorm x50 ({r0['tensors']} tensors, {r0['params'] / 1e6:.1f}M parameters), bs 4, one epoch of 4 batches, "
            'each mode in its own process. Bytes from torch\'s allocator: the profiler (`profile_memory=True`) records each '
            "allocation with the allocator's running total, which on a CPU counts only what was allocated while profiling; the "
            'learner, data and FP32 model are built inside the profiled region, so the total is what training holds. Figures are '
            'the largest over batches 2-4 (batch 1 creates the optimizer state). *between steps*: at the end of a batch; '
            '*peak of a step*: the highest total from the end of backward to the end of the batch (no activations left); '
            '*peak with forward/backward*: from the start of the batch (activations, autocast\'s weight copies included); '
            '*activations*: bytes the forward pass and loss added. Cross-check: every live tensor `gc` finds (and its `.grad`), '
            f'each storage once, at the end of the last batch and right after its backward, differs by at most {gap:,.0f} bytes from the '
            "allocator's total at the same points (a difference would be memory no live tensor holds)." + fp16_note + '\n\n'
            + md_table(cols, body) + '\n\n#### Memory targets\n\n'
            + md_table(['target', 'measured', 'met'], [[t, m, '-' if k is None else 'yes' if k else '**no**'] for t,m,k in tgt]))

def memory_targets(rows:list) -> list:
    "(target, measured, met) for the memory targets"
    by = {(r['mode'], r['opt']):r for r in rows if r['available']}
    default = [r for (m,_),r in by.items() if m in ('to_mixed float16', 'to_mixed bfloat16')]
    fmt = lambda rs, k: ', '.join(f"{_bpp(r[k])} ({r['mode'].split()[1]}, {r['opt']})" for r in rs)
    # Compared as printed, to 2 decimals: every total also holds the data set, 0.004 bytes/param (FP32 reads 16.004)
    met = lambda rs, k, target: all(round(r[k], 2) <= target for r in rs)
    return [('to_mixed: <= 12.0 bytes/param between steps (no 16-bit cast outlives its step)', fmt(default, 'between'), met(default, 'between', 12.0)),
            ('to_mixed: <= 18.5 bytes/param at the peak of a step', fmt(default, 'peak_step'), met(default, 'peak_step', 18.5))]

def sharded_section(rows:list) -> str:
    "Per-rank bytes per parameter, sharded against DDP, at 1, 2 and 4 ranks"
    cols = ['ranks', 'mode', 'parameters are', 'between steps', 'peak of the step', 'of which DDP buckets', 'target between steps (12/ranks + 1)', 'met']
    body = [[r['ranks'], r['mode'], r['param_kinds'], _bpp(r['between']), _bpp(r['peak_step']), _bpp(r['buckets']),
             _bpp(sharded_target(r['ranks'])) if r['mode'] == 'sharded' else '-',
             ('yes' if round(r['between'], 2) <= sharded_target(r['ranks']) else '**no**') if r['mode'] == 'sharded' else '-'] for r in rows]
    n = rows[0]['params']
    return ('### 3b. Sharded (FSDP2) against data-parallel (DDP): per-rank bytes per parameter\n\n'
            f'`to_mixed(torch.bfloat16)` with fastai\'s Adam on a {n/1e6:.2f}M-parameter Linear+LayerNorm stack (16 blocks of 256), '
            'sharded with `to_sharded()` or wrapped in `DistributedDataParallel`, on 1, 2 and 4 gloo processes of this CPU. '
            'Bytes of the storages of every live tensor and gradient (a DTensor: its local shard), the data set left out, plus '
            "DDP's C++ gradient buckets; divided by the model's parameter count; the largest rank. Between steps: at "
            '`after_batch`. Peak of the step: the larger of the end of the backward and the end of the optimizer step (the '
            'gradients not yet freed). Transient buffers (activations, gathered 16-bit parameters, reduce buffers) are not '
            'counted.\n\n' + md_table(cols, body))

def syncs_section(rows:list) -> str:
    cols = ['model', 'tensors', 'config', 'train steps', 'syncs per fit', 'extra vs FP32', 'extra per step', '<= steps + 2']
    body = [[r['model'], r['tensors'], r['config'], r['train_steps'], r['syncs'], r['extra'], f"{r['extra_per_step']:.2f}",
             'yes' if r['within_budget'] else 'no'] for r in rows]
    return ('### 4. Host syncs over one whole `fit` (set-up and validation included)\n\n'
            'Calls of `Tensor.item`, `__bool__`, `__float__`, `__int__`, `tolist`, counted by wrapping them.\n\n' + md_table(cols, body))

def cuda_section(rows:list|None) -> str:
    if rows is None: return '### 5. CUDA throughput\n\nSkipped: no CUDA device here.'
    cols = ['arch', 'config', 'bs', 'images/s', 'largest batch']
    body = [[r['arch'], r['config'], r['bs'], f"{r['images_per_s']:.0f}", r['largest_batch']] for r in rows]
    return '### 5. CUDA throughput, 224 px synthetic data\n\n' + md_table(cols, body)

def norms_section(r:dict) -> str:
    fp32,ln32,ln16 = (r['ms'][c] for c in r['ms'])
    c32,c16 = list(r['ms'])[1:]
    rows = [[c, r['ln'][c], f"{ms:.1f}", _x(ms / fp32)] for c,ms in r['ms'].items()]
    speed = md_table(['config', 'LayerNorm weight in forward', 'ms per training step', '/ FP32'], rows)
    def worst(dt, c):
        res = r['acc'][dt][c]
        return (f"{max(abs(d) for d,_ in res):.2%}", f"{min(cos for _,cos in res):.5f}")
    acc = md_table(['dtype', 'config', 'final loss vs FP32: largest relative difference over 3 seeds', 'update cosine with FP32: lowest'],
                   [[dt, c, *worst(dt, c)] for dt in r['acc'] for c in (c32, c16)])
    return ('### 6. Normalization layers in FP32: LayerNorm kept FP32 against LayerNorm cast to 16 bits\n\n'
            f"Speed: {r['model']}; {r['rounds']} rounds of short fits ({r['steps']} training steps, the first {r['skip']} not "
            'timed), the configs taking turns. Kept in FP32, each LayerNorm computes in FP32 on its input cast up and hands its output '
            'back in 16 bits.\n\n' + speed + f"\n\nLayerNorm FP32 / LayerNorm 16-bit: **{_x(ln32 / ln16)}** per step.\n\n"
            "Closeness to FP32: the tests' small transformer (d=32, 2 layers, 3 epochs), 3 seeds, each mixed fit against FP32's on "
            'the same seed.\n\n' + acc)

def doctor_section(rows:list) -> str:
    r0 = rows[0]
    cols = ['dtype', 'modules measured', 'report ms', f"{r0['batches']} training batches ms", 'report / training', 'host syncs per report', 'flagged']
    body = [[r['dtype'], r['modules'], f"{r['report_ms']:.1f}", f"{r['train_ms']:.1f}", _x(r['ratio']),
             f"{r['syncs']} ({', '.join(f'{k} {v}' for k,v in r['syncs_by'].items())})", r['flagged']] for r in rows]
    return ('### 7. The precision report: its cost against plain mixed training\n\n'
            f"Linear+LayerNorm x50 ({r0['params_M']:.1f}M parameters), bs 4: `learn.precision_report(n_batches={r0['batches']})` "
            f"(FP32 forward and backward of each batch, every cast module rerun in 16 bits, the statistics kept on the device) "
            f"against the training batches of a `to_mixed()` fit of {r0['batches']} batches (their times summed: no data loading, "
            f"no validation), in turns, {r0['rounds']} timed rounds after one untimed; medians. Host syncs: over one whole "
            "report, the data loader's draw of its seed included.\n\n" + md_table(cols, body))

def targets(book:list, step:list, bound:dict, syncs:list, doctor:list|None=None) -> list:
    "(target, measured, met) for each performance target"
    r18,many = book
    mixed_syncs = [r for r in syncs if r['config'].startswith('to_mixed')]
    worst_step = max(step, key=lambda r: r['mixed_vs_hand'])
    return [
        ('grad path <= 1.3x copy_ (both models)', f"{_x(r18['grad_vs_copy'])} (R18), {_x(many['grad_vs_copy'])} ({many['tensors']} tensors)",
         max(r18['grad_vs_copy'], many['grad_vs_copy']) <= 1.3),
        ('grad path >= 2x faster than fastai, ResNet-18', _x(r18['fastai_vs_ours']), r18['fastai_vs_ours'] >= 2),
        (f"grad path >= 5x faster than fastai, {many['tensors']} tensors", _x(many['fastai_vs_ours']), many['fastai_vs_ours'] >= 5),
        ('copy-back <= 1.1x copy_ (32->16, both models)', f"{_x(r18['back_vs_copy'])} (R18), {_x(many['back_vs_copy'])} ({many['tensors']} tensors)",
         max(r18['back_vs_copy'], many['back_vs_copy']) <= 1.1),
        ('whole step to_mixed <= 1.05x hand loop (every model/dtype)',
         ', '.join(f"{_x(r['mixed_vs_hand'])} ({r['model'].split(' (')[0]}, {r['dtype']})" for r in step), worst_step['mixed_vs_hand'] <= 1.05),
        ('(no target) callback overhead beyond the FP32 Learner\'s own, per step',
         ', '.join(f"{r['callback_own_ms']:+.2f} ms ({r['model'].split(' (')[0]}, {r['dtype']})" for r in step), None),
        ('syncs: to_mixed adds <= 1 per training step + 2 per fit',
         ', '.join(f"+{r['extra']} over {r['train_steps']} steps ({r['model']}, {r['config'].split()[1]})" for r in mixed_syncs),
         all(r['within_budget'] for r in mixed_syncs)),
        ('bookkeeping-bound fit: to_mixed not slower than fastai non-native', _x(bound['mixed_vs_nonnative']), bound['mixed_vs_nonnative'] <= 1.0),
    ] + ([('precision report <= 3x as many training batches (13.2M model)', ', '.join(f"{_x(r['ratio'])} ({r['dtype']})" for r in doctor),
           all(r['ratio'] <= 3 for r in doctor)),
          ('precision report: no host sync per module', ', '.join(f"{r['syncs']} syncs for {r['modules']} modules ({r['dtype']})" for r in doctor),
           all(r['syncs'] <= 2 for r in doctor))] if doctor else [])

def headline(book:list, step:list, bound:dict, syncs:list, mem:list) -> str:
    r18,many = book
    by = {(r['mode'], r['opt']):r for r in mem if r['available']}
    fp32,bf16 = by[('FP32', 'fastai Adam')],by[('to_mixed bfloat16', 'fastai Adam')]
    worst = max(r['mixed_vs_hand'] for r in step)
    cnn = {r['config']:r for r in syncs if r['model'] == 'digits CNN'}
    nn_syncs = next(r for r in syncs if r['config'] == 'fastai non-native' and r['model'] != 'digits CNN')
    return (f"HEADLINE: grad path {_x(r18['grad_vs_copy'])} copy (R18), {_x(many['grad_vs_copy'])} ({many['tensors']}-tensor); "
            f"{_x(r18['fastai_vs_ours'])} faster than fastai (R18), {_x(many['fastai_vs_ours'])} ({many['tensors']}-tensor); "
            f"copy-back {_x(r18['back_vs_copy'])} copy (R18); step {_x(worst)} hand loop (worst of {len(step)}); "
            f"bookkeeping-bound fit {_x(bound['mixed_vs_nonnative'])} fastai non-native; "
            f"syncs +{cnn['to_mixed float16']['extra_per_step']:.2f}/step (fastai non-native +{nn_syncs['extra_per_step']:.0f}/step); "
            f"bytes/param between steps/peak (Adam): to_mixed bf16 {_bpp(bf16['between'])}/{_bpp(bf16['peak_step'])}, "
            f"FP32 {_bpp(fp32['between'])}/{_bpp(fp32['peak_step'])}")

def environment(device, threads:int) -> str:
    cpu = next((l.split(':', 1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name')), platform.processor()) \
        if Path('/proc/cpuinfo').exists() else platform.processor()
    dev = torch.cuda.get_device_name(device) if device.type == 'cuda' else f'CPU: {cpu}, {os.cpu_count()} cores, {threads} torch threads'
    return (f"torch {torch.__version__}, fastai {fastai.__version__}, Python {platform.python_version()}; {dev}; "
            f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")

def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument('--device', default=None, help="'cpu' or 'cuda'; default: cuda if present")
    ap.add_argument('--threads', type=int, default=1, help='torch threads on a CPU (default 1: see below)')
    ap.add_argument('--quick', action='store_true', help='fewer repeats: checks that everything runs, numbers are rough')
    args = ap.parse_args()
    device = torch.device(args.device or ('cuda' if torch.cuda.is_available() else 'cpu'))
    # One thread on a CPU: with another job on the other core, two OpenMP threads stall at every barrier and a median
    # of the same op varied 5-40x between runs here; with one thread it varied ~10%. Ratios are what the targets use.
    if device.type == 'cpu': torch.set_num_threads(args.threads)
    os.environ['BENCH_THREADS'] = str(torch.get_num_threads()) # the memory section's child processes use the same
    repeats = 5 if args.quick else 25
    results_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    out = []
    header = (f'# mpcallbacks benchmark\n\n{environment(device, torch.get_num_threads())}. Every comparison within a table was '
              f'measured side by side (interleaved rounds) in this run; times are medians.')
    def emit(s):
        print('\n' + s, flush=True)
        out.append(s)
    emit(header)
    book = run_bookkeeping(device, repeats=repeats)
    emit(bookkeeping_section(book))
    step = run_whole_step(device, rounds=2 if args.quick else 8)
    bound = run_bookkeeping_bound_fit(device, rounds=2 if args.quick else 16)
    emit(whole_step_section(step, bound, device))
    mem = run_memory(device)
    emit(memory_section(mem))
    emit(sharded_section(run_sharded_memory()))
    syncs = run_syncs(device)
    emit(syncs_section(syncs))
    cuda = run_cuda_throughput(device) if device.type == 'cuda' else None
    emit(cuda_section(cuda))
    emit(norms_section(run_norms(device, rounds=3 if args.quick else 7)))
    doctor = run_doctor(device, rounds=3 if args.quick else 7)
    emit(doctor_section(doctor))
    tgt = targets(book, step, bound, syncs, doctor)
    emit('### Performance targets\n\n' + md_table(['target', 'measured', 'met'], [[t, m, '-' if ok is None else 'yes' if ok else '**no**'] for t,m,ok in tgt]))
    pngs = [plots.plot_bookkeeping(book, results_dir), plots.plot_whole_step(step, bound, results_dir),
            plots.plot_memory(mem, results_dir), plots.plot_syncs(syncs, results_dir)]
    if cuda: pngs.append(plots.plot_cuda(cuda, results_dir))
    head = headline(book, step, bound, syncs, mem)
    secs = time.perf_counter() - start
    out += ['### Plots\n\n' + '\n'.join(f'![{p.stem}]({p.name})' for p in pngs), f'Benchmark time: {secs:.0f} s.', head]
    (results_dir / 'results.md').write_text('\n\n'.join(out) + '\n')
    print(f"\nWrote {results_dir / 'results.md'} and {len(pngs)} plots in {secs:.0f} s.")
    print(head)

if __name__ == '__main__': main()
