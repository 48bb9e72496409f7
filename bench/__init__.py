"The benchmark against fastai (bookkeeping per step, whole steps, memory, host syncs, LayerNorm in FP32): `make bench` runs `python -m bench.run`."
