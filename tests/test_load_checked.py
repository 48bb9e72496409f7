"`learn.load_checked` is all or nothing for the whole file: weights, optimizer state and loss scaler are checked (names, shapes, kinds, inf/NaN) before anything is written to the learner, and a refusal names what did not fit; a truncated file says so."
import copy, math, warnings
from functools import partial
import pytest, torch
from torch import nn
from fastai.basics import Learner, CrossEntropyLossFlat, OptimWrapper
from mpcallbacks.test_utils import synth_learner, synth_dls, synth_model
from test_checkpoints import state_of, assert_same_learner_state
from intact import call_lock_free

def trained(path, **kwargs):
    learn = synth_learner(path=path, **kwargs).to_mixed(torch.bfloat16)
    learn.fit(1, 1e-2)
    return learn

def other_head_learner(path, n_out=3):
    "The same backbone as `synth_model`, with a head of `n_out` classes"
    model = synth_model(1)
    model[-1] = nn.Linear(model[-1].in_features, n_out)
    return Learner(synth_dls(), model, loss_func=CrossEntropyLossFlat(), path=path).to_mixed(torch.bfloat16)

def refuses(learn, match, *args, **kwargs):
    "`load_checked` raises a ValueError matching `match`, with no warning of fastai's, and the learner is exactly as it was"
    learn.create_opt() if learn.opt is None else None
    before = state_of(learn)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        with pytest.raises(ValueError, match=match) as e: call_lock_free(learn.load_checked, *args, **kwargs)
    assert not [x for x in w if 'optimizer state' in str(x.message)], [str(x.message) for x in w]
    assert 'nothing was loaded' in str(e.value)
    assert_same_learner_state(before, state_of(learn))
    return str(e.value)

def test_a_checkpoint_of_another_head_loads_nothing_and_names_the_head(tmp_path):
    trained(tmp_path).save('ck', with_opt=False)
    learn = other_head_learner(tmp_path)
    msg = refuses(learn, r"'4\.weight' is \(2, 512\) in the file, \(3, 512\) in the model", 'ck', with_opt=False)
    assert "'4.bias' is (2,) in the file, (3,) in the model" in msg

def test_missing_and_unexpected_weights_are_named_and_nothing_is_loaded(tmp_path):
    trained(tmp_path).save('ck', with_opt=False)
    model = synth_model(1); model.append(nn.Linear(2, 2)) # a layer the checkpoint lacks
    learn = Learner(synth_dls(), model, loss_func=CrossEntropyLossFlat(), path=tmp_path).to_mixed(torch.bfloat16)
    refuses(learn, r"the file lacks: '5\.weight', '5\.bias'", 'ck', with_opt=False)
    sd = torch.load(tmp_path/'models'/'ck.pth'); sd['extra.weight'] = torch.zeros(1); torch.save(sd, tmp_path/'models'/'ck.pth')
    refuses(synth_learner(path=tmp_path, seed=1).to_mixed(torch.bfloat16), r"does not have: 'extra\.weight'", 'ck', with_opt=False)

def test_strict_false_loads_the_weights_that_are_there(tmp_path):
    learn = trained(tmp_path); learn.save('ck', with_opt=False)
    sd = torch.load(tmp_path/'models'/'ck.pth'); del sd['4.bias']; torch.save(sd, tmp_path/'models'/'ck.pth')
    other = synth_learner(path=tmp_path, seed=1).to_mixed(torch.bfloat16)
    call_lock_free(other.load_checked, 'ck', with_opt=False, strict=False)
    assert torch.equal(other.model[-1].weight, learn.model[-1].weight) and not torch.equal(other.model[-1].bias, learn.model[-1].bias)

def tamper(path, f):
    sd = torch.load(path, weights_only=False); f(sd); torch.save(sd, path)

def set_state(sd, i, k, v): sd['opt']['state'][i][k] = v

