"The checker of the docs' examples (tools/check_examples.py): a shown cell that needs what only a hidden cell gives fails, by name or when run"
import json, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT/'tools'))
import check_examples # noqa: E402

def notebook(tmp_path, cells) -> Path:
    "A notebook of code cells: (source, hidden)"
    nb = dict(nbformat=4, nbformat_minor=5, metadata={}, cells=[
        dict(cell_type='code', id=f'c{i}', metadata={}, outputs=[], execution_count=None,
             source=('#| hide\n' if hidden else '') + src) for i,(src,hidden) in enumerate(cells)])
    path = tmp_path/'page.ipynb'
    path.write_text(json.dumps(nb))
    return path

def test_a_method_patched_on_by_a_hidden_import_is_found_by_running_not_by_names(tmp_path):
    "fastai's `Learner.fit_one_cycle` comes with `fastai.callback.schedule`: a name check sees `learn`, bound by a shown cell, and nothing wrong"
    cells = [('class Box: pass', False),
             ('Box.double = lambda self: 2', True), # (what a hidden import's patch does)
             ('box = Box()\nbox.double()', False)]
    path = notebook(tmp_path, cells)
    assert check_examples.scan(path) == []
    found = check_examples.run_shown(path)
    assert [(cid, err.split(':')[0]) for cid,_,err in found] == [('c2', 'AttributeError')]
    path = notebook(tmp_path, [cells[0], (cells[1][0], False), cells[2]]) # the same patch, shown
    assert check_examples.run_shown(path) == []

def test_a_name_bound_only_by_a_hidden_cell_is_found_by_names(tmp_path):
    path = notebook(tmp_path, [('secret = 42', True), ('secret + 1', False)])
    assert [(kind, name) for kind,name,*_ in check_examples.scan(path)] == [('hidden', 'secret')]
    assert [cid for cid,*_ in check_examples.run_shown(path)] == ['c1']

def test_a_shown_line_longer_than_a_code_box_fails_and_a_hidden_one_does_not(tmp_path):
    long = 'x = ' + '1 + ' * 30 + '1' # 125 characters
    path = notebook(tmp_path, [(long, True), ('y = 1\n' + long, False)])
    assert check_examples.long_lines(path) == [('c1', 2, len(long))]
    assert check_examples.main([str(path)]) == 1
    assert check_examples.main([str(notebook(tmp_path, [(long, True)]))]) == 0
