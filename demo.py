"The main job of `make demo`: FP32 vs `to_mixed()` (the type it chooses, float16 and bfloat16) on scikit-learn's digits, one table."
import statistics, time, warnings
from fastai.basics import *
from fastai.callback.schedule import *
from mpcallbacks.all import *
from mpcallbacks.digits import digits_dls, digits_cnn

REPEATS = 3 # fits per configuration, taking turns: the table shows medians
CONFIGS = {'FP32': 'fp32', 'to_mixed()': None, 'to_mixed(float16)': torch.float16, 'to_mixed(bfloat16)': torch.bfloat16}

class StepTimer(Callback):
    "Wall time of each training batch (forward, backward, step), the first of the fit left out"
    order = 100
    def before_fit(self): self.times = []
    def before_batch(self): self.start = time.perf_counter()
    def after_batch(self):
        if self.training and self.iter > 0: self.times.append(time.perf_counter() - self.start)

def run(dtype, epochs=5, lr=1e-2, seed=0) -> dict:
    dls = digits_dls(seed=seed)
    set_seed(seed)
    learn = Learner(dls, digits_cnn(), loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    if dtype != 'fp32': learn.to_mixed(dtype)
    timer = StepTimer()
    start = time.perf_counter()
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit_one_cycle(epochs, lr, cbs=timer)
    secs = time.perf_counter() - start
    trn_loss, val_loss, acc = learn.recorder.values[-1]
    mmp = getattr(learn, 'master_mixed_precision', None)
    scale = mmp.loss_scale if mmp else None
    return dict(dtype=str(mmp.dtype).split('.')[1] if mmp else 'float32', accuracy=acc, valid_loss=val_loss,
                loss_scale=(int(scale) if scale.is_integer() else scale) if mmp else '-', skipped=mmp.skipped if mmp else 0,
                ms_per_step=1000 * statistics.median(timer.times), fit_s=secs)

def table(rows:dict) -> list:
    "One dict per configuration: the last fit's numbers, the timings as medians over its fits"
    res = []
    for name,runs in rows.items():
        r = dict(run=name, **runs[-1])
        r['ms_per_step'] = statistics.median(x['ms_per_step'] for x in runs)
        r['fit_s'] = statistics.median(x['fit_s'] for x in runs)
        res.append(r)
    return res

def footer(res:list) -> list:
    "What the table shows, read from it"
    fp32 = next(r for r in res if r['run'] == 'FP32')
    native = native_16bit_dtypes('cpu')
    lines = [f"16-bit types this CPU computes natively: {', '.join(sorted(str(d).split('.')[1] for d in native)) or 'none (both emulated)'}; "
             f"to_mixed() chose {next(r for r in res if r['run'] == 'to_mixed()')['dtype']}."]
    for r in res:
        if r is fp32: continue
        ratio = r['ms_per_step'] / fp32['ms_per_step']
        lines.append(f"{r['run']}: {ratio:.2f}x FP32's time per step ({'faster' if ratio < 1 else 'slower'}), accuracy "
                     f"{r['accuracy'] - fp32['accuracy']:+.4f} against FP32, {r['skipped']} steps skipped.")
    chosen = next(r for r in res if r['run'] == 'to_mixed()')
    same = next((r for r in res if r is not chosen and r['run'] != 'FP32' and r['dtype'] == chosen['dtype']), None)
    if same: # the same configuration twice: how far apart its two rows are is this machine's noise
        lines.append(f"to_mixed() and {same['run']} train alike (same type, same seed): their times per step differ by "
                     f"{abs(chosen['ms_per_step'] / same['ms_per_step'] - 1):.0%}, the noise of this machine's timings.")
    lines.append(f"ms_per_step: median over the training batches of {REPEATS} fits per row (the first batch of each left out); "
                 f"fit_s: median of the {REPEATS} fits' times, validation included.")
    return lines

if __name__ == '__main__':
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = {name:[] for name in CONFIGS}
    for name in CONFIGS: run(CONFIGS[name], epochs=1) # (a warm-up of each configuration: the first fits pay one-time costs)
    for i in range(REPEATS):
        names = list(CONFIGS)[i % len(CONFIGS):] + list(CONFIGS)[:i % len(CONFIGS)] # each round in another order
        for name in names: rows[name].append(run(CONFIGS[name]))
    res = table(rows)
    cols = list(res[0])
    print(f"Digits (1,797 images, scikit-learn), small CNN with BatchNorm, 5 epochs of fit_one_cycle, torch {torch.__version__} "
          f"on CPU ({torch.get_num_threads()} threads)")
    cell = lambda v: v if isinstance(v, str) else f'{v:,}' if isinstance(v, int) else f'{v:.4g}'
    width = {c:max(len(c), *(len(cell(r[c])) for r in res)) for c in cols} # (each column as wide as its widest entry)
    print(' | '.join(f'{c:>{width[c]}}' for c in cols))
    for r in res: print(' | '.join(f'{cell(r[c]):>{width[c]}}' for c in cols))
    for line in footer(res): print(line)
