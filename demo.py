"The main job of `make demo`: FP32 vs `to_mixed()` in float16 and bfloat16 on scikit-learn's digits, one table."
import time, warnings
from fastai.basics import *
from fastai.callback.schedule import *
from mpcallbacks.all import *
from mpcallbacks.digits import digits_dls, digits_cnn, param_bytes

def run(dtype, epochs=5, lr=1e-2, seed=0):
    dls = digits_dls(seed=seed)
    set_seed(seed)
    learn = Learner(dls, digits_cnn(), loss_func=CrossEntropyLossFlat(), metrics=accuracy)
    if dtype is not None: learn.to_mixed(dtype)
    nbytes = {}
    probe = Callback(before_train=lambda cb: nbytes.setdefault('b', param_bytes(learn.model)))  # bytes during fit
    start = time.perf_counter()
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        learn.fit_one_cycle(epochs, lr, cbs=probe)
    secs = time.perf_counter() - start
    trn_loss, val_loss, acc = learn.recorder.values[-1]
    mmp = getattr(learn, 'master_mixed_precision', None)
    return dict(run='FP32' if dtype is None else f'to_mixed({str(dtype).split(".")[1]})', accuracy=acc,
                valid_loss=val_loss, loss_scale=(int(mmp.loss_scale) if mmp.loss_scale.is_integer() else mmp.loss_scale) if mmp else '-', skipped=mmp.skipped if mmp else 0,
                seconds=secs, param_bytes=nbytes['b'])

if __name__ == '__main__':
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = [run(dt) for dt in (None, torch.float16, torch.bfloat16)]
    cols = list(rows[0])
    print(f"Digits (1,797 images, scikit-learn), small CNN with BatchNorm, 5 epochs of fit_one_cycle, torch {torch.__version__} on CPU")
    fmt = lambda v: f'{v:>18}' if isinstance(v, (str, int)) else f'{v:>18.4g}'
    print(' | '.join(fmt(c) for c in cols))
    for r in rows: print(' | '.join(fmt(r[c]) for c in cols))
    print("param_bytes is measured during fit: 16-bit model weights (FP32 masters live in the optimizer).")
    print("On this CPU 16-bit math is emulated or slower than FP32, so the time column shows overhead, not speed-ups.")
