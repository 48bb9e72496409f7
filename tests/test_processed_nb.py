"The docs build's reading of nbdev's processed notebooks (tools/processed_nb.py): a documented property shows as one"
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT/'tools'))
from processed_nb import mark_properties # noqa: E402

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
