"The README's count of tests is the suite's own: bench/results/suite.json, which the README renders, counts what pytest collects"
import json, os
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT/'bench'/'results'/'suite.json'


def whole_suite(config) -> bool:
    "Whether this session collected every test: `pytest` or `pytest tests`, nothing selected out"
    args = {Path(a).resolve() for a in config.args}
    return (args <= {ROOT, ROOT/'tests'} and not config.option.keyword and not config.option.markexpr
            and not config.getoption('deselect', None) and not config.getoption('lf', False))


def test_the_count_the_readme_quotes_is_the_suite_count(request):
    if os.environ.get('MPCALLBACKS_TIMING_SUITE'): pytest.skip('tools/measure_suite.py is timing this run: it records the count')
    if not whole_suite(request.config): pytest.skip('a part of the suite was selected: its count is not the suite count')
    recorded = json.loads(SUITE.read_text())['pytest']['tests']
    collected = len(request.session.items)
    assert collected == recorded, (f'pytest collects {collected} tests, {SUITE.relative_to(ROOT)} (which the README quotes) '
                                   f'counts {recorded}: time the suite again with `python tools/measure_suite.py`, then `make numbers readme`')
