"`make bench`: every section side by side on the device present; prints markdown tables, writes bench/results/, ends with the headline."
from __future__ import annotations
import argparse, os, platform, time, warnings
warnings.filterwarnings('ignore', category=FutureWarning, message='.*torch.jit.script') # torchvision's, at import
from datetime import datetime, timezone
from pathlib import Path
import torch, fastai
from .common import md_table, as_ratio, as_bpp, cpu_name, adam_optimizers
from .bookkeeping import run_bookkeeping, bookkeeping_section
from .step import run_whole_step, run_bookkeeping_bound_fit, whole_step_section
from .memory import run_memory, memory_section
from .sharded import run_sharded_memory, sharded_section
from .syncs import run_syncs, syncs_section, run_optimizer_syncs, optimizer_syncs_section
from .cuda_throughput import run_cuda_throughput, cuda_section
from .doctor import run_doctor, doctor_section
from .speed import run_speed, speed_section
from .step_peak import run_step_peak, step_peak_section
from .accuracy import run_accuracy, accuracy_section
from . import plots

results_dir = Path(__file__).resolve().parent / 'results'

def targets(book:list, step:list, bound:dict, syncs:list, doctor:list|None=None) -> list:
    "(target, measured, met) for each performance target"
    r18,many = book
    mixed_syncs = [r for r in syncs if r['config'].startswith('to_mixed')]
    worst_step = max(step, key=lambda r: r['mixed_vs_hand'])
    return [
        ('grad path <= 1.3x copy_ (both models)', f"{as_ratio(r18['grad_vs_copy'])} (R18), {as_ratio(many['grad_vs_copy'])} ({many['tensors']} tensors)",
         max(r18['grad_vs_copy'], many['grad_vs_copy']) <= 1.3),
        ('grad path >= 2x faster than fastai, ResNet-18', as_ratio(r18['fastai_vs_ours']), r18['fastai_vs_ours'] >= 2),
        (f"grad path >= 5x faster than fastai, {many['tensors']} tensors", as_ratio(many['fastai_vs_ours']), many['fastai_vs_ours'] >= 5),
        ('copy-back <= 1.1x copy_ (32->16, both models)', f"{as_ratio(r18['back_vs_copy'])} (R18), {as_ratio(many['back_vs_copy'])} ({many['tensors']} tensors)",
         max(r18['back_vs_copy'], many['back_vs_copy']) <= 1.1),
        ('whole step to_mixed <= 1.05x hand loop (every model/dtype)',
         ', '.join(f"{as_ratio(r['mixed_vs_hand'])} ({r['model'].split(' (')[0]}, {r['dtype']})" for r in step), worst_step['mixed_vs_hand'] <= 1.05),
        ('(no target) callback overhead beyond the FP32 Learner\'s own, per step',
         ', '.join(f"{r['callback_own_ms']:+.2f} ms ({r['model'].split(' (')[0]}, {r['dtype']})" for r in step), None),
        ('syncs: to_mixed adds <= 1 per training step + 2 per fit',
         ', '.join(f"+{r['extra']} over {r['train_steps']} steps ({r['model']}, {r['config'].split()[1]})" for r in mixed_syncs),
         all(r['within_budget'] for r in mixed_syncs)),
        ('bookkeeping-bound fit: to_mixed not slower than fastai non-native', as_ratio(bound['mixed_vs_nonnative']), bound['mixed_vs_nonnative'] <= 1.0),
    ] + ([('precision report <= 3x as many training batches (13.2M model)', ', '.join(f"{as_ratio(r['ratio'])} ({r['dtype']})" for r in doctor),
           all(r['ratio'] <= 3 for r in doctor)),
          ('precision report: no host sync per module', ', '.join(f"{r['syncs']} syncs for {r['modules']} modules ({r['dtype']})" for r in doctor),
           all(r['syncs'] <= 2 for r in doctor))] if doctor else [])

