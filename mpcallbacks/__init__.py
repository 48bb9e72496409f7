"""Mixed-precision training for fastai on GPUs and CPUs: `learn.to_mixed()`.

What importing changes outside the package, all of it in `mpcallbacks.learner` and the `mpcallbacks.checkpoint` and
`mpcallbacks.doctor` it imports (`mpcallbacks.all` imports them), and in `mpcallbacks.sharded`, which adds
`Learner.to_sharded` and `Learner.sharded_ctx` (`to_sharded` gives that one learner its own `save`, `load` and
`export`): `Learner.to_mixed`, `to_unmixed`, `mixed_summary`, `plot_loss_scale`, `save_atomic`, `export_atomic`, `load_checked` and
`precision_report` are added; `Learner.fit` is wrapped (a learner without `MasterMixedPrecision` runs fastai's own);
fastai's `to_fp32`/`to_non_native_fp32` also remove ours. Every other module changes nothing when imported. During a
mixed fit, each batch's forward runs under `torch.autocast` in the thread that runs the fit, and hooks sit on the few
modules of the fit's model that autocast cannot serve (modules kept in FP32, recurrent layers), registered when the
fit begins and removed when it ends; no global hook of torch's is ever registered."""
__version__ = "0.2.0"