@pytest.mark.parametrize('weight', ['0.weight', '1.running_var'])
def test_nan_in_a_weight_or_buffer_is_refused_by_name(tmp_path, weight):
    trained(tmp_path).save('ck', with_opt=True)
    tamper(tmp_path/'models'/'ck.pth', lambda sd: sd['model'][weight].view(-1).__setitem__(0, math.nan))
    refuses(trained(tmp_path, seed=1), rf"inf or NaN values: '{re_(weight)}'", 'ck', with_opt=True)

def re_(s): return s.replace('.', r'\.')

def test_nan_in_adams_state_is_refused_naming_the_parameter(tmp_path):
    trained(tmp_path).save('ck', with_opt=True)
    tamper(tmp_path/'models'/'ck.pth', lambda sd: sd['opt']['state'][0]['sqr_avg'].view(-1).__setitem__(0, math.inf))
    refuses(trained(tmp_path, seed=1), r"optimizer state with inf or NaN values: 0\.weight's sqr_avg", 'ck', with_opt=True)

def test_an_optimizer_state_for_other_parameters_loads_nothing(tmp_path):
    "fastai would load the weights, then warn and keep the old optimizer state"
    trained(tmp_path).save('ck', with_opt=True)
    tamper(tmp_path/'models'/'ck.pth', lambda sd: sd['opt'].__setitem__('state', sd['opt']['state'][:-1]))
    refuses(trained(tmp_path, seed=1), 'the optimizer state is for 5 parameters, the learner', 'ck', with_opt=True)

def test_an_optimizer_state_of_another_shape_loads_nothing(tmp_path):
    "fastai checks only the number of states: one of another shape would load and fail at the next step"
    trained(tmp_path).save('ck', with_opt=True)
    tamper(tmp_path/'models'/'ck.pth', lambda sd: set_state(sd, 5, 'grad_avg', torch.zeros(3)))
    refuses(trained(tmp_path, seed=1), r"4\.bias's grad_avg is \(3,\), the parameter \(2,\)", 'ck', with_opt=True)

def test_a_torch_optimizers_state_is_checked_too(tmp_path):
    opt_func = partial(OptimWrapper, opt=torch.optim.AdamW)
    learn = trained(tmp_path, opt_func=opt_func); learn.save('ck', with_opt=True)
    tamper(tmp_path/'models'/'ck.pth', lambda sd: sd['opt']['state'][5].__setitem__('exp_avg', torch.full((2,), math.nan)))
    refuses(trained(tmp_path, seed=1, opt_func=opt_func), r"4\.bias's exp_avg", 'ck', with_opt=True)
    learn.save('ck', with_opt=True)
    tamper(tmp_path/'models'/'ck.pth', lambda sd: sd['opt']['state'][5].__setitem__('exp_avg', torch.zeros(5, 5)))
    refuses(trained(tmp_path, seed=1, opt_func=opt_func), r"4\.bias's exp_avg is \(5, 5\), the parameter \(2,\)", 'ck', with_opt=True)

def test_a_good_checkpoint_still_loads_whole(tmp_path):
    learn = trained(tmp_path); learn.save('ck', with_opt=True)
    other = trained(tmp_path, seed=1)
    call_lock_free(other.load_checked, 'ck', with_opt=True)
    assert_same_learner_state(state_of(learn), state_of(other))

@pytest.mark.parametrize('keep', [0, 10, 0.5, -10])
def test_a_truncated_file_says_it_is_truncated(tmp_path, keep):
    learn = trained(tmp_path); path = learn.save('ck', with_opt=True)
    data = path.read_bytes()
    path.write_bytes(data[:keep if isinstance(keep, int) and keep >= 0 else int(len(data)*keep) if keep > 0 else len(data)+keep])
    before = state_of(learn)
    with pytest.raises(EOFError, match='is truncated'): call_lock_free(learn.load_checked, 'ck', with_opt=True)
    assert_same_learner_state(before, state_of(learn))

# ---- optimizer state that would load and crash or mislead the next step is refused

