"""Fail when a page's example uses a name that only a hidden cell defines: `make examples-check`.

The docs show a notebook's code cells except those hidden (`#| hide`, `#| include: false`, `#| echo: false`), the
exported definitions (`#| export`, `#| exporti`: the page shows their documentation instead) and the `show_doc` calls.
A reader copies the shown cells; so every name an example uses must come from a shown cell before it (an import, an
assignment, a definition, a star import, whose names are read from the module) or be a builtin. Each name that a
hidden cell or an exported definition supplies instead is reported, with the cell that uses it:

- `hidden`: bound only by a hidden cell (`from mpcallbacks.test_utils import synth_learner` under `#| hide`);
- `page`: one of the page's own exported names, with no shown import of its module (`from mpcallbacks.all import *`).

    python tools/check_examples.py                      # the home page, the guides and the API pages of nbs/sidebar.yml
    python tools/check_examples.py nbs/07_doctor.ipynb  # some notebooks
    python tools/check_examples.py --pending 00_cast    # count these pages' findings without failing on them
    python tools/check_examples.py --run API            # run the shown cells of the API pages, each page in a fresh process

It also fails on a shown line longer than `LINE_LIMIT` characters: the page would scroll it sideways.

`--run` catches what names cannot show: a method that a module patches onto a class (fastai's `Learner.fit_one_cycle`,
`to_fp16`, `no_bar`), which the page's shown imports must import too. nbdev-test runs every cell, the hidden ones
included, so it cannot.
"""
from __future__ import annotations
import argparse, ast, builtins, importlib, json, re, sys, warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE_LIMIT = 90 # characters of a shown code line: what the pages' code boxes show at 1280 px without scrolling
_hidden_re = re.compile(r'^#\|\s*(hide\b|include:\s*false|echo:\s*false)', re.M)
_export_re = re.compile(r'^#\|\s*(export|exporti|exports)\b', re.M)


def pages(root:Path=ROOT, sections=('Guides', 'API', 'Internals', 'Helpers for the examples')) -> list:
    "The home page and the notebooks listed under these sections of nbs/sidebar.yml"
    import yaml
    side = yaml.safe_load((root/'nbs'/'sidebar.yml').read_text())['website']['sidebar']['contents']
    listed = [p for s in side if isinstance(s, dict) and s.get('section') in sections for p in s['contents']]
    return [root/'nbs'/p for p in ['index.ipynb'] + listed]


def _source(cell) -> str: return ''.join(cell['source']) if isinstance(cell['source'], list) else cell['source']


def _code(src:str) -> str:
    "The cell's Python: option lines dropped, IPython's magics and shell lines blanked"
    return '\n'.join('' if l.lstrip().startswith(('%', '!')) else l for l in src.splitlines() if not l.startswith('#|'))


def star_names(module:str) -> set:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            m = importlib.import_module(module)
    except Exception: return set()
    return set(getattr(m, '__all__', None) or [n for n in vars(m) if not n.startswith('_')])


class Bound(ast.NodeVisitor):
    "The names a cell binds at its top level (and in its functions' and classes' names), and the names it loads"
    def __init__(self): self.bound,self.loaded,self.local = set(),[],set()
    def visit_Import(self, n):
        for a in n.names: self.bound.add((a.asname or a.name).split('.')[0])
    def visit_ImportFrom(self, n):
        for a in n.names:
            if a.name == '*': self.bound |= star_names(n.module or '')
            else: self.bound.add(a.asname or a.name)
    def visit_Name(self, n):
        if isinstance(n.ctx, (ast.Store, ast.Del)): self.bound.add(n.id)
        else: self.loaded.append(n.id)
    def _scope(self, n, args=None):
        self.bound.add(n.name)
        inner = Bound()
        for d in getattr(n, 'decorator_list', []): self.visit(d)
        if args is not None:
            for a in ast.walk(args):
                if isinstance(a, ast.arg): inner.local.add(a.arg)
            for d in args.defaults + args.kw_defaults:
                if d is not None: self.visit(d)
        for s in n.body: inner.visit(s)
        # names a function or class body binds are its own; what it loads from outside counts for the cell
        own = inner.bound | inner.local | {n.name}
        self.loaded += [x for x in inner.loaded if x not in own]
    def visit_FunctionDef(self, n): self._scope(n, n.args)
    visit_AsyncFunctionDef = visit_FunctionDef
    def visit_ClassDef(self, n):
        for b in n.bases + [k.value for k in n.keywords]: self.visit(b)
        self._scope(n)
    def visit_Lambda(self, n):
        inner = Bound()
        inner.visit(n.body)
        args = {a.arg for a in ast.walk(n.args) if isinstance(a, ast.arg)}
        self.loaded += [x for x in inner.loaded if x not in args | inner.bound]
    def _comp(self, n):
        inner = Bound()
        for g in n.generators: inner.visit(g)
        for part in ('elt', 'key', 'value'):
            if getattr(n, part, None) is not None: inner.visit(getattr(n, part))
        self.loaded += [x for x in inner.loaded if x not in inner.bound]
        self.bound |= {x for x in inner.bound if False}
    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comp
    def visit_ExceptHandler(self, n):
        if n.name: self.bound.add(n.name)
        self.generic_visit(n)
    def visit_Global(self, n): self.bound |= set(n.names)


