"`learn.save_atomic` and `learn.export_atomic` replace a good file atomically: a failure or a SIGKILL part way through leaves the previous file intact."
import os, random, signal, subprocess, sys, textwrap, time
import pytest, torch
from fastai.basics import load_learner
from mpcallbacks.test_utils import synth_learner
from test_entry_points import block_learner
from intact import assert_fp32_and_intact, hook_ids, call_lock_free

def partial_write_then(error):
    "A torch.save that writes some bytes to its target, then raises `error`: what a save does when the disk fills up"
    def save(obj, f, *args, **kwargs):
        data = b'PK\x03\x04' + b'\0' * 1000
        if hasattr(f, 'write'): f.write(data)
        else:
            with open(f, 'wb') as fh: fh.write(data)
        raise error
    return save

partial_write_then_disk_full = partial_write_then(OSError(28, 'No space left on device'))

def test_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    learn = synth_learner(path=tmp_path).to_mixed(torch.bfloat16)
    hooks = hook_ids(learn.model)
    learn.fit(1, 1e-2)
    learn.save('ck', with_opt=True)
    good = [p.detach().clone() for p in learn.model.parameters()]
    learn.fit(1, 1e-2)
    monkeypatch.setattr(torch, 'save', partial_write_then_disk_full)
    with pytest.raises(OSError): learn.save_atomic('ck', with_opt=True)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path/'models')) == ['ck.pth'], "a temporary file was left behind"
    other = synth_learner(path=tmp_path, seed=1).to_mixed(torch.bfloat16)
    other.load('ck', with_opt=True)
    assert all(torch.equal(a, b.detach()) for a, b in zip(good, other.model.parameters()))
    assert_fp32_and_intact(learn, hooks)

def test_failed_export_leaves_the_previous_export_intact(tmp_path, monkeypatch):
    learn = block_learner().to_mixed(torch.bfloat16)
    learn.path = tmp_path
    learn.fit(1, 1e-2)
    learn.export_atomic('export.pkl')
    good = [p.detach().clone() for p in learn.model.parameters()]
    learn.fit(1, 1e-2)
    monkeypatch.setattr(torch, 'save', partial_write_then_disk_full)
    with pytest.raises(OSError): learn.export_atomic('export.pkl')
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ['export.pkl'], "a temporary file was left behind"
    loaded = load_learner(tmp_path/'export.pkl')
    assert all(torch.equal(a, b.detach()) for a, b in zip(good, loaded.model.parameters()))

saver = textwrap.dedent('''
    import sys, torch
    torch.set_num_threads(1)
    from torch import nn
    from fastai.basics import Learner, DataLoaders, MSELossFlat
    from mpcallbacks.all import *
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1000, 4000), nn.Linear(4000, 1)) # 16 MB of FP32 weights
    ds = [(torch.zeros(1000), torch.zeros(1))]
    learn = Learner(DataLoaders.from_dsets(ds, ds, bs=1), model, loss_func=MSELossFlat(), path=sys.argv[1]).to_mixed(torch.bfloat16)
    learn.save_atomic('ck', with_opt=False) # the good checkpoint
    print('ready', flush=True)
    while True: learn.save_atomic('ck', with_opt=False) # the same weights, over and over
''')

