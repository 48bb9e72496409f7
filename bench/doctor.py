"Section 7: what `learn.precision_report()` costs on the 13.2M-parameter model, against as many plain mixed training batches."
from __future__ import annotations
import statistics, time
from functools import partial
import torch
from fastai.basics import Learner, CrossEntropyLossFlat, SGD
from mpcallbacks.all import * # Learner.to_mixed, Learner.precision_report
from mpcallbacks.test_utils import count_syncs
from .common import md_table, as_ratio, quiet, batch_timer, sync, linear_norm_stack, synthetic_dls, n_params

def _learner(dtype, n_batches:int, device) -> Learner:
    dls = synthetic_dls(bs=4, n_train_batches=n_batches, device=device)
    return Learner(dls, linear_norm_stack().to(device), loss_func=CrossEntropyLossFlat(), opt_func=partial(SGD, mom=0.)).to_mixed(dtype)

def run_doctor(device, rounds:int=7, n_batches:int=4) -> list:
    """Per 16-bit type: the median time of a `precision_report(n_batches=n_batches)` and of `n_batches` training batches of a
    `to_mixed()` fit (their batch times summed: no data loading, no validation), in turns, report then fit, after one untimed
    round; and the host syncs of one report"""
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        learn = _learner(dtype, n_batches, device)
        with quiet(learn), count_syncs() as counts: rep = learn.precision_report(n_batches=n_batches)
        report_s,train_s = [],[]
        for r in range(rounds + 1): # the first round warms up
            with quiet(learn):
                sync(device)
                start = time.perf_counter()
                learn.precision_report(n_batches=n_batches)
                sync(device)
                t = time.perf_counter() - start
                cbs,times = batch_timer(device)
                learn.fit(1, 1e-3, cbs=cbs)
            if r:
                report_s.append(t)
                train_s.append(sum(times))
        rep_ms,train_ms = 1e3 * statistics.median(report_s),1e3 * statistics.median(train_s)
        rows.append(dict(dtype=str(dtype).split('.')[1], params_M=n_params(learn.model) / 1e6, modules=len(rep), batches=n_batches,
                         rounds=rounds, report_ms=rep_ms, train_ms=train_ms, ratio=rep_ms / train_ms, syncs=sum(counts.values()),
                         syncs_by=dict(counts), flagged=int((rep.verdict != 'fine').sum())))
    return rows

def doctor_section(rows:list) -> str:
    r0 = rows[0]
    cols = ['dtype', 'modules measured', 'report ms', f"{r0['batches']} training batches ms", 'report / training', 'host syncs per report', 'flagged']
    body = [[r['dtype'], r['modules'], f"{r['report_ms']:.1f}", f"{r['train_ms']:.1f}", as_ratio(r['ratio']),
             f"{r['syncs']} ({', '.join(f'{k} {v}' for k,v in r['syncs_by'].items())})", r['flagged']] for r in rows]
    return ('### 7. The precision report: its cost against plain mixed training\n\n'
            f"Linear+LayerNorm x50 ({r0['params_M']:.1f}M parameters), bs 4: `learn.precision_report(n_batches={r0['batches']})` "
            f"(FP32 forward and backward of each batch, every cast module rerun in 16 bits, the statistics kept on the device) "
            f"against the training batches of a `to_mixed()` fit of {r0['batches']} batches (their times summed: no data loading, "
            f"no validation), in turns, {r0['rounds']} timed rounds after one untimed; medians. Host syncs: over one whole "
            "report, the data loader's draw of its seed included.\n\n" + md_table(cols, body))
