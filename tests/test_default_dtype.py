"`to_mixed()` without a dtype trains in the fastest 16-bit type the fit's device computes natively; a dtype given wins"
import pytest, torch
from mpcallbacks.test_utils import synth_learner, InjectNonFinite
import mpcallbacks.callback as callback
from mpcallbacks.callback import MasterMixedPrecision, fastest_16bit_dtype
from mpcallbacks.checkpoint import OptimizerWithScaler

def natives(monkeypatch, table:dict):
    "Make `native_16bit_dtypes` answer from `table` (device type -> set of dtypes), as torch would on that hardware"
    monkeypatch.setattr(callback, 'native_16bit_dtypes', lambda dev: table[torch.device(dev).type])

@pytest.mark.parametrize('native,expected', [
    ({torch.float16, torch.bfloat16}, torch.bfloat16), # an Ampere GPU, an AMX CPU: bfloat16, no loss scaling needed
    ({torch.float16}, torch.float16),                  # a GPU without bfloat16 (Volta, Turing)
    ({torch.bfloat16}, torch.bfloat16),                # a CPU with AVX512-BF16
    (set(), torch.bfloat16),                           # a CPU with AVX2 only: both emulated; bfloat16 needs no scaling
])
def test_the_fastest_native_type(monkeypatch, native, expected):
    natives(monkeypatch, {'cpu': native})
    assert fastest_16bit_dtype('cpu') == expected
    learn = synth_learner().to_mixed()
    cb = learn.master_mixed_precision
    assert cb.dtype == expected
    assert cb.scaler.dynamic == (expected == torch.float16) # float16 scales dynamically, bfloat16 not at all
    learn.fit(1, 1e-2)
    assert {h[0] for h in cb.scaler.history} == ({2.**16} if expected == torch.float16 else {1.})

def test_the_default_is_not_float16_where_bfloat16_is_native(monkeypatch):
    natives(monkeypatch, {'cpu': {torch.bfloat16}})
    learn = synth_learner().to_mixed()
    learn.fit(1, 1e-2)
    assert (learn.master_mixed_precision.dtype, learn.master_mixed_precision.loss_scale) == (torch.bfloat16, 1.)
    assert 'bfloat16 (chosen for cpu)' in repr(learn.master_mixed_precision)
    assert set(learn.mixed_summary().forward) == {'bfloat16', 'float32'}

@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16, 'fp16'])
def test_a_dtype_given_wins(monkeypatch, dtype):
    natives(monkeypatch, {'cpu': {torch.bfloat16}})
    learn = synth_learner().to_mixed(dtype)
    natives(monkeypatch, {'cpu': {torch.float16}})
    learn.fit(1, 1e-2)
    want = torch.float16 if dtype == 'fp16' else dtype
    assert learn.master_mixed_precision.dtype == want
    assert 'fastest' not in repr(learn.master_mixed_precision)

def test_chosen_again_at_the_fit_start_from_the_models_device(monkeypatch):
    "The device is known when the fit starts: a device that calls for the other type switches it, and the optimizer's scaler with it"
    natives(monkeypatch, {'cpu': {torch.bfloat16}})
    learn = synth_learner().to_mixed()
    cb = learn.master_mixed_precision
    learn.fit(1, 1e-2, cbs=InjectNonFinite(at=[0]))
    assert (cb.dtype, cb.skipped) == (torch.bfloat16, 1)
    natives(monkeypatch, {'cpu': {torch.float16}}) # as if the model now trained on a GPU without bfloat16
    learn.fit(1, 1e-2)
    assert cb.dtype == torch.float16 and cb.scaler.dynamic and cb.skipped == 1 # the count of skipped steps goes on
    assert isinstance(learn.opt, OptimizerWithScaler) and learn.opt.scaler is cb.scaler # checkpoints save the scaler in use
    assert learn.opt.state_dict()['mpcallbacks.loss_scaler']['scale'] == 2.**16

def test_a_callback_built_alone_chooses_at_the_fit_start(monkeypatch):
    natives(monkeypatch, {'cpu': {torch.float16}})
    cb = MasterMixedPrecision()
    synth_learner().fit(1, 1e-2, cbs=cb)
    assert cb.dtype == torch.float16 and cb.scaler.dynamic

def test_a_scaler_argument_for_the_other_type_names_the_choice(monkeypatch):
    "init_scale belongs to float16's dynamic scaling: where bfloat16 was chosen, the error says so and how to choose"
    natives(monkeypatch, {'cpu': {torch.bfloat16}})
    with pytest.raises(ValueError, match=r"init_scale only applies .*\(Without a dtype, bfloat16 was chosen for this device: pass dtype=torch.float16"):
        synth_learner().to_mixed(init_scale=2.**10)
    assert synth_learner().to_mixed(torch.float16, init_scale=2.**10).master_mixed_precision.loss_scale == 2.**10


def test_a_misspelt_loss_scale_is_named_with_its_likely_meaning_and_no_word_of_the_dtype(monkeypatch):
    "The spelling, not the type chosen, is what is wrong: the message says what was meant, and nothing of the dtype"
    natives(monkeypatch, {'cpu': {torch.bfloat16}})
    for wrong,meant in (('dynamc', 'dynamic'), ('Auto', 'auto'), ('atuo', 'auto')):
        with pytest.raises(ValueError) as e: synth_learner().to_mixed(loss_scale=wrong)
        assert f"got {wrong!r}: did you mean {meant!r}?" in str(e.value) and 'Without a dtype' not in str(e.value), str(e.value)
