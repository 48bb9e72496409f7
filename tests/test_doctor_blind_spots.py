"""What the precision doctor used to miss: a parameterless module, or an operation between modules, whose own 16-bit
arithmetic overflows (the doctor keeps what makes the overflow, not only what receives it); a layer that keeping in
FP32 does not bring back within reach of FP32 (the doctor says to train the model in FP32); and a compiled model,
which the measurement must not make compile more graphs."""
import math, warnings
import pytest, torch
from torch import nn
from torch._dynamo.utils import counters
import mpcallbacks.all # noqa: F401 (`Learner.to_mixed`, `Learner.precision_report`)
from mpcallbacks.policy import KeptFor
from mpcallbacks.scaler import NonFiniteGradients
from mpcallbacks.test_utils import synth_learner
from like_fp32 import fit_once

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 2))

# ---- a compiled model

def graphs_of_a_compiled_fit(keep_fp32) -> int:
    "Graphs dynamo compiled for one fit of a compiled MLP (the eager backend: what dynamo captures, no code generated)"
    torch._dynamo.reset()
    counters.clear()
    learn = synth_learner()
    learn.model = torch.compile(mlp(), backend='eager')
    learn.to_mixed(torch.bfloat16, keep_fp32=keep_fp32).fit(1, 1e-3)
    return counters['stats']['unique_graphs']

@pytest.mark.skipif(not hasattr(torch.compiler, 'set_stance'), reason='torch 2.6 and later run a compiled model eagerly while measured')
def test_auto_on_a_compiled_model_compiles_no_more_graphs():
    plain,auto = graphs_of_a_compiled_fit(()),graphs_of_a_compiled_fit('auto')
    assert plain > 0 and auto == plain, (plain, auto)
    torch._dynamo.reset()
    counters.clear()
    learn = synth_learner()
    learn.model = torch.compile(mlp(), backend='eager')
    rep = learn.precision_report(torch.bfloat16)
    assert counters['stats']['unique_graphs'] == 0 and set(rep.verdict) == {'fine'}, rep

# ---- an overflow made by a parameterless module, or by an operation between modules

class Gain(nn.Module):
    "A fixed gain, no parameter: at 3e4 its 16-bit product leaves float16's range (65504)"
    def __init__(self, gain=3e4): super().__init__(); self.gain = gain
    def forward(self, x): return x * self.gain

def gain_between_linears():
    "Linear, a gain of 3e4, Linear, the inverse gain: FP32 trains it; in float16 the first gain's product overflows"
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), Gain(), nn.Linear(32, 32), Gain(1 / 3e4), nn.ReLU(), nn.Linear(32, 2))
    return learn

class GainBetween(nn.Module):
    "The same gain, as an operation in a block's forward between its two layers"
    def __init__(self): super().__init__(); self.l1,self.l2 = nn.Linear(64, 32),nn.Linear(32, 32)
    def forward(self, x): return self.l2(self.l1(x) * 3e4) / 3e4

def gain_in_a_block():
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = nn.Sequential(nn.Flatten(), GainBetween(), nn.ReLU(), nn.Linear(32, 2))
    return learn

class GainInTheModel(nn.Module):
    "The same gain in the model's own forward, outside every module: nothing to keep"
    def __init__(self): super().__init__(); self.l1,self.l2,self.head = nn.Linear(64, 32),nn.Linear(32, 32),nn.Linear(32, 2)
    def forward(self, x): return self.head(torch.relu(self.l2(self.l1(x.flatten(1)) * 3e4) / 3e4))

def gain_in_the_model():
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = GainInTheModel()
    return learn

from test_precision_doctor import fit_auto as fit_said, rel # (`fit_once`, and what 'auto' said)

