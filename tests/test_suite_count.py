"The README's count of tests is the suite's own: bench/results/suite.json, which the README renders, counts what pytest collects"
import json, os
from pathlib import Path
import fastai, pytest, torch

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT/'bench'/'results'/'suite.json'


def whole_suite(config) -> bool:
    "Whether this session collected every test: `pytest` or `pytest tests`, nothing selected out"
    args = {Path(a).resolve() for a in config.args}
    return (args <= {ROOT, ROOT/'tests'} and not config.option.keyword and not config.option.markexpr
            and not config.getoption('deselect', None) and not config.getoption('lf', False))


def recorded_count(suite:dict) -> int:
    "The count the README quotes: the latest `--count` (or full run) of tools/measure_suite.py"
    return suite.get('count', suite['pytest'])['tests']


def test_the_count_the_readme_quotes_is_the_suite_count(request):
    if os.environ.get('MPCALLBACKS_TIMING_SUITE'): pytest.skip('tools/measure_suite.py is timing this run: it records the count')
    if not whole_suite(request.config): pytest.skip('a part of the suite was selected: its count is not the suite count')
    suite = json.loads(SUITE.read_text())
    stack = suite['stack']
    if (torch.__version__.split('+')[0], fastai.__version__) != (stack['torch'].split('+')[0], stack['fastai']):
        pytest.skip(f"the count is the pinned stack's (torch {stack['torch']}, fastai {stack['fastai']}): "
                    'another stack may parametrize some tests otherwise')
    recorded,collected = recorded_count(suite),len(request.session.items)
    assert collected == recorded, (f'pytest collects {collected} tests, {SUITE.relative_to(ROOT)} (which the README quotes) '
                                   f'counts {recorded}: `make suite-count` records the new count (seconds) and renders '
                                   'the README again')


def test_the_recorded_count_is_the_latest():
    "A full run records its count as the latest too; a `--count` keeps the full run's own count beside it"
    suite = json.loads(SUITE.read_text())
    assert recorded_count(suite) > 0 and suite['pytest']['tests'] > 0
    if 'count' in suite: assert suite['count']['date'] >= suite['date']
