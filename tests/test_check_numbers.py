"The checker of quoted numbers (tools/check_numbers.py): a number not in the file it cites fails, a stale rendered sentence fails"
import json, re, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT/'tools'))
import check_numbers # noqa: E402
from rendered_numbers import REPO, SITE, github_anchor, results_md # noqa: E402

RESULTS = """# mpcallbacks benchmark

torch 2.14.1, fastai 2.8.12, Python 3.11.7; CPU: Some CPU, 2 cores, 1 torch threads; 2026-11-26 21:26 UTC. Medians.

### 2. Whole training step (median ms)

| model | dtype | FP32 ms | to_mixed ms |
|---|---|---|---|
| digits CNN | bfloat16 | 3.94 | **4.44** |
| digits CNN | float16 | 3.96 | 60.90 |

### 3. Memory: bytes per parameter

| mode | between steps |
|---|---|
| FP32 | 16.00 |
"""
STEP = github_anchor('2. Whole training step (median ms)')


def repo(tmp_path, readme:str, cells=()) -> Path:
    "A repository holding results.md, a README and a notebook of `cells`"
    (tmp_path/'bench'/'results').mkdir(parents=True)
    (tmp_path/'bench'/'results'/'results.md').write_text(RESULTS)
    (tmp_path/'README.md').write_text(readme)
    (tmp_path/'nbs').mkdir()
    nb = {'cells': list(cells), 'metadata': {}, 'nbformat': 4, 'nbformat_minor': 5}
    (tmp_path/'nbs'/'index.ipynb').write_text(json.dumps(nb))
    return tmp_path


def quoted_errors(root:Path) -> list: return check_numbers.check_quoted(root, check_numbers.documents(root))


def cites_step(sentence:str) -> str: return sentence.replace('LINK', f'[measured]({REPO}bench/results/results.md#{STEP})')


def test_a_quoted_number_not_in_the_cited_section_fails(tmp_path):
    root = repo(tmp_path, cites_step('A step took 4.73 ms in bfloat16 against 3.94 ms in FP32 (LINK).\n'))
    errors = quoted_errors(root)
    assert len(errors) == 1 and '4.73' in errors[0] and 'README.md' in errors[0], errors


def test_numbers_in_the_cited_section_pass(tmp_path):
    root = repo(tmp_path, cites_step('A step took 4.44 ms in bfloat16 against 3.94 ms in FP32, and 60.90 ms in float16 (LINK).\n'))
    assert quoted_errors(root) == []


def test_the_section_is_what_is_cited(tmp_path):
    "16.00 is in the file, but in section 3, not in the section the link names"
    root = repo(tmp_path, cites_step('FP32 keeps 16.00 bytes per parameter (LINK).\n'))
    assert [e for e in quoted_errors(root) if '16.00' in e]


def test_rounded_quotes_pass_and_wrong_ones_fail(tmp_path):
    link = f'[state]({REPO}bench/results/results.md#{github_anchor("3. Memory: bytes per parameter")})'
    assert quoted_errors(repo(tmp_path/'a', f'FP32 keeps {link}: 16 bytes per parameter.\n')) == []
    assert quoted_errors(repo(tmp_path/'b', f'FP32 keeps {link}: 16.1 bytes per parameter.\n'))


def test_numbers_in_code_and_unrelated_sentences_are_not_quotes(tmp_path):
    readme = cites_step('Run `to_mixed(bs=4.73)` (LINK). A sentence without a citing link may say 4.73.\n')
    assert quoted_errors(repo(tmp_path, readme)) == []


def test_a_table_cell_is_its_own_context(tmp_path):
    readme = cites_step('| a | b |\n|---|---|\n| 4.44 ms (LINK) | 9.99 ms elsewhere |\n| 7.77 ms (LINK) | - |\n')
    errors = quoted_errors(repo(tmp_path, readme))
    assert len(errors) == 1 and '7.77' in errors[0], errors


def test_a_measured_link_to_a_docs_page_cites_its_notebook(tmp_path):
    page = {'cell_type': 'markdown', 'id': 'a', 'metadata': {}, 'source': 'It steps in 159 ms, the fused kernel in 21 ms.'}
    root = repo(tmp_path, f'21 ms against 159 ms ([measured]({SITE}index.html)), not 7.6x ([measured]({SITE}index.html)).\n', [page])
    errors = quoted_errors(root)
    assert len(errors) == 1 and '7.6' in errors[0], errors


