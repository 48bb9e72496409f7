"The docs build's reading of nbdev's processed notebooks (tools/processed_nb.py): a documented property or class shows as one"
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT/'tools'))
from processed_nb import mark_classes, mark_properties, param_tables # noqa: E402

def doc(cls:str, name:str, sig:str) -> str:
    "show_doc's markdown for `cls.name`, as nbdev writes it"
    return (f'---\n\n[source](https://github.com/mpcallbacks/mpcallbacks/blob/main/mpcallbacks/callback.py#L76)'
            f'{{target="_blank" style="float:right; font-size:smaller"}}\n\n### {cls}.{name}\n\n```python\n{sig}\n```\n\n*Its doc*')

def test_a_property_is_shown_as_one_and_a_method_as_it_was():
    got = mark_properties(doc('MasterMixedPrecision', 'loss_scale', 'def loss_scale()->float:'))
    assert '```python\n@property\ndef loss_scale(self)->float:\n```' in got and 'def loss_scale()' not in got
    got = mark_properties(doc('LossScale', 'value', 'def value()->float | None: # None for a learner without `to_mixed`'))
    assert '```python\n@property\ndef value(self)->float | None: # None for a learner without `to_mixed`\n```' in got
    for name,sig in (('plot_loss_scale', 'def plot_loss_scale()->float:'), ('nothing_here', 'def nothing_here()->int:')):
        md = doc('MasterMixedPrecision', name, sig) # a method; a name the class does not have
        assert mark_properties(md) == md


def heading(name:str, sig:str, mod:str='callback') -> str:
    "show_doc's markdown for a class or function `name` of `mpcallbacks.mod`"
    return (f'---\n\n[source](https://github.com/mpcallbacks/mpcallbacks/blob/main/mpcallbacks/{mod}.py#L44)'
            f'{{target="_blank" style="float:right; font-size:smaller"}}\n\n### {name}\n\n```python\n{sig}\n```\n\n*Its doc*')

def test_a_class_is_shown_as_one_with_its_init_and_a_function_as_it_was():
    sig = "def MasterMixedPrecision(\n    dtype:torch.dtype | None=None, # `torch.float16` or `torch.bfloat16`\n    keep_fp32:tuple | str=(), # More (kept)\n):"
    got = mark_classes(heading('MasterMixedPrecision', sig))
    assert ('```python\nclass MasterMixedPrecision(Callback):\n    def __init__(self,\n        dtype:torch.dtype | None=None, # `torch.float16` '
            'or `torch.bfloat16`\n        keep_fp32:tuple | str=(), # More (kept)\n    ):\n```') in got, got
    assert 'def MasterMixedPrecision' not in got
    # no parameters of its own: the class line alone; a private base: the first public one above it
    assert '```python\nclass LossScale(Metric):\n```' in mark_classes(heading('LossScale', 'def LossScale():'))
    assert '```python\nclass NonFiniteGradients(FloatingPointError):\n```' in mark_classes(heading('NonFiniteGradients', 'def NonFiniteGradients(\n    *args, **kwargs\n):', 'scaler'))
    # a function, followed by a class on the same page: each block is read on its own
    md = heading('check_no_fastai_fp16', 'def check_no_fastai_fp16(\n    learn\n)->None:') + '\n\n' + heading('LossScale', 'def LossScale():')
    got = mark_classes(md)
    assert 'def check_no_fastai_fp16(\n    learn\n)->None:' in got and 'class LossScale(Metric):' in got

def test_a_named_constant_default_shows_its_name_not_its_value():
    from mpcallbacks.policy import always_fp32
    from processed_nb import name_defaults
    sig = f"def measured_modules(\n    keep:tuple={always_fp32!r}, # Types\n):"
    got = name_defaults(heading('measured_modules', sig, 'doctor'))
    assert 'keep:tuple=always_fp32, # Types' in got and '<class' not in got