def test_a_parameterless_gain_that_overflows_is_kept_with_what_receives_it():
    rep = gain_between_linears().precision_report(torch.float16).set_index('module')
    assert rep.verdict['2'] == 'keep FP32' and rep.reason['2'].startswith("overflow: its own `mul` reaches"), rep[['verdict', 'reason']]
    assert rep.reason['3'].startswith('overflow: its inputs reach'), rep[['verdict', 'reason']]
    ref = fit_once(gain_between_linears, None, epochs=3)
    plain = fit_once(gain_between_linears, dict(dtype=torch.float16), epochs=3)
    auto,said = fit_said(gain_between_linears, dict(dtype=torch.float16, keep_fp32='auto'), epochs=3)
    assert plain.learn.cbs[-1].skipped > len(plain.losses) // 2 # plain float16 skips most steps
    kept = {k.name for k in auto.learn.cbs[-1].auto_kept}
    assert {'2', '3'} <= kept and auto.learn.cbs[-1].skipped == 0, (kept, auto.learn.cbs[-1].skipped)
    assert rel(auto.mean_loss(False, 4), ref.mean_loss(False, 4)) < 0.02, (auto.mean_loss(False, 4), ref.mean_loss(False, 4))
    assert len(said) == 1 and '`2` (overflow: its own `mul`' in said[0], said

def test_an_operation_between_a_blocks_layers_keeps_the_block():
    rep = gain_in_a_block().precision_report(torch.float16).set_index('module')
    assert rep.reason['1'].startswith("overflow: its own `mul` reaches"), rep[['verdict', 'reason']]
    ref = fit_once(gain_in_a_block, None, epochs=3)
    auto,_ = fit_said(gain_in_a_block, dict(dtype=torch.float16, keep_fp32='auto'), epochs=3)
    assert auto.learn.cbs[-1].auto_kept == (KeptFor('1', 'overflow'),), auto.learn.cbs[-1].auto_kept # the block, its layers in it
    assert auto.learn.cbs[-1].skipped == 0
    assert rel(auto.mean_loss(False, 4), ref.mean_loss(False, 4)) < 0.02, (auto.mean_loss(False, 4), ref.mean_loss(False, 4))

def test_an_operation_in_the_models_own_forward_is_said_to_need_fp32():
    rep = gain_in_the_model().precision_report(torch.float16)
    top = rep.iloc[0]
    assert (top.module, top.verdict) == ('', 'train in FP32') and "its own `mul`, in the model's forward" in top.reason, rep[['module', 'verdict', 'reason']]
    assert 'Move that operation into a module of its own' in top.reason and 'learn.to_unmixed()' in top.reason
    auto,said = fit_said(gain_in_the_model, dict(dtype=torch.float16, keep_fp32='auto'), epochs=1)
    assert '' not in {k.name for k in auto.learn.cbs[-1].auto_kept} # the model itself is never kept: that is no mixed precision
    assert len(said) == 1 and 'not enough for this model' in said[0] and 'learn.to_unmixed()' in said[0], said

# ---- a layer whose inputs lose what it needs when rounded to 16 bits: kept with what makes them, or FP32

class Center(nn.Module):
    "Subtracts a fixed level, no parameter: the difference of large, nearly equal numbers"
    def __init__(self, level=256.): super().__init__(); self.level = level
    def forward(self, x): return x - self.level

def on_a_level(after):
    "A Linear whose outputs ride on a level of 256, then a module made by `after`: bfloat16 (2 apart at 256) rounds the signal off before it"
    def make():
        learn = synth_learner()
        torch.manual_seed(0)
        lin = nn.Linear(64, 32)
        with torch.no_grad(): lin.bias.add_(256.)
        learn.model = nn.Sequential(nn.Flatten(), lin, after(), nn.ReLU(), nn.Linear(32, 2))
        return learn
    return make

offset_learner,batchnorm_learner = on_a_level(Center),on_a_level(lambda: nn.BatchNorm1d(32)) # BatchNorm: always FP32, on bfloat16 inputs

