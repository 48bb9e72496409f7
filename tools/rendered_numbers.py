"""The numbers the README and the docs quote, read from the files that measured them, for the cells that write those sentences.

A page states a measured number by rendering it: a cell with `#| echo: false` whose code reads the results and returns
the sentence (`Markdown(...)`), its first line this module's import:

    #| echo: false
    import sys; sys.path.insert(0, '../tools'); from rendered_numbers import * # numbers from bench/results
    r = results_md()
    Markdown(f"... {r.section('2.').table().find(model='digits CNN (BatchNorm)', dtype='bfloat16')['to_mixed ms']} ms ...")

`tools/check_numbers.py` (in `make test`) runs each such cell again and fails when its saved output differs from what
the files say now; `make numbers` saves the fresh outputs (and `make readme` then writes README.md). The files read:

- `bench/results/results.md`, written by `make bench`: `results_md()` parses its sections and tables;
- `bench/results/install.json`, appended by `tools/measure_install.py --record`: `install_runs()`;
- `bench/results/suite.json`, written by `tools/measure_suite.py`: `suite()`;
- `bench/results/gpu.json`, written by `python -m bench.gpu` on a GPU machine: `gpu_results()`;
- `constraints.txt`, the pinned stack: `pinned()`.

Only the standard library (IPython's `Markdown` where it is installed), so the checker runs it anywhere."""
from __future__ import annotations
import json, re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT/'bench'/'results'
REPO = 'https://github.com/mpcallbacks/mpcallbacks/blob/main/'
SITE = 'https://mpcallbacks.github.io/mpcallbacks/'

try: from IPython.display import Markdown
except ImportError: # the checker without IPython: the text itself
    class Markdown(str):
        @property
        def data(self): return str(self)

__all__ = ['ROOT', 'RESULTS', 'REPO', 'SITE', 'Markdown', 'github_anchor', 'Table', 'Section', 'Results', 'results_md', 'floor_stack',
           'num', 'link', 'install_runs', 'suite', 'gpu_results', 'pinned', 'gb', 'minutes', 'plural']


def github_anchor(heading:str) -> str:
    "The anchor GitHub gives a markdown heading: lower case, punctuation dropped, each space a hyphen"
    s = heading.strip().lower()
    s = re.sub(r'[^\w\- ]', '', s)
    return s.replace(' ', '-')


def _cells(line:str) -> list:
    return [c.strip() for c in re.split(r'(?<!\\)\|', line.strip().strip('|'))]


def _plain(cell:str) -> str: return cell.replace('**', '').replace('\\|', '|').strip()


class Table:
    "A markdown table: `columns`, and `rows` as dicts from column name to the cell's text (bold markers removed)"
    def __init__(self, lines:list):
        self.columns = [_plain(c) for c in _cells(lines[0])]
        self.rows = [dict(zip(self.columns, map(_plain, _cells(l)))) for l in lines[2:]]

    def find(self, **where) -> dict:
        "The one row whose cells equal `where` (keys: column names, spaces as underscores, or the names themselves)"
        cols = {c.replace(' ', '_'):c for c in self.columns}
        crit = {cols.get(k, k):v for k,v in where.items()}
        missing = [k for k in crit if k not in self.columns]
        if missing: raise KeyError(f'no column {missing} in a table with columns {self.columns}')
        rows = [r for r in self.rows if all(r[k] == v for k,v in crit.items())]
        if len(rows) != 1: raise LookupError(f'{len(rows)} rows with {crit} in the table of columns {self.columns}')
        return rows[0]

    def column(self, prefix:str) -> str:
        "The one column whose name starts with `prefix`"
        cols = [c for c in self.columns if c.startswith(prefix)]
        if len(cols) != 1: raise KeyError(f'{len(cols)} columns start with {prefix!r}: {self.columns}')
        return cols[0]


class Section:
    "A section of a results file: its heading, GitHub anchor, text (with its subsections) and tables"
    def __init__(self, title:str, level:int, text:str, path:str):
        self.title,self.level,self.text,self.path = title,level,text,path
        self.anchor = github_anchor(title)

    @property
    def url(self) -> str: return f'{REPO}{self.path}#{self.anchor}'

    def tables(self) -> list:
        out,cur = [],[]
        for line in self.text.splitlines() + ['']:
            if line.startswith('|'): cur.append(line)
            else:
                if len(cur) >= 2: out.append(Table(cur))
                cur = []
        return out

    def table(self, i:int=0) -> Table: return self.tables()[i]

    def link(self, text:str='measured') -> str: return f'[{text}]({self.url})'