def _hidden(src:str) -> bool:
    "Whether the page leaves a cell's code out: hidden, or a `show_doc` call"
    return bool(_hidden_re.search(src)) or _code(src).lstrip().startswith('show_doc(')


def scan(path:Path) -> list:
    "(kind, name, cell id, first line of the cell) for each name an example uses that a hidden cell or an export supplies"
    nb = json.loads(path.read_text())
    shown,hidden,exported = set(dir(builtins)) | {'__name__', '__file__', 'display', 'get_ipython'},set(),set()
    found = []
    for cell in nb['cells']:
        if cell['cell_type'] != 'code': continue
        src = _source(cell)
        try: tree = ast.parse(_code(src))
        except SyntaxError: continue
        b = Bound()
        b.visit(tree)
        if _export_re.search(src): exported |= b.bound; continue
        if _hidden(src): hidden |= b.bound; continue
        # names bound in this cell before their use count: an example defines what it uses
        for name in dict.fromkeys(b.loaded):
            if name in shown or name in b.bound: continue
            kind = 'hidden' if name in hidden else 'page' if name in exported else None
            if kind: found.append((kind, name, cell.get('id', '?'), _code(src).strip().splitlines()[0][:70]))
        shown |= b.bound
    return found


def shown_cells(path:Path) -> list:
    "The sources of the code cells a reader sees on the page, in order"
    nb = json.loads(Path(path).read_text())
    res = []
    for cell in nb['cells']:
        if cell['cell_type'] != 'code': continue
        src = _source(cell)
        if not (_export_re.search(src) or _hidden(src)): res.append((cell.get('id', '?'), src))
    return res


def long_lines(path:Path, limit:int=LINE_LIMIT) -> list:
    "(cell id, line number, length) of each shown code line of `path` longer than `limit` characters"
    return [(cid, i, len(l)) for cid,src in shown_cells(path) for i,l in enumerate(src.splitlines(), 1) if len(l) > limit]


def run_shown(path:Path) -> list:
    "(cell id, first line, error) for each shown cell of `path` that raises when the shown cells run alone, in order, in this process"
    import os
    from execnb.shell import CaptureShell
    cells,failed = shown_cells(path),[]
    here = os.getcwd()
    os.chdir(Path(path).resolve().parent) # (as nbdev-test runs a notebook: from its folder)
    try:
        sh = CaptureShell()
        for cid,src in cells:
            sh.run(src)
            if sh.exc is not None:
                e = sh.exc
                failed.append((cid, _code(src).strip().splitlines()[0][:70], f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"))
    finally: os.chdir(here)
    return failed


def run_pages(sections:list) -> int:
    "Run the shown cells of the pages of these sidebar sections, each in a fresh Python: the number of cells that raised"
    import subprocess
    failed,paths = 0,pages(sections=tuple(sections))[1:] # (the home page's examples are the README's, which nbdev-test runs)
    for path in paths:
        out = subprocess.run([sys.executable, '-W', 'ignore', __file__, '--run-one', str(path)], capture_output=True, text=True)
        found = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else [('?', path.name, out.stderr[-300:])]
        failed += len(found)
        for cid,line,err in found: print(f"{path.name}: cell {cid} ({line}) raises when the shown cells run alone: {err}")
    print(f"check_examples: the shown cells of {len(paths)} page(s) run alone" if not failed else f"check_examples: {failed} shown cell(s) raise")
    return failed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('notebooks', nargs='*', type=Path, help='Notebooks to check (default: the home page, the guides and the API pages)')
    ap.add_argument('--pending', nargs='*', default=[], help='Pages (notebook stems) whose findings are counted, not failed on')
    ap.add_argument('--verbose', action='store_true', help="List the pending pages' findings too")
    ap.add_argument('--run', nargs='+', metavar='SECTION', help="Run the shown cells of the pages of these sidebar sections (e.g. API), each page alone")
    ap.add_argument('--run-one', type=Path, help=argparse.SUPPRESS) # (one page, in this process: prints its failures as JSON)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.run_one:
        print(json.dumps(run_shown(args.run_one)))
        return 0
    if args.run: return 1 if run_pages(args.run) else 0
    nbs = args.notebooks or pages()
    failed = 0
    for path in nbs:
        for cid,line,n in long_lines(path):
            failed += 1; print(f"{path.name}: cell {cid}, line {line}: {n} characters, more than the {LINE_LIMIT} a code box shows")
        found = scan(path)
        if not found: continue
        pending = path.stem in args.pending
        failed += 0 if pending else len(found)
        print(f"{path.name}: {len(found)} name(s) the shown examples use without a shown import" + (' (pending)' if pending else ''))
        if pending and not args.verbose: continue
        for kind,name,cid,line in found: print(f'  {name:24} {kind:6} cell {cid}: {line}')
    if failed: print(f'check_examples: {failed} name(s) supplied only by hidden cells or the page\'s exports, or line(s) too long'); return 1
    print(f'check_examples: the examples of {len(nbs) - len(args.pending)} page(s) run as shown' +
          (f' ({len(args.pending)} pending: {", ".join(args.pending)})' if args.pending else ''))
    return 0


if __name__ == '__main__': sys.exit(main())