@pytest.mark.parametrize('make', [offset_learner, batchnorm_learner], ids=['parameterless', 'BatchNorm'])
def test_a_layer_whose_inputs_lose_what_it_needs_is_kept_with_what_makes_them(make):
    rep = make().precision_report(torch.bfloat16)
    top = rep.iloc[0]
    assert (top.module, top.verdict) == ('2', 'keep FP32') and top.inputs_from == ('1',), rep[['module', 'verdict', 'reason']]
    assert top.reason.startswith('sensitivity') and 'so what makes them is kept too: `1`' in top.reason, top.reason
    assert top.kept_sensitivity > 8 * torch.finfo(torch.bfloat16).eps # in FP32 on bfloat16 inputs it still loses
    ref = fit_once(make, None, epochs=3)
    plain = fit_once(make, dict(dtype=torch.bfloat16), epochs=3)
    auto,said = fit_said(make, dict(dtype=torch.bfloat16, keep_fp32='auto'), epochs=3)
    end32 = ref.mean_loss(False, 4)
    assert rel(plain.mean_loss(False, 4), end32) > 0.5, (plain.mean_loss(False, 4), end32)
    assert {k.name for k in auto.learn.cbs[-1].auto_kept} == {'1', '2'}, auto.learn.cbs[-1].auto_kept
    assert rel(auto.mean_loss(False, 4), end32) < 0.02, (auto.mean_loss(False, 4), end32)
    assert len(said) == 1 and '`1` (' in said[0], said

class Level(nn.Module):
    "Adds the level of 256: the remedy, the addition in a module of its own"
    def forward(self, x): return x + 256.

class LevelInTheModel(nn.Module):
    "The level added in the model's own forward, outside every module: no module to keep that makes it"
    def __init__(self, wrapped=False):
        super().__init__()
        self.lin,self.center,self.head = nn.Linear(64, 32),Center(),nn.Linear(32, 2)
        self.level = Level() if wrapped else None
    def forward(self, x):
        h = self.lin(x.flatten(1))
        return self.head(torch.relu(self.center(self.level(h) if self.level is not None else h + 256.)))

def level_in_the_model(wrapped=False):
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = LevelInTheModel(wrapped)
    return learn

def test_when_keeping_is_not_enough_the_doctor_says_to_train_in_fp32():
    rep = level_in_the_model().precision_report(torch.bfloat16)
    top = rep.iloc[0]
    assert (top.module, top.verdict) == ('center', 'train in FP32'), rep[['module', 'verdict', 'reason']]
    assert "the model's own forward makes them, which no module keeps" in top.reason, top.reason
    assert 'Train this model in FP32 (`learn.to_unmixed()`)' in top.reason and 'into a module of its own' in top.reason, top.reason
    ref = fit_once(level_in_the_model, None, epochs=3)
    auto,said = fit_said(level_in_the_model, dict(dtype=torch.bfloat16, keep_fp32='auto'), epochs=3)
    end32 = ref.mean_loss(False, 4)
    assert rel(auto.mean_loss(False, 4), end32) > 0.5, (auto.mean_loss(False, 4), end32) # what the report says is so
    assert len(said) == 1 and 'is not enough for this model' in said[0] and 'Train it in FP32 (`learn.to_unmixed()`)' in said[0], said
    # the other remedy it names works: the addition in a module of its own, which 'auto' then keeps with `center`
    wrapped = lambda: level_in_the_model(wrapped=True)
    auto,said = fit_said(wrapped, dict(dtype=torch.bfloat16, keep_fp32='auto'), epochs=3)
    assert {k.name for k in auto.learn.cbs[-1].auto_kept} == {'level', 'center'}, auto.learn.cbs[-1].auto_kept
    assert rel(auto.mean_loss(False, 4), end32) < 0.02, (auto.mean_loss(False, 4), end32)

# ---- what the own arithmetic does not count: a mask's fill