class Results:
    "`bench/results/results.md`, parsed: the environment line under the title, and the sections by their headings"
    def __init__(self, path:Path):
        self.path = Path(path)
        full = self.path.resolve()
        # its path in the repository: under ROOT, or (a copy elsewhere, as in the tests) from its `bench` folder on
        self.rel = (full.relative_to(ROOT).as_posix() if full.is_relative_to(ROOT) else
                    '/'.join(full.parts[full.parts.index('bench'):]) if 'bench' in full.parts else full.name)
        self.text = self.path.read_text()
        lines = self.text.splitlines()
        heads = [(i, len(m.group(1)), m.group(2).strip()) for i,l in enumerate(lines) if (m := re.match(r'(#+)\s+(.*)', l))]
        self.sections = []
        for k,(i,level,title) in enumerate(heads):
            end = next((j for j,lv,_ in heads[k+1:] if lv <= level), len(lines))
            self.sections.append(Section(title, level, '\n'.join(lines[i+1:end]), self.rel))
        self.environment = next((l for l in lines[1:] if l.strip()), '')

    def section(self, prefix:str) -> Section:
        "The one section whose heading starts with `prefix` ('2.', '8b.', 'The optimizer under')"
        found = [s for s in self.sections if s.title.startswith(prefix)]
        if len(found) != 1: raise LookupError(f'{len(found)} sections of {self.rel} start with {prefix!r}')
        return found[0]

    def env(self) -> dict:
        "The run's environment: torch, fastai, Python, the device (`CPU: <name>, <n> cores, <t> torch threads`, or a GPU's name), the date"
        m = re.match(r'torch (\S+), fastai (\S+), Python (\S+); (.*); (\d{4}-\d\d-\d\d)[^.]*', self.environment)
        if not m: raise ValueError(f'{self.rel}: no environment line where expected: {self.environment[:120]!r}')
        return dict(zip(['torch', 'fastai', 'python', 'device', 'date'], m.groups()))

    def link(self, text:str='results') -> str: return f'[{text}]({REPO}{self.rel})'


def results_md(path:Path|str=RESULTS/'results.md') -> Results: return Results(path)


def num(cell:str) -> float:
    "The number in a table cell: '4.44', '**0.72x**', '+0.24', '12.00'"
    m = re.search(r'[-+]?\d[\d,]*(?:\.\d+)?', cell)
    if not m: raise ValueError(f'no number in {cell!r}')
    return float(m.group().replace(',', ''))


def link(text:str, path:str, anchor:str|None=None) -> str:
    "A markdown link to a file of the repository, on GitHub"
    return f'[{text}]({REPO}{path}' + (f'#{anchor}' if anchor else '') + ')'


def install_runs(path:Path=RESULTS/'install.json') -> dict:
    "The latest recorded install of each kind ('cpu', 'cuda'), from `tools/measure_install.py --record`"
    runs = json.loads(Path(path).read_text())['runs']
    return {r['name']:r for r in runs} # later runs of a name replace earlier ones


def suite(path:Path=RESULTS/'suite.json') -> dict:
    "The last timed run of the test suite, from `tools/measure_suite.py`"
    return json.loads(Path(path).read_text())


class GPUResults(dict):
    "`bench.gpu`'s JSON: `env`, `rows`, `targets`, ..., and `row`/`ratio` to read its table"
    def row(self, key:str, config:str, opt:str='fused') -> dict:
        "The row of model `key` ('resnet', 'gpt'), `config` (as the table names it) and optimizer `opt` ('fused', 'adam')"
        return next(r for r in self['rows'] if r['key'] == key and r['config'] == config and r['opt_key'] == opt)
    def ratio(self, key:str, a:str, b:str, field:str='rate', opt:str='fused') -> str:
        "`a`'s `field` over `b`'s, as the table writes ratios ('3.29x')"
        return f"{self.row(key, a, opt)[field] / self.row(key, b, opt)[field]:.2f}x"


def gpu_results(path:Path=RESULTS/'gpu.json') -> GPUResults:
    "The last GPU table, from `python -m bench.gpu` on a GPU machine"
    return GPUResults(json.loads(Path(path).read_text()))


def pinned(path:Path=ROOT/'constraints.txt') -> dict:
    "constraints.txt's pins: package name (lower case) -> version"
    pins = {}
    for line in Path(path).read_text().splitlines():
        m = re.match(r'\s*([A-Za-z0-9_.\-]+)==(\S+)', line)
        if m: pins[m.group(1).lower()] = m.group(2)
    return pins


def floor_stack(path:Path=ROOT/'Makefile') -> dict:
    "The oldest releases CI's floor job installs (the Makefile's `STACK_floor`): package name (lower case) -> version"
    text = Path(path).read_text()
    m = re.search(r'^STACK_floor\s*:=((?:[^\n]*\\\n)*[^\n]*)', text, re.M)
    return {k.lower():v for k,v in re.findall(r'([A-Za-z0-9_.\-]+)==([\w.]+)', m.group(1))}


def gb(nbytes:float|None, fallback:float|None=None) -> str:
    "Bytes as GB with one decimal ('6.1 GB'); `fallback` GB where only a rounded figure was kept"
    return f'{nbytes/1e9:.1f} GB' if nbytes is not None else f'{fallback:.1f} GB'


def minutes(seconds:float) -> str:
    "'3 min 3 s', '46 s'"
    s = round(seconds)
    return f'{s//60} min {s%60} s' if s >= 60 else f'{s} s'


def plural(n:int, word:str) -> str: return f'{n:,} {word}' + ('' if n == 1 else 's')