def test_sigkill_during_save_never_leaves_an_unloadable_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1000, 4000), torch.nn.Linear(4000, 1))
    expected = model.state_dict()
    script = tmp_path/'saver.py'; script.write_text(saver)
    rng = random.Random(0)
    dirs = [tmp_path/f'run{i}' for i in range(3)]
    procs = [subprocess.Popen([sys.executable, str(script), str(d)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for d in dirs]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == 'ready'
            time.sleep(rng.uniform(0.05, 0.5)) # a random moment among the saves
            p.send_signal(signal.SIGKILL); p.wait()
    finally:
        for p in procs:
            if p.poll() is None: p.kill(); p.wait()
    for d in dirs:
        sd = torch.load(d/'models'/'ck.pth', weights_only=True) # raises on a truncated file
        assert sd.keys() == expected.keys() and all(torch.equal(sd[k], expected[k]) for k in sd)

# torch's zip writer, once the disk is full part way through
torch_zip_writer_out_of_disk = partial_write_then(RuntimeError('[enforce fail at inline_container.cc:672] . unexpected pos 1234 vs 100'))

def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    learn = synth_learner(path=tmp_path).to_mixed(torch.bfloat16)
    learn.save_atomic('ck', with_opt=False)
    good = (tmp_path/'models'/'ck.pth').read_bytes()
    monkeypatch.setattr(torch, 'save', torch_zip_writer_out_of_disk)
    with pytest.raises(OSError, match='No space left.*previous file is intact'): learn.save_atomic('ck', with_opt=False)
    monkeypatch.undo()
    assert (tmp_path/'models'/'ck.pth').read_bytes() == good and sorted(os.listdir(tmp_path/'models')) == ['ck.pth']

def test_temporary_files_of_a_killed_save_are_removed_by_the_next_save(tmp_path):
    learn = synth_learner(path=tmp_path).to_mixed(torch.bfloat16)
    (tmp_path/'models').mkdir()
    p = subprocess.Popen([sys.executable, '-c', 'pass']); p.wait() # a pid that no longer runs
    (tmp_path/'models'/f'.ck.pth.{p.pid}.tmp').write_bytes(b'half a checkpoint')
    learn.save_atomic('ck', with_opt=False)
    assert sorted(os.listdir(tmp_path/'models')) == ['ck.pth']

# ---- an export never takes the optimizer, its state or the data, and never swallows a Ctrl-C

def raise_on_calls(monkeypatch, cls, name, calls, exc=KeyboardInterrupt):
    "`cls.name` raises `exc` at the calls numbered in `calls` (from 1), and does its work at the others"
    real, n = getattr(cls, name), []
    def f(self, *args, **kwargs):
        n.append(1)
        if len(n) in calls: raise exc
        return real(self, *args, **kwargs)
    monkeypatch.setattr(cls, name, f)

def test_a_ctrl_c_as_fastais_export_reloads_the_optimizer_is_raised_and_gives_it_back(tmp_path, monkeypatch):
    "The wrapper caught it, fastai's export went on, export_atomic returned, and the next load_checked raised it"
    from fastai.optimizer import Optimizer
    learn = exported_learner(tmp_path)
    learn.save('ck', with_opt=True)
    before = held(learn)
    raise_on_calls(monkeypatch, Optimizer, 'load_state_dict', {1}) # fastai's export, after its write: the state into a new optimizer
    with pytest.raises(KeyboardInterrupt): learn.export_atomic('export.pkl')
    monkeypatch.undo()
    assert_given_back(learn, before)
    call_lock_free(learn.load_checked, 'ck', with_opt=True) # raised the Ctrl-C above
    assert_fp32_and_intact(learn)

@pytest.mark.parametrize('second', [False, True], ids=['once', 'again while giving back'])
@pytest.mark.parametrize('first', ['Ctrl-C', 'full disk'])
def test_a_ctrl_c_or_an_error_while_exporting_gives_back_the_optimizer_and_data(tmp_path, monkeypatch, first, second):
    from contextlib import nullcontext
    from test_load_checked import interrupt_setting
    learn = exported_learner(tmp_path)
    before = held(learn)
    monkeypatch.setattr(torch, 'save', partial_write_then_disk_full if first == 'full disk' else
                        lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    # fastai's export sets `learn.dls` to empty loaders (1), then the learner is given back its own (2: a Ctrl-C there; 3)
    with interrupt_setting(learn, 'dls', at=[2]) if second else nullcontext() as again:
        with pytest.raises(KeyboardInterrupt if second or first == 'Ctrl-C' else OSError): learn.export_atomic('export.pkl')
    assert again is None or again.n == 3, "the learner was not given back again after the second Ctrl-C"
    monkeypatch.undo()
    assert_given_back(learn, before)
    assert sorted(os.listdir(tmp_path)) == [], "a temporary file was left behind"
    assert_fp32_and_intact(learn)

def test_a_good_export_keeps_the_learners_own_optimizer(tmp_path):
    "fastai's export builds a new optimizer and loads the state into it: the learner keeps its own"
    learn = exported_learner(tmp_path)
    before = held(learn)
    learn.export_atomic('export.pkl')
    assert_given_back(learn, before)
    assert sorted(os.listdir(tmp_path)) == ['export.pkl']
    assert_fp32_and_intact(learn)

# ---- arguments checked before anything changes

def exported_learner(tmp_path):
    learn = block_learner().to_mixed(torch.bfloat16)
    learn.path = tmp_path
    learn.fit(1, 1e-2)
    return learn

def held(learn):
    "The learner's optimizer, its state, its data, the scaler's fields"
    from test_checkpoints import state_of
    return learn.opt, learn.dls, len(learn.dls.train), state_of(learn)

def assert_given_back(learn, before):
    from test_checkpoints import state_of, assert_same_learner_state
    opt, dls, n, state = before
    assert learn.opt is opt and learn.dls is dls and len(learn.dls.train) == n, "the optimizer or the data was not given back"
    assert_same_learner_state(state, state_of(learn))

@pytest.mark.parametrize('call,args,kwargs,error,match', [
    ('save_atomic', (123,), {}, TypeError, r"`file` must be a str or a path.*got 123"),
    ('save_atomic', ('',), {}, ValueError, r"`file` must name a file"),
    ('save_atomic', ('ck',), {'foo': 1}, TypeError, r"save_atomic.*`foo`.*`with_opt`, `pickle_protocol`"),
    ('save_atomic', ('ck',), {'with_opt': 'no'}, TypeError, r"`with_opt` must be True or False, got 'no'"),
    ('export_atomic', (None,), {}, TypeError, r"`fname` must be a str or a path.*got None"),
    ('export_atomic', ('e.pkl',), {'with_opt': True}, TypeError, r"export_atomic.*`with_opt`.*`pickle_module`, `pickle_protocol`"),
])
def test_a_bad_argument_is_named_before_anything_is_written(tmp_path, call, args, kwargs, error, match):
    learn = exported_learner(tmp_path)
    before = held(learn)
    with pytest.raises(error, match=match): getattr(learn, call)(*args, **kwargs)
    assert_given_back(learn, before)
    assert sorted(os.listdir(tmp_path)) == []

# ---- a folder that cannot be written to, a target that is a folder: the error names the file asked for

def assert_names_the_target(e, target):
    msg = str(e.value)
    assert str(target) in msg and '.tmp' not in msg, f"the error should name {target}, not the temporary file: {msg}"
    assert e.value.filename == str(target) and 'previous file' in msg and isinstance(e.value.__cause__, OSError)

def test_a_target_that_is_a_folder_is_named(tmp_path):
    learn = synth_learner(path=tmp_path).to_mixed(torch.bfloat16)
    (tmp_path/'models'/'ck.pth').mkdir(parents=True)
    with pytest.raises(IsADirectoryError) as e: learn.save_atomic('ck', with_opt=False)
    assert_names_the_target(e, tmp_path/'models'/'ck.pth')
    assert 'is a folder' in str(e.value) and sorted(os.listdir(tmp_path/'models')) == ['ck.pth']
    learn = exported_learner(tmp_path)
    (tmp_path/'export.pkl').mkdir()
    with pytest.raises(IsADirectoryError) as e: learn.export_atomic('export.pkl')
    assert_names_the_target(e, tmp_path/'export.pkl')

@pytest.mark.parametrize('err', ['EACCES', 'EPERM', 'EROFS', 'ENOTDIR'])
def test_a_folder_that_cannot_be_written_to_is_named_with_what_to_do(tmp_path, monkeypatch, err):
    "As root, a read-only folder is still written to: the errors the system gives are raised where it gives them"
    import errno
    from mpcallbacks import checkpoint
    learn = synth_learner(path=tmp_path).to_mixed(torch.bfloat16)
    learn.save_atomic('ck', with_opt=False)
    good = (tmp_path/'models'/'ck.pth').read_bytes()
    code = getattr(errno, err)
    def refused(src, dst): raise OSError(code, os.strerror(code), str(src), None, str(dst))
    monkeypatch.setattr(checkpoint.os, 'replace', refused)
    with pytest.raises(type(OSError(code, ''))) as e: learn.save_atomic('ck', with_opt=False)
    monkeypatch.undo()
    assert_names_the_target(e, tmp_path/'models'/'ck.pth')
    assert 'save elsewhere' in str(e.value)
    assert (tmp_path/'models'/'ck.pth').read_bytes() == good and sorted(os.listdir(tmp_path/'models')) == ['ck.pth']

@pytest.mark.skipif(os.name != 'posix' or os.geteuid() == 0, reason="root writes to read-only folders")
def test_a_read_only_folder_is_named_with_what_to_do(tmp_path):
    learn = synth_learner(path=tmp_path).to_mixed(torch.bfloat16)
    learn.save_atomic('ck', with_opt=False)
    os.chmod(tmp_path/'models', 0o555)
    try:
        with pytest.raises(PermissionError) as e: learn.save_atomic('ck', with_opt=False)
    finally: os.chmod(tmp_path/'models', 0o755)
    assert_names_the_target(e, tmp_path/'models'/'ck.pth')