class MaskedAttention(nn.Module):
    "Scores masked with -inf and with float32's lowest, as attention code does: FP32's own fills, no 16-bit overflow"
    def forward(self, x):
        mask = torch.zeros_like(x, dtype=torch.bool)
        mask[:, -4:] = True
        s = x.masked_fill(mask, float('-inf')).softmax(-1)
        return s + torch.where(mask, torch.finfo(torch.float32).min, 0.).clamp_min(-1.)

def masked_learner():
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), MaskedAttention(), nn.Linear(32, 2))
    return learn

def test_a_masks_fill_is_not_an_overflow():
    rep = masked_learner().precision_report(torch.float16)
    assert set(rep.verdict) == {'fine'}, rep[['module', 'verdict', 'reason']]

# ---- modules that write their input in place, and a model 'auto' would keep whole

class DropFirst(nn.Module):
    "A block whose first layer overwrites the block's input in place (torchvision's classifiers: Dropout(inplace=True), Linear)"
    def __init__(self): super().__init__(); self.drop,self.lin = nn.Dropout(0.2, inplace=True),nn.Linear(32, 32)
    def forward(self, x): return self.lin(self.drop(x))

def inplace_learner():
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.SiLU(inplace=True), DropFirst(), nn.ReLU(inplace=True), nn.Linear(32, 2))
    return learn

def test_modules_that_write_their_input_in_place_are_judged_on_it_as_it_was():
    rep = inplace_learner().precision_report(torch.bfloat16)
    assert set(rep.verdict) == {'fine'}, rep[['module', 'verdict', 'reason']]
    assert (rep.sensitivity < 2 * torch.finfo(torch.bfloat16).eps).all(), rep[['module', 'sensitivity']]

def all_flagged():
    "Its one cast layer receives what a gain makes from the data: keeping all that is flagged leaves nothing to cast"
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = nn.Sequential(nn.Flatten(), Gain(3e4), nn.Linear(64, 2))
    return learn

def test_auto_never_keeps_the_whole_model():
    learn = all_flagged().to_mixed(torch.float16, keep_fp32='auto')
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        with pytest.raises(NonFiniteGradients): learn.fit(1, 1e-2) # (the cast Linear overflows at every step, as the warning says)
    said = [str(x.message) for x in w if "keep_fp32='auto'" in str(x.message)]
    assert [k.name for k in learn.master_mixed_precision.auto_kept] == ['1'] # the gain; the Linear stays cast
    assert len(said) == 1 and 'would keep every layer in FP32' in said[0] and 'learn.to_unmixed()' in said[0], said

# ---- a gain that 'auto' keeps, whose gradients then need a lower loss scale than float16's usual start

def gain_before_the_head():
    "Linear, a gain of 3e4, the head: FP32 trains it; in float16 the gain overflows, and once kept, the gradients it sends back into the cast Linear overflow at the usual start scale of 2**16"
    learn = synth_learner()
    torch.manual_seed(0)
    learn.model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), Gain(), nn.Linear(32, 2))
    return learn

def test_auto_starts_a_dynamic_scale_where_the_measured_gradients_fit():
    ref = fit_once(gain_before_the_head, None, epochs=3)
    auto,said = fit_said(gain_before_the_head, dict(dtype=torch.float16, keep_fp32='auto'), epochs=3)
    cb = auto.learn.cbs[-1]
    assert {k.name for k in cb.auto_kept} == {'2', '3'}, cb.auto_kept
    assert cb.skipped == 0 and cb.scaler.history[0][0] < 2**16, (cb.skipped, cb.scaler.history[0]) # 13 of 24 skipped from 2**16
    assert rel(auto.mean_loss(False, 4), ref.mean_loss(False, 4)) < 0.02, (auto.mean_loss(False, 4), ref.mean_loss(False, 4))
    assert len(said) == 1 and f'The dynamic loss scale starts at 2**{int(math.log2(cb.scaler.history[0][0]))}' in said[0], said