def test_a_signature_with_commented_parameters_gets_a_table_and_loses_its_comments():
    from processed_nb import param_tables
    sig = ("def to_mixed(\n    dtype:torch.dtype | None=None, # `torch.float16`; None: chosen\n    *,\n"
           "    loss_scale:str | float='auto', # 'dynamic' or a number\n    plain=3,\n    *, kw:int=1, # keyword only\n)->Learner: # The learner itself")
    got = param_tables(heading('Learner.to_mixed', sig, 'learner'))
    code = got.split('```python\n')[1].split('```')[0]
    assert '#' not in code and 'dtype:torch.dtype | None=None,\n' in code and code.rstrip().endswith(')->Learner:')
    rows = got.split('*Its doc*')[1].strip().split('\n')
    assert rows[0] == '| Parameter | Type | Default | Details |'
    assert rows[2] == '| `dtype` | <code>torch.dtype &#124; None</code> | <code>None</code> | `torch.float16`; None: chosen |'
    assert rows[3] == "| `loss_scale` | <code>str &#124; float</code> | <code>&#x27;auto&#x27;</code> | 'dynamic' or a number |"
    assert rows[4] == '| `plain` |  | <code>3</code> |  |' and rows[5] == '| `kw` | <code>int</code> | <code>1</code> | keyword only |'
    assert rows[6] == '| **returns** | <code>Learner</code> |  | The learner itself |'
    # a signature on one line, or one without comments, stays as show_doc wrote it
    for sig in ("def value(self)->float: # None without `to_mixed`", "def f(\n    a:int=1,\n    b=2,\n):"):
        md = heading('f', sig)
        assert param_tables(md) == md


def test_a_formula_is_indexed_for_search_as_plain_text():
    "The search index holds a formula's TeX (an image's alt text) as its symbols and digits, so a snippet reads `2^16`, not `2^{16}`"
    from build_docs import plain_tex
    assert plain_tex(r'2^{-24}\approx 6\times10^{-8}') == '2^-24≈ 6×10^-8'
    assert plain_tex('2^{16}') == '2^16' and plain_tex(r'\log_2(\text{max})') == 'log_2(max)'

def test_a_parameters_comment_is_found_after_an_escaped_quote():
    from processed_nb import _split_comment, _top_level
    line = r"""sep:str='it\'s # not a comment', # the separator"""
    assert _split_comment(line) == (r"""sep:str='it\'s # not a comment',""", 'the separator')
    assert _split_comment('x = "a \\" # b" # c') == ('x = "a \\" # b"', 'c')
    assert _top_level(r"""a='x\', y', b=2""", ',') == len(r"""a='x\', y'""")

def test_a_kwargs_comment_stays_with_kwargs_and_a_none_default_has_no_type():
    # fastcore's docments hands the comment of a last `**kwargs` line to the return: the table reads it from the source
    import inspect
    from fastai.learner import Learner
    import mpcallbacks.checkpoint # noqa: F401 (Learner.load_checked)
    line = inspect.getsourcelines(Learner.load_checked)[1]
    md = (f'---\n\n[source](https://github.com/mpcallbacks/mpcallbacks/blob/main/mpcallbacks/checkpoint.py#L{line})'
          '{target="_blank" style="float:right; font-size:smaller"}\n\n### Learner.load_checked\n\n```python\ndef load_checked(\n'
          "    file, # A name\n    device:NoneType=None, # A device\n    **kwargs\n)->Learner: # Passed to `learn.load`: `with_opt`\n```\n\n*doc*")
    got = param_tables(md)
    assert "| `**kwargs` |  |  | Passed to `learn.load`: `with_opt`" in got, got
    assert '**returns**' not in got # (the source's closing line has no comment)
    assert "| `device` |  | <code>None</code> | A device |" in got and 'device=None,' in got and 'NoneType' not in got

def test_a_fold_mark_folds_the_cells_up_to_the_next_h2():
    from bs4 import BeautifulSoup
    from build_docs import fold_sections
    cell = lambda inner: f'<div class="jp-Cell">{inner}</div>'
    soup = BeautifulSoup('<main>' + cell('<h2>Inside</h2><p>For contributors.</p><span data-fold="Show it"></span>')
                         + cell('<h3 id="probe">Probe</h3>') + cell('<p>more</p>') + cell('<h2>Next</h2>') + '</main>', 'html.parser')
    fold_sections(soup)
    fold = soup.select_one('details.section-fold')
    assert fold.summary.get_text() == 'Show it' and not soup.select('span[data-fold]')
    assert [c.get_text() for c in fold.select('div.jp-Cell')] == ['Probe', 'more'] # up to the next h2, which stays out
    assert fold.find_previous_sibling('div').h2.get_text() == 'Inside' and fold.find_next_sibling('div').h2.get_text() == 'Next'