def member_data(path, member):
    "Where `member`'s bytes start in the zip archive at `path`, and how many there are"
    import zipfile
    with zipfile.ZipFile(path) as z: info = z.getinfo(member)
    with open(path, 'rb') as f:
        f.seek(info.header_offset + 26); n, m = int.from_bytes(f.read(2), 'little'), int.from_bytes(f.read(2), 'little')
    return info.header_offset + 30 + n + m, info.file_size

def flip_byte(path, member, at=0, fix_crc=False):
    "Flip a byte of `member` in the zip archive at `path`; with `fix_crc`, write its CRC-32 anew, as a writer of a bad pickle would"
    import zipfile, zlib
    start, size = member_data(path, member)
    data = bytearray(path.read_bytes())
    data[start + at] ^= 0x5a
    if fix_crc:
        crc = zlib.crc32(bytes(data[start:start+size])).to_bytes(4, 'little')
        with zipfile.ZipFile(path) as z: info = z.getinfo(member)
        data[info.header_offset+14:info.header_offset+18] = crc
        i = data.find(b'PK\x01\x02')
        while i >= 0: # the central directory's record of the member
            n = int.from_bytes(data[i+28:i+30], 'little')
            if bytes(data[i+46:i+46+n]) == member.encode(): data[i+16:i+20] = crc
            i = data.find(b'PK\x01\x02', i + 46)
    path.write_bytes(bytes(data))

def adam_state(path): return path/'models'/'ck.pth'

bad_opt_states = {
    'a moment that only broadcasts to its parameter': (lambda sd: set_state(sd, 4, 'grad_avg', torch.zeros(1, 512)),
                                                       r"4\.weight's grad_avg is \(1, 512\), the parameter \(2, 512\)"),
    'a moment of one element': (lambda sd: set_state(sd, 5, 'sqr_avg', torch.zeros(1)), r"4\.bias's sqr_avg is \(1,\), the parameter \(2,\)"),
    'a float16 moment': (lambda sd: set_state(sd, 4, 'sqr_avg', sd['opt']['state'][4]['sqr_avg'].half()),
                         r"4\.weight's sqr_avg is torch\.float16, the parameter torch\.float32"),
    'a negative step': (lambda sd: set_state(sd, 0, 'step', -3), r"0\.weight's step is -3"),
    'a string step': (lambda sd: set_state(sd, 0, 'step', '8'), r"0\.weight's step is '8'"),
    'a float step': (lambda sd: set_state(sd, 0, 'step', 8.0), r"0\.weight's step is 8\.0"),
    'a missing hyper-parameter': (lambda sd: sd['opt']['hypers'][0].pop('sqr_mom'), r"missing.*'sqr_mom'"),
    'a hyper-parameter that is not a number': (lambda sd: sd['opt']['hypers'][0].__setitem__('lr', 'fast'), r"'lr' of group 0 is 'fast'"),
}

@pytest.mark.parametrize('case', list(bad_opt_states))
def test_an_optimizer_state_the_step_cannot_take_is_refused(tmp_path, case):
    "Adam's moments of a shape that only broadcasts crashed torch's fused kernel (SIGSEGV); the rest loaded and misled the step"
    f, match = bad_opt_states[case]
    trained(tmp_path).save('ck', with_opt=True)
    tamper(adam_state(tmp_path), f)
    refuses(trained(tmp_path, seed=1), match, 'ck', with_opt=True)

def test_every_misfit_is_listed_in_one_message(tmp_path):
    trained(tmp_path).save('ck', with_opt=True)
    def f(sd):
        set_state(sd, 4, 'grad_avg', torch.zeros(1, 512)); set_state(sd, 0, 'step', -1); sd['opt']['hypers'][0].pop('eps')
        sd['model']['0.bias'].view(-1)[0] = math.nan
    tamper(adam_state(tmp_path), f)
    msg = refuses(trained(tmp_path, seed=1), 'nothing was loaded', 'ck', with_opt=True)
    for part in ["'0.bias'", "4.weight's grad_avg is (1, 512)", "0.weight's step is -1", "'eps'"]: assert part in msg, (part, msg)