def whole_step_targets(speed:dict, peaks:list, opt_syncs:list) -> list:
    "(target, measured, met) for section 8's whole steps, on the 16-bit types the device computes natively (none: not measured)"
    native = [d for d in speed['dtypes'] if d in speed['native']]
    names = {k:n for k,(n,_) in adam_optimizers.items()}
    def ms(row, o, config, dt): return row['ms'].get((o, config, None if config == 'FP32' else dt))
    def ratios(a, b, rows, opts): # [(a / b, what)] for every row, optimizer and native type where both ran
        return [(ms(row, o, a, dt) / ms(row, o, b, dt), f"{row['model']}, {names[o]}, {dt}")
                for row in rows for o in opts for dt in native if ms(row, o, a, dt) and ms(row, o, b, dt)]
    over = lambda rs, limit: [(x, w) for x,w in rs if round(x, 2) > limit]
    def measured(rs, limit):
        if not rs: return 'not measured: no native 16-bit type' if not native else '-'
        worse = over(rs, limit)
        shown = worse or [max(rs)]
        return (f"{len(worse)} of {len(rs)} above: " if worse else f"all {len(rs)}, the highest: ") + ', '.join(f"{as_ratio(x)} ({w})" for x,w in shown)
    met = lambda rs, limit: None if not rs else not over(rs, limit)
    vs_ac = ratios('to_mixed', 'autocast', speed['rows'], speed['opts'])
    mlp = [row for row in speed['rows'] if row['key'] == 'mlp']
    vs_pure = ratios('to_mixed', 'pure 16-bit', mlp, [o for o in speed['opts'] if o == 'fused'])
    adam_vs_fused = [(ms(row, 'adam', 'to_mixed', dt) / ms(row, 'fused', 'to_mixed', dt), f"{row['model']}, {dt}") for row in mlp
                     for dt in native if set(speed['opts']) >= {'adam', 'fused'} and ms(row, 'adam', 'to_mixed', dt) and ms(row, 'fused', 'to_mixed', dt)]
    fused = [r for r in opt_syncs if r['opt'] == names['fused'] and r['config'].startswith('to_mixed')]
    by = {(r['model'], r['config'], r['dtype']):r for r in peaks}
    peak = [(by[(m, c, dt)]['peak_MiB'] / by[(m, 'FP32', '-')]['peak_MiB'], by[(m, c, dt)]['peak_MiB'] / by[(m, 'autocast', dt)]['peak_MiB'],
             f"{by[(m, c, dt)]['name']}, {dt}") for m,c,dt in by if c == 'to_mixed']
    return [
        ('whole step: to_mixed no slower than autocast (every model and optimizer)', measured(vs_ac, 1.0), met(vs_ac, 1.0)),
        ('whole step, wide MLP with fused AdamW: to_mixed <= 1.1x pure 16-bit', measured(vs_pure, 1.1), met(vs_pure, 1.1)),
        ("whole step, wide MLP: to_mixed with fastai's Adam <= 1.5x with fused AdamW", measured(adam_vs_fused, 1.5), met(adam_vs_fused, 1.5)),
        ('host syncs to_mixed adds per step with fused AdamW: 0',
         ', '.join(f"{r['extra_per_step']:.2f} ({r['model']}, {r['config'].split()[1]})" for r in fused) or '-',
         all(r['extra'] == 0 for r in fused) if fused else None),
        ('step peak: to_mixed below FP32 and autocast',
         ', '.join(f"{as_ratio(f)} FP32, {as_ratio(a)} autocast ({w})" for f,a,w in peak) or '-',
         all(f < 1 and a < 1 for f,a,_ in peak) if peak else None),
    ]

def accuracy_targets(acc:list) -> list:
    "(target, measured, met): one batch's gradients under `to_mixed` as close to FP32's as autocast's, overall and for every parameter"
    worst = lambda k: max(acc, key=lambda r: r[k])
    return [('gradient error against FP32: to_mixed <= autocast (small BERT, every type)',
             ', '.join(f"{as_ratio(r['ratio'])} ({r['dtype']})" for r in acc), all(round(r['ratio'], 2) <= 1 for r in acc)),
            ('... and for every parameter', f"worst {as_ratio(worst('worst_ratio')['worst_ratio'])} ({worst('worst_ratio')['worst_param']}, {worst('worst_ratio')['dtype']})",
             all(round(r['worst_ratio'], 2) <= 1 for r in acc))]

def headline(book:list, step:list, bound:dict, syncs:list, mem:list) -> str:
    r18,many = book
    by = {(r['mode'], r['opt']):r for r in mem if r['available']}
    fp32,bf16 = by[('FP32', 'fastai Adam')],by[('to_mixed bfloat16', 'fastai Adam')]
    worst = max(r['mixed_vs_hand'] for r in step)
    cnn = {r['config']:r for r in syncs if r['model'] == 'digits CNN'}
    nn_syncs = next(r for r in syncs if r['config'] == 'fastai non-native' and r['model'] != 'digits CNN')
    return (f"HEADLINE: grad path {as_ratio(r18['grad_vs_copy'])} copy (R18), {as_ratio(many['grad_vs_copy'])} ({many['tensors']}-tensor); "
            f"{as_ratio(r18['fastai_vs_ours'])} faster than fastai (R18), {as_ratio(many['fastai_vs_ours'])} ({many['tensors']}-tensor); "
            f"copy-back {as_ratio(r18['back_vs_copy'])} copy (R18); step {as_ratio(worst)} hand loop (worst of {len(step)}); "
            f"bookkeeping-bound fit {as_ratio(bound['mixed_vs_nonnative'])} fastai non-native; "
            f"syncs +{cnn['to_mixed float16']['extra_per_step']:.2f}/step (fastai non-native +{nn_syncs['extra_per_step']:.0f}/step); "
            f"bytes/param between steps/peak (Adam): to_mixed bf16 {as_bpp(bf16['between'])}/{as_bpp(bf16['peak_step'])}, "
            f"FP32 {as_bpp(fp32['between'])}/{as_bpp(fp32['peak_step'])}")

def environment(device, threads:int) -> str:
    dev = torch.cuda.get_device_name(device) if device.type == 'cuda' else f'CPU: {cpu_name()}, {os.cpu_count()} cores, {threads} torch threads'
    return (f"torch {torch.__version__}, fastai {fastai.__version__}, Python {platform.python_version()}; {dev}; "
            f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")

def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument('--device', default=None, help="'cpu' or 'cuda'; default: cuda if present")
    ap.add_argument('--threads', type=int, default=1, help='torch threads on a CPU (default 1: see below; section 8 uses every core)')
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
    doctor = run_doctor(device, rounds=3 if args.quick else 7)
    emit(doctor_section(doctor))
    # Section 8 runs as a user would, on every core (it says how many); the sections above keep one thread
    speed = run_speed(device, rounds=1 if args.quick else 5)
    emit(speed_section(speed))
    peaks = run_step_peak(device)
    emit(step_peak_section(peaks))
    opt_syncs = run_optimizer_syncs(device)
    emit(optimizer_syncs_section(opt_syncs))
    acc = run_accuracy(device)
    emit(accuracy_section(acc))
    tgt = targets(book, step, bound, syncs, doctor) + whole_step_targets(speed, peaks, opt_syncs) + accuracy_targets(acc)
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