def rendered_cell(output:str|None) -> dict:
    src = ("#| echo: false\n"
           "import sys; from rendered_numbers import * # numbers from bench/results\n"
           "r = results_md('../bench/results/results.md')\n"
           "row = r.section('2.').table().find(model='digits CNN', dtype='bfloat16')\n"
           "Markdown(f\"A step took {row['to_mixed ms']} ms ({r.section('2.').link()}).\")")
    outs = [check_numbers.markdown_output(output)] if output is not None else []
    return {'cell_type': 'code', 'execution_count': None, 'id': 'r', 'metadata': {}, 'outputs': outs, 'source': src}


def test_a_stale_rendered_cell_fails_and_fix_refreshes_it(tmp_path):
    root = repo(tmp_path, '', [rendered_cell('A step took 4.73 ms (old).')])
    errors = check_numbers.check_rendered(root/'nbs')
    assert len(errors) == 1 and 'make numbers' in errors[0], errors
    assert check_numbers.check_rendered(root/'nbs', fix=True) == []
    assert check_numbers.check_rendered(root/'nbs') == []
    saved = check_numbers._markdown_output(json.loads((root/'nbs'/'index.ipynb').read_text())['cells'][0])
    assert saved.startswith('A step took 4.44 ms ([measured](') and STEP in saved


def test_a_rendered_cell_follows_the_results(tmp_path):
    root = repo(tmp_path, '', [rendered_cell(None)])
    check_numbers.check_rendered(root/'nbs', fix=True)
    path = root/'bench'/'results'/'results.md'
    path.write_text(path.read_text().replace('**4.44**', '**4.50**'))
    assert check_numbers.check_rendered(root/'nbs')
    check_numbers.check_rendered(root/'nbs', fix=True)
    assert '4.50 ms' in check_numbers._markdown_output(json.loads((root/'nbs'/'index.ipynb').read_text())['cells'][0])


def test_the_results_parse():
    r = results_md()
    assert r.env()['device']
    for prefix in ['2.', '3.', '3b.', '8b.', 'The optimizer under']: assert r.section(prefix).table().rows


def test_this_repository_passes(capsys):
    assert check_numbers.main(['--root', str(ROOT)]) == 0, capsys.readouterr().out


def test_contributing_quotes_the_dependencies_pyproject_declares():
    "CONTRIBUTING.md's sentence on the floors names exactly the requirements of pyproject.toml on torch, fastai, fastcore"
    declared = re.search(r'^dependencies = \[(.*)\]', (ROOT/'pyproject.toml').read_text(), re.M).group(1)
    declared = {s for s in re.findall(r'"([^"]+)"', declared) if re.match(r'(torch|fastai|fastcore)\W', s)}
    sentence = re.search(r'`pyproject.toml` declares (.*?)[:.]\s', (ROOT/'CONTRIBUTING.md').read_text(), re.S).group(1)
    assert set(re.findall(r'`([^`]+)`', sentence)) == declared


def test_a_number_a_rendered_cell_types_is_checked_against_the_cited_text(tmp_path):
    "What a rendered cell reads from the results is checked by rendering it; what it writes out by hand, like any quote"
    cell = rendered_cell(None)
    cell['source'] = cell['source'].replace('ms (', 'ms, and 7.77 ms typed by hand (')
    root = repo(tmp_path, '', [cell])
    check_numbers.check_rendered(root/'nbs', fix=True)
    rendered = {}
    assert check_numbers.check_rendered(root/'nbs', seen=rendered) == []
    errors = check_numbers.check_quoted(root, check_numbers.documents(root), rendered)
    assert len(errors) == 1 and '7.77' in errors[0], errors


def test_each_item_of_a_list_is_read_on_its_own():
    # a number in one item is not taken for a quote of the link in the item before it
    md = (f"- **The step**: 4.44 ms ([measured]({REPO}bench/results/results.md#{STEP}))\n"
          "- **Floors**: torch 2.4.1 and fastai 2.8.8")
    got = check_numbers.blocks(md)
    assert any('4.44' in b and 'measured' in b for b in got)
    assert not any('4.44' in b and '2.4.1' in b for b in got), got