def test_a_fastai_sgd_checkpoint_is_refused_by_an_adam_learner_and_back(tmp_path):
    from fastai.optimizer import SGD
    trained(tmp_path, opt_func=partial(SGD, mom=0.9)).save('sgd', with_opt=True)
    trained(tmp_path).save('adam', with_opt=True)
    msg = refuses(trained(tmp_path, seed=1), 'another optimizer', 'sgd', with_opt=True)
    assert "'sqr_mom'" in msg and "'eps'" in msg # the hyper-parameters Adam steps with, that SGD's checkpoint lacks
    refuses(synth_learner(path=tmp_path, seed=1).to_mixed(torch.bfloat16), 'another optimizer', 'sgd', with_opt=True) # a fresh learner, no state yet
    refuses(trained(tmp_path, seed=1, opt_func=partial(SGD, mom=0.9)), 'another optimizer', 'adam', with_opt=True)
    refuses(synth_learner(path=tmp_path, seed=1, opt_func=SGD).to_mixed(torch.bfloat16), 'another optimizer', 'adam', with_opt=True)

def test_a_torch_sgd_checkpoint_is_refused_by_a_torch_adamw_learner(tmp_path):
    sgd, adamw = partial(OptimWrapper, opt=partial(torch.optim.SGD, momentum=0.9)), partial(OptimWrapper, opt=torch.optim.AdamW)
    trained(tmp_path, opt_func=sgd).save('ck', with_opt=True)
    msg = refuses(trained(tmp_path, seed=1, opt_func=adamw), 'another optimizer', 'ck', with_opt=True)
    assert "'betas'" in msg
    refuses(synth_learner(path=tmp_path, seed=1, opt_func=adamw).to_mixed(torch.bfloat16), 'another optimizer', 'ck', with_opt=True)

def test_a_torch_adams_step_must_be_a_count(tmp_path):
    opt_func = partial(OptimWrapper, opt=torch.optim.AdamW)
    trained(tmp_path, opt_func=opt_func).save('ck', with_opt=True)
    tamper(adam_state(tmp_path), lambda sd: sd['opt']['state'][0].__setitem__('step', torch.tensor(-2.)))
    refuses(trained(tmp_path, seed=1, opt_func=opt_func), r"0\.weight's step is -2", 'ck', with_opt=True)
    trained(tmp_path, opt_func=opt_func).save('ck', with_opt=True)
    tamper(adam_state(tmp_path), lambda sd: sd['opt']['state'][4].__setitem__('exp_avg', torch.zeros(2, 512, dtype=torch.float16)))
    refuses(trained(tmp_path, seed=1, opt_func=opt_func), r"4\.weight's exp_avg is torch\.float16", 'ck', with_opt=True)

def test_a_state_not_made_yet_and_factored_states_still_load(tmp_path):
    "A parameter whose state is still empty (fastai and torch make it at the first step) fits; torch's Adafactor keeps factors that broadcast"
    learn = synth_learner(path=tmp_path).to_mixed(torch.bfloat16); learn.create_opt(); learn.save('fresh', with_opt=True)
    call_lock_free(trained(tmp_path, seed=1).load_checked, 'fresh', with_opt=True)
    opt_func = partial(OptimWrapper, opt=torch.optim.Adafactor)
    learn = trained(tmp_path, opt_func=opt_func); learn.save('ck', with_opt=True)
    other = trained(tmp_path, seed=1, opt_func=opt_func)
    call_lock_free(other.load_checked, 'ck', with_opt=True)
    assert_same_learner_state(state_of(learn), state_of(other))
    tamper(adam_state(tmp_path), lambda sd: sd['opt']['state'][4].__setitem__('row_var', torch.zeros(3, 1)))
    refuses(trained(tmp_path, seed=1, opt_func=opt_func), r"4\.weight's row_var is \(3, 1\)", 'ck', with_opt=True)

