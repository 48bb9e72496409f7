"The public surface: what users import and call keeps its names, arguments and meaning across the refactors."
import inspect, subprocess, sys
import pytest, torch
from fastai.basics import Learner
from mpcallbacks.test_utils import synth_learner

def test_star_imports_leave_fastais_norm_types_alone():
    code = ("import fastai.basics as fb\nfrom fastai.basics import *\nfrom mpcallbacks.all import *\n"
            "assert norm_types is fb.norm_types, norm_types\nassert nn.LayerNorm in norm_types\nprint('ok')")
    out = subprocess.run([sys.executable, '-W', 'ignore', '-c', code], capture_output=True, text=True)
    assert out.stdout.strip() == 'ok', out.stderr

@pytest.mark.parametrize('module,names', [
    ('mpcallbacks.callback', ['MasterMixedPrecision', 'as_16bit_dtype', 'warn_if_slow']),
    ('mpcallbacks.checkpoint', ['OptimizerWithScaler']),
    ('mpcallbacks.cast', ['cast_model', 'ModelCast', 'keeps_fp32', 'norm_types', 'mixed_input_types', 'always_fp32']),
    ('mpcallbacks.scaler', ['LossScaler', 'NonFiniteGradients', 'make_scaler']),
    ('mpcallbacks.master', ['MasterParams', 'GradPhase', 'GradPhaseError']),
    ('mpcallbacks.all', ['MasterMixedPrecision', 'LossScaler', 'cast_model', 'MasterParams', 'OptimizerWithScaler', 'RankAgreement']),
])
def test_old_and_new_names_import(module, names):
    code = f"from {module} import {', '.join(names)}\nfrom fastai.basics import Learner\n"
    # only `mpcallbacks.learner` (which `mpcallbacks.all` imports) changes fastai's Learner
    code += f"assert hasattr(Learner, 'to_mixed') == {module == 'mpcallbacks.all'}"
    out = subprocess.run([sys.executable, '-W', 'ignore', '-c', code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr

scaler_args = ['init_scale', 'growth_factor', 'backoff_factor', 'growth_interval', 'min_scale', 'max_consecutive_skips']

def test_scaler_arguments_are_declared_once_and_reach_to_mixed_with_their_docs():
    from fastcore.docments import docments
    from mpcallbacks.callback import MasterMixedPrecision
    from mpcallbacks.scaler import LossScaler
    for f in (Learner.to_mixed, MasterMixedPrecision, LossScaler.from_loss_scale):
        params = inspect.signature(f).parameters
        assert all(a in params for a in scaler_args), f
        for a in scaler_args: assert params[a].default == inspect.signature(LossScaler).parameters[a].default, (f, a)
    docs = docments(Learner.to_mixed, full=True)
    assert all(docs[a]['docment'] == docments(LossScaler, full=True)[a]['docment'] for a in scaler_args)
    assert {'dtype', 'loss_scale', 'keep_fp32', 'mixed_inference'} <= set(inspect.signature(Learner.to_mixed).parameters)

def test_to_mixed_keeps_its_keyword_arguments_and_readouts():
    learn = synth_learner().to_mixed(torch.bfloat16, loss_scale='dynamic', init_scale=2.**10, growth_factor=2., backoff_factor=.5,
                                      growth_interval=7, min_scale=2., max_consecutive_skips=30, keep_fp32=(), mixed_inference=False)
    mmp = learn.master_mixed_precision
    assert (mmp.loss_scale, mmp.skipped, mmp.scaler.growth_interval, mmp.scaler.min_scale) == (2.**10, 0, 7, 2.)
    learn.fit(1, 1e-2)
    assert callable(mmp.plot_loss_scale) and isinstance(mmp.loss_scale, float)

def test_importing_mpcallbacks_leaves_fastais_defaults_alone():
    code = ("from fastai.learner import defaults\nbefore = list(defaults.callbacks)\nfrom mpcallbacks.all import *\n"
            "assert defaults.callbacks == before, (before, defaults.callbacks)\nprint('ok')")
    out = subprocess.run([sys.executable, '-W', 'ignore', '-c', code], capture_output=True, text=True)
    assert out.stdout.strip() == 'ok', out.stderr

@pytest.mark.parametrize('fastai_first', [True, False], ids=['fastai.callback.fp16 first', 'mpcallbacks first'])
def test_fastais_to_fp32_removes_ours_too(fastai_first):
    code = ("import fastai.callback.fp16\nfrom mpcallbacks.all import *\n" if fastai_first else
            "from mpcallbacks.all import *\nimport fastai.callback.fp16\n")
    code += ("from mpcallbacks.test_utils import synth_learner\nimport torch\n"
             "for undo in ('to_fp32', 'to_non_native_fp32'):\n"
             "    learn = synth_learner().to_mixed(torch.bfloat16)\n"
             "    getattr(learn, undo)()\n"
             "    assert not learn._grab_cbs(MasterMixedPrecision), undo\n"
             "    learn.fit(1)\n"
             "    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}\n"
             "print('ok')")
    out = subprocess.run([sys.executable, '-W', 'ignore', '-c', code], capture_output=True, text=True)
    assert out.stdout.strip() == 'ok', out.stderr

_undo_orders = {'fastai.callback.fp16 first': ("import fastai.callback.fp16\nfrom mpcallbacks.all import *\n", ''),
                'mpcallbacks first': ("from mpcallbacks.all import *\nimport fastai.callback.fp16\n", ''),
                'fastai.callback.fp16 after a to_mixed': ("from mpcallbacks.all import *\n", "import fastai.callback.fp16\n")}

@pytest.mark.parametrize('order', list(_undo_orders))
def test_fastais_to_fp32_is_wrapped_once(order):
    "Once fastai's `to_fp32`/`to_non_native_fp32` remove ours, `to_mixed` wraps nothing again, not even another library's wrapper of them"
    imports,later = _undo_orders[order]
    code = imports + ("from mpcallbacks.test_utils import synth_learner\nimport torch\nfrom fastai.basics import Learner\n"
                      "synth_learner().to_mixed(torch.bfloat16)\n" + later +
                      "learn = synth_learner().to_mixed(torch.bfloat16)\n"
                      "undos = {n:Learner.__dict__[n] for n in ('to_fp32', 'to_non_native_fp32')}\n"
                      "for _ in range(3): learn.to_mixed(torch.bfloat16)\n"
                      "assert all(Learner.__dict__[n] is f for n,f in undos.items()), 'to_mixed wrapped fastai again'\n"
                      # another library wraps fastai's `to_fp32` after us: its wrapper stays as it is, and still removes ours
                      "def theirs(self, *args, **kwargs): return undos['to_fp32'](self, *args, **kwargs)\n"
                      "Learner.to_fp32 = theirs\n"
                      "learn.to_mixed(torch.bfloat16)\n"
                      "assert Learner.__dict__['to_fp32'] is theirs, 'to_mixed wrapped a wrapper'\n"
                      "learn.to_fp32()\n"
                      "assert not learn._grab_cbs(MasterMixedPrecision)\n"
                      "print('ok')")
    out = subprocess.run([sys.executable, '-W', 'ignore', '-c', code], capture_output=True, text=True)
    assert out.stdout.strip() == 'ok', out.stderr

def test_importing_the_callback_changes_nothing_of_fastai():
    "Only `mpcallbacks.checkpoint`, `mpcallbacks.doctor` and `mpcallbacks.learner` change fastai's `Learner`: the callback, the cast and the scaler leave it as it is"
    code = ("from fastai.basics import Learner\nbefore = dict(vars(Learner))\n"
            "import mpcallbacks.callback, mpcallbacks.cast, mpcallbacks.scaler, mpcallbacks.master, mpcallbacks.mixed_fit, mpcallbacks.distributed\n"
            "assert dict(vars(Learner)) == before, set(vars(Learner)) ^ set(before)\n"
            "import mpcallbacks.learner\n"
            "changed = sorted(k for k in vars(Learner) if vars(Learner)[k] is not before.get(k))\nprint(changed)")
    out = subprocess.run([sys.executable, '-W', 'ignore', '-c', code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    # added methods, and the replaced fastai methods: `fit`, `__getstate__` (a pickle or an export is the FP32 learner) and
    # `validation_context` (a failed start of an inference unwinds what it entered)
    assert out.stdout.strip() == str(['__deepcopy__', '__getstate__', 'export_atomic', 'fit', 'load_checked', 'mixed_summary', 'plot_loss_scale', 'precision_report', 'save_atomic', 'to_mixed', 'to_unmixed', 'validation_context'])

def _documented():
    "Every name a module exports, and the methods its classes define: what the docs' show_doc renders"
    import importlib, mpcallbacks._modidx as mi
    for mod in sorted(mi.d['syms']):
        m = importlib.import_module(mod)
        for name in getattr(m, '__all__', []):
            obj = getattr(m, name)
            if inspect.isfunction(obj) or inspect.isclass(obj): yield f'{mod}.{name}', obj
            if inspect.isclass(obj):
                for k,v in vars(obj).items():
                    if inspect.isfunction(v) and not k.startswith('_'): yield f'{mod}.{name}.{k}', v

def test_every_documented_signature_resolves_its_annotations():
    # show_doc reads signatures with eval_str=True: an annotation naming a type its module never imports broke the docs
    bad = []
    for name,obj in _documented():
        try: inspect.signature(obj, eval_str=True)
        except (NameError, AttributeError, SyntaxError) as e: bad.append(f'{name}: {e}')
        except (ValueError, TypeError): pass # no signature to read (a builtin's)
    assert not bad, bad


def test_the_learner_page_lists_every_change_importing_makes_to_learner():
    "The Learner page (and the README) says importing changes fastai's `Learner` in the ways its table lists 'and in no other': the table names each"
    import json, re
    from pathlib import Path
    code = ("import json\nfrom fastai.basics import Learner\nbefore = dict(vars(Learner))\nimport mpcallbacks.all\n"
            "print(json.dumps(sorted(k for k,v in vars(Learner).items() if before.get(k, None) is not v)))")
    out = subprocess.run([sys.executable, '-W', 'ignore', '-c', code], capture_output=True, text=True)
    changed = json.loads(out.stdout)
    nb = json.loads((Path(__file__).parent.parent/'nbs'/'05_learner.ipynb').read_text())
    text = next(''.join(c['source']) for c in nb['cells'] if ''.join(c['source']).startswith('## What importing changes'))
    table = '\n'.join(l for l in text.splitlines() if l.startswith('|'))
    listed = set(re.findall(r'`(\w+)`', table))
    assert {'to_mixed', 'fit', '__getstate__'} <= set(changed), changed
    assert set(changed) <= listed, f'changed by importing but not in the table: {sorted(set(changed) - listed)}'
    readme = json.loads((Path(__file__).parent.parent/'nbs'/'index.ipynb').read_text())
    text = next(''.join(c['source']) for c in readme['cells'] if '## What importing changes' in ''.join(c['source']))
    named = set(re.findall(r'`(\w+)`', text.split('## What importing changes')[1]))
    assert set(changed) <= named, f"changed by importing but not in the README: {sorted(set(changed) - named)}"