def test_a_refused_load_leaves_no_optimizer_where_there_was_none(tmp_path):
    trained(tmp_path).save('ck', with_opt=True)
    tamper(adam_state(tmp_path), lambda sd: set_state(sd, 0, 'step', -1))
    learn = synth_learner(path=tmp_path, seed=1).to_mixed(torch.bfloat16)
    assert learn.opt is None
    with pytest.raises(ValueError, match='nothing was loaded'): call_lock_free(learn.load_checked, 'ck', with_opt=True)
    assert learn.opt is None
    with pytest.raises(FileNotFoundError): call_lock_free(learn.load_checked, 'none', with_opt=True)
    assert learn.opt is None

# ---- a file damaged after it was written

def test_a_flipped_byte_in_a_tensor_is_refused_naming_the_member(tmp_path):
    "torch reads tensor data without checking the archive's CRC-32: the flipped byte loaded silently"
    trained(tmp_path).save('ck', with_opt=True)
    flip_byte(adam_state(tmp_path), 'ck/data/7', at=100)
    msg = refuses(trained(tmp_path, seed=1), 'is corrupt', 'ck', with_opt=True)
    assert str(adam_state(tmp_path)) in msg and "'ck/data/7'" in msg

def test_a_corrupt_pickle_says_the_file_is_corrupt(tmp_path):
    "A pickle damaged before its CRC-32 was written: a bare UnicodeDecodeError or UnpicklingError before"
    for at in (148, 0, 592, 703, 1258, 1295): # where the flip gives a UnicodeDecodeError, an UnpicklingError, a KeyError, an IndexError, a RuntimeError, a TypeError
        trained(tmp_path).save('ck', with_opt=True)
        flip_byte(adam_state(tmp_path), 'ck/data.pkl', at=at, fix_crc=True)
        msg = refuses(trained(tmp_path, seed=1), 'is corrupt', 'ck', with_opt=True)
        assert str(adam_state(tmp_path)) in msg

# ---- a Ctrl-C part way through loads nothing

def interrupt_after(monkeypatch, cls, name, times=1):
    "`cls.name` does its work, then raises KeyboardInterrupt, the first `times` calls"
    real, calls = getattr(cls, name), []
    def f(self, *args, **kwargs):
        res = real(self, *args, **kwargs)
        calls.append(1)
        if len(calls) <= times: raise KeyboardInterrupt
        return res
    monkeypatch.setattr(cls, name, f)
    return calls

class interrupt_setting:
    "Within the block, setting `learn.attr` raises KeyboardInterrupt instead at the settings numbered in `at` (from 1): a Ctrl-C while the learner is given back"
    def __init__(self, learn, attr, at): self.learn, self.attr, self.at, self.n = learn, attr, set(at), 0
    def __enter__(self):
        cls, attr = type(self.learn), self.attr
        def set_(learn, v):
            self.n += 1
            if self.n in self.at: raise KeyboardInterrupt
            learn.__dict__[attr] = v
        self.cls, self.learn.__class__ = cls, type(cls.__name__, (cls,), {attr: property(lambda learn: learn.__dict__[attr], set_)})
        return self
    def __exit__(self, *exc): self.learn.__class__ = self.cls

@pytest.mark.parametrize('where', ['the weights', 'the optimizer state', 'the loss scaler', 'the weights, then again putting them back'])
def test_a_ctrl_c_during_the_load_puts_everything_back(tmp_path, monkeypatch, where):
    "fastai loads the weights, then the optimizer state, then the scaler: a Ctrl-C between them left the weights of the file with the state of before"
    from contextlib import nullcontext
    from fastai.optimizer import Optimizer
    from mpcallbacks.scaler import LossScaler
    trained(tmp_path).save('ck', with_opt=True)
    learn = trained(tmp_path, seed=1)
    before = state_of(learn)
    cls, name = {'the weights': (nn.Module, 'load_state_dict'), 'the optimizer state': (Optimizer, 'load_state_dict'),
                 'the loss scaler': (LossScaler, 'load_state_dict')}.get(where, (nn.Module, 'load_state_dict'))
    interrupt_after(monkeypatch, cls, name)
    with interrupt_setting(learn, 'opt', at=[1]) if 'again' in where else nullcontext() as again: # (the first thing given back)
        with pytest.raises(KeyboardInterrupt): call_lock_free(learn.load_checked, 'ck', with_opt=True)
    assert again is None or again.n == 2, "the learner was not given back again after the second Ctrl-C"
    monkeypatch.undo()
    assert_same_learner_state(before, state_of(learn))
    call_lock_free(learn.load_checked, 'ck', with_opt=True) # and the next load loads

def test_an_interrupt_swallowed_by_fastais_load_is_not_raised_by_a_later_load_checked(tmp_path, monkeypatch):
    from fastai.optimizer import Optimizer
    learn = trained(tmp_path); learn.save('ck', with_opt=True)
    interrupt_after(monkeypatch, Optimizer, 'load_state_dict')
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        learn.load('ck', with_opt=True) # fastai's bare `except:` catches it: its warning is all that shows
    monkeypatch.undo()
    assert any('Could not load the optimizer state' in str(x.message) for x in w)
    call_lock_free(learn.load_checked, 'ck', with_opt=True) # raised the interrupt caught above

# ---- arguments checked before anything changes

@pytest.mark.parametrize('args,kwargs,error,match', [
    ((123,), {}, TypeError, r"`file` must be a str or a path.*got 123"),
    ((None,), {}, TypeError, r"`file` must be a str or a path.*got None"),
    (('',), {}, ValueError, r"`file` must name a file"),
    (('ck',), {'foo': 1}, TypeError, r"`foo`.*with_opt.*strict"),
    (('ck',), {'map_location': 'cpu'}, TypeError, r"`map_location`.*`device`"),
    (('ck',), {'with_opt': 'yes'}, TypeError, r"`with_opt` must be True or False, got 'yes'"),
    (('ck',), {'strict': 1}, TypeError, r"`strict` must be True or False"),
])
def test_load_checked_names_a_bad_argument_before_anything_changes(tmp_path, args, kwargs, error, match):
    trained(tmp_path).save('ck', with_opt=True)
    learn = synth_learner(path=tmp_path, seed=1).to_mixed(torch.bfloat16)
    w = [p.detach().clone() for p in learn.model.parameters()]
    with pytest.raises(error, match=match): call_lock_free(learn.load_checked, *args, **kwargs)
    assert learn.opt is None and all(torch.equal(a, b) for a, b in zip(w, learn.model.parameters()))

def test_a_checkpoints_loss_scale_that_a_learner_without_to_mixed_drops_is_warned_of(tmp_path):
    "Loading before `to_mixed()` drops the saved scale: `load_checked` says so, and loads the rest"
    src = synth_learner(path=tmp_path).to_mixed(torch.float16, init_scale=2.**10)
    src.fit(1, 1e-2); src.save('ck')
    scale = src.master_mixed_precision.loss_scale
    plain = synth_learner(path=tmp_path, seed=1)
    with pytest.warns(UserWarning, match=rf"holds a loss scale, {scale:g}, .* call `learn.to_mixed\(...\)` before `load_checked`"):
        plain.load_checked('ck')
    for a,b in zip(plain.model.parameters(), src.model.parameters()): assert torch.equal(a, b) # (the rest loaded)
    def no_warning(load):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            load()
        assert not [x for x in w if 'loss scale' in str(x.message)], [str(x.message) for x in w]
    mixed = synth_learner(path=tmp_path, seed=1).to_mixed(torch.float16)
    no_warning(lambda: mixed.load_checked('ck')) # the right order: the scale comes back
    assert mixed.master_mixed_precision.loss_scale == scale
    no_warning(lambda: synth_learner(path=tmp_path, seed=1).load_checked('ck', with_opt=False)) # (no optimizer state asked for)
    trained(tmp_path).save('bf') # bfloat16: a static scale of 1, nothing to resume
    no_warning(lambda: synth_learner(path=tmp_path, seed=1).load_checked('bf'))
