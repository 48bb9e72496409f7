"""Fail when a number the README or the docs quote is not in the file it cites, or a rendered sentence is stale: `make numbers-check`.

Two checks, over README.md, CONTRIBUTING.md, tools/README.md and every notebook of nbs/ (markdown cells and the markdown
outputs of cells):

1. Rendered cells. A code cell that imports `rendered_numbers` (see tools/rendered_numbers.py) writes its sentence
   from the results when run; it is run again here, alone, from nbs/, and its saved output must be what it renders
   now. When a results file changed (`make bench`, `tools/measure_install.py --record`, `tools/measure_suite.py`),
   this fails until `make numbers` saves the fresh outputs (and `make readme` writes README.md from them).
2. Quoted numbers. Each number in a sentence (or a table cell) with a citing link must be in the cited text: a link
   into `bench/results/` cites that file (`results.md#<anchor>`: that section, with its subsections), and a link
   whose text is `measured` or `tested` cites the repository file or docs page it points to (a page: its notebook's
   text; a test file: its source, where the bounds it asserts are). A
   number quoted with fewer decimals than the file gives passes when it is the file's rounded ('16' for '16.00');
   numbers in code spans and in the links' addresses are not quotes. Version numbers (two dots and more) are skipped.
   In the sentences of rendered cells, which check 1 renders again (their numbers may be derived: '3 min 3 s'), only the
   numbers the cell's code writes out in its strings, typed by hand, are checked here.

    python tools/check_numbers.py          # both checks; exit status 1 on any failure, each one named
    python tools/check_numbers.py --fix --rendered-only  # save the fresh output of every stale rendered cell (`make numbers`)
"""
from __future__ import annotations
import argparse, ast, contextlib, io, json, os, re, sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))
from rendered_numbers import REPO, SITE, github_anchor, Results # noqa: E402

MARKER = 'from rendered_numbers import'
_link_re = re.compile(r'\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)\)')
_code_re = re.compile(r'`[^`\n]*`')
_math_re = re.compile(r'\$[^$\n]+\$')
_num_re = re.compile(r'(?<![\w.])\d[\d,]*(?:\.\d+)*(?:e[-+]?\d+\b)?')
_sentence_end = re.compile(r'(?<=[.!?])\s+(?=[A-Z(\[*`_])')


# ---- 1. rendered cells

def _source(cell) -> str: return ''.join(cell['source']) if isinstance(cell['source'], list) else cell['source']


def _markdown_output(cell) -> str|None:
    for out in cell.get('outputs', []):
        md = out.get('data', {}).get('text/markdown')
        if md is not None: return ''.join(md) if isinstance(md, list) else md
    return None


def render(source:str, nbs:Path) -> str:
    "Run a rendered cell's code alone, from `nbs`, and return the markdown of its last expression"
    code = '\n'.join(l for l in source.splitlines() if not l.startswith('#|'))
    tree = ast.parse(code)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    if last is None: raise ValueError('a rendered cell ends with the expression it shows (`Markdown(...)`)')
    ns = {'__name__': '__rendered__'}
    cwd = os.getcwd()
    try:
        os.chdir(nbs)
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(tree, '<rendered cell>', 'exec'), ns)
            value = eval(compile(ast.Expression(last.value), '<rendered cell>', 'eval'), ns)
    finally: os.chdir(cwd)
    return str(getattr(value, 'data', value))


def rendered_cells(nbs:Path):
    "(notebook path, notebook json, cell) for every rendered cell"
    for path in sorted(nbs.glob('*.ipynb')):
        nb = json.loads(path.read_text())
        for cell in nb['cells']:
            if cell['cell_type'] == 'code' and MARKER in _source(cell): yield path, nb, cell


def markdown_output(md:str) -> dict:
    "A cell output showing `md`, as IPython's `Markdown` displays it"
    return {'data': {'text/markdown': md, 'text/plain': '<IPython.core.display.Markdown object>'},
            'execution_count': None, 'metadata': {}, 'output_type': 'execute_result'}


def typed(source:str) -> set:
    "The numbers a rendered cell's code writes out in its strings (typed by hand, not read from the results)"
    code = '\n'.join(l for l in source.splitlines() if not l.startswith('#|'))
    texts = [n.value for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return set(numbers('\n'.join(texts)))


def check_rendered(nbs:Path, fix:bool=False, seen:dict|None=None) -> list:
    "Errors for the rendered cells whose saved output is stale (with `fix`, none: the output is saved); `seen` gets their sentences, each with the numbers its cell types by hand"
    errors,changed = [],{}
    for path,nb,cell in rendered_cells(nbs):
        where = f"{path.relative_to(nbs.parent)}, cell {cell.get('id', '?')}"
        try: fresh = render(_source(cell), nbs)
        except Exception as e:
            errors.append(f'{where}: the rendered cell fails: {type(e).__name__}: {e}')
            continue
        if seen is not None: seen.update({_key(b): typed(_source(cell)) for b in blocks(fresh)})
        if _markdown_output(cell) == fresh: continue
        if fix:
            cell['outputs'],cell['execution_count'] = [markdown_output(fresh)],None
            changed[path] = nb
        else: errors.append(f'{where}: its saved output is not what it renders from the results now: run `make numbers`')
    for path,nb in changed.items():
        from fastcore.nbio import dict2nb, write_nb # nbdev's own writer: the format nbdev-clean keeps
        write_nb(dict2nb(nb), path)
        print(f'{path.relative_to(nbs.parent)}: rendered outputs refreshed')
    return errors


# ---- 2. quoted numbers

def numbers(text:str) -> list:
    "The numbers quoted in `text`, outside code spans, formulas and link addresses, thousands separators removed"
    text = _code_re.sub(' ', _math_re.sub(' ', _link_re.sub(lambda m: m.group(1), text)))
    out = []
    for m in _num_re.finditer(text):
        s = m.group().rstrip(',.')
        if s.count('.') > 1: continue # a version
        if re.fullmatch(r'\d{1,3}(,\d{3})+(\.\d+)?', s): s = s.replace(',', '')
        out += [p for p in s.split(',') if p]
    return out


def quoted_in(q:str, found:list) -> bool:
    "Whether `q` is one of `found`, or one of them rounded to `q`'s decimals"
    d = len(q.split('.')[1]) if '.' in q else 0
    for f in found:
        if f == q: return True
        fd = len(f.split('.')[1]) if '.' in f else 0
        if fd >= d and f'{float(f):.{d}f}' == q: return True
    return False


class Sources:
    "The texts links cite: repository files (a results.md section by its anchor) and docs pages (their notebooks)"
    def __init__(self, root:Path):
        self.root,self.cache = root,{}
        self.pages = {}
        for nb in (root/'nbs').glob('*.ipynb'):
            self.pages[re.sub(r'^\d+[a-z]?_', '', nb.stem) + '.html'] = nb
        self.pages['index.html'] = root/'nbs'/'index.ipynb'

    def resolve(self, url:str, base:Path) -> tuple[Path, str|None]|None:
        "The cited file and anchor of a link, or None for a link that cites nothing of this repository"
        url,_,anchor = url.partition('#')
        if url.startswith(REPO): return self.root/url[len(REPO):], anchor or None
        if url.startswith(SITE): return self.pages.get(url[len(SITE):] or 'index.html'), anchor or None
        if re.match(r'\w+:', url) or not url: return None
        target = (base.parent/url).resolve()
        if target.name in self.pages and target.suffix == '.html': return self.pages[target.name], anchor or None
        return (target, anchor or None) if target.exists() else None

    def text(self, path:Path, anchor:str|None) -> str:
        key = (path, anchor)
        if key in self.cache: return self.cache[key]
        if path.suffix == '.ipynb': text = '\n'.join(notebook_texts(path))
        elif path.name.endswith('.md') and anchor and path.is_relative_to(self.root/'bench'):
            secs = [s for s in Results(path).sections if s.anchor == anchor]
            if not secs: raise LookupError(f'{path.relative_to(self.root)} has no section #{anchor}')
            text = secs[0].text
        else: text = path.read_text()
        self.cache[key] = text
        return text


def notebook_texts(path:Path) -> list:
    "The markdown a notebook shows: its markdown cells and its cells' markdown outputs"
    nb = json.loads(path.read_text())
    out = []
    for cell in nb['cells']:
        if cell['cell_type'] == 'markdown': out.append(_source(cell))
        md = _markdown_output(cell)
        if md: out.append(md)
    return out


def blocks(md:str) -> list:
    "Sentences of `md`, a table's cells one by one; code blocks left out"
    md = re.sub(r'^```.*?^```', '', md, flags=re.S | re.M)
    out = []
    for para in re.split(r'\n\s*\n', md):
        lines = para.splitlines()
        if lines and all(l.lstrip().startswith('|') for l in lines):
            for l in lines: out += re.split(r'(?<!\\)\|', l)
        else: # each item of a list on its own: a sentence ends where the next item begins
            items = [[]]
            for l in lines:
                if re.match(r'\s*(?:[-*+]|\d+\.)\s', l) and items[-1]: items.append([])
                items[-1].append(l.strip())
            for item in items: out += _sentence_end.split(' '.join(item))
    return out


def cites(sentence:str, sources:Sources, base:Path) -> list:
    "(url, path, anchor) of the links of `sentence` that cite a text"
    out = []
    for m in _link_re.finditer(sentence):
        text,url = m.group(1).strip(),m.group(2)
        res = sources.resolve(url, base)
        if res is None or res[0] is None: continue
        path,anchor = res
        into_results = path.is_relative_to(sources.root/'bench'/'results')
        if into_results or text.strip('`*_ ').lower() in ('measured', 'tested'): out.append((url, path, anchor))
    return out


def _key(sentence:str) -> str:
    "A sentence as text: links as their text (nbdev links names in backticks in README.md), spaces collapsed"
    return ' '.join(_link_re.sub(lambda m: m.group(1), sentence).split())


def check_quoted(root:Path, docs:list, rendered:dict|None=None) -> list:
    "Errors for the numbers quoted next to citing links that the cited text lacks; of the sentences in `rendered`, only the numbers their cells type by hand"
    rendered = rendered or {}
    sources,errors = Sources(root),[]
    for doc in docs:
        texts = notebook_texts(doc) if doc.suffix == '.ipynb' else [doc.read_text()]
        for text in texts:
            for sentence in blocks(text):
                # a rendered sentence: what it reads from the results is checked by rendering it again; what its cell types, here
                only = rendered.get(_key(sentence))
                links = cites(sentence, sources, doc)
                if not links: continue
                cited = []
                for url,path,anchor in links:
                    try: cited += numbers(sources.text(path, anchor))
                    except (LookupError, OSError) as e: errors.append(f'{doc.relative_to(root)}: {url}: {e}')
                for q in numbers(sentence):
                    if only is not None and q not in only: continue
                    if not quoted_in(q, cited):
                        names = ', '.join(sorted({p.relative_to(root).as_posix() + (f'#{a}' if a else '') for _,p,a in links}))
                        errors.append(f'{doc.relative_to(root)}: {q} is quoted next to a link to {names}, which does not have it:'
                                      f'\n    {sentence.strip()[:300]}')
    return errors


def documents(root:Path) -> list:
    return [p for p in [root/'README.md', root/'CONTRIBUTING.md', root/'tools'/'README.md'] if p.exists()] + sorted((root/'nbs').glob('*.ipynb'))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--root', type=Path, default=TOOLS.parent, help='The repository (default: this one)')
    ap.add_argument('--fix', action='store_true', help='Save the fresh outputs of stale rendered cells')
    ap.add_argument('--rendered-only', action='store_true', help='Only check 1, the rendered cells (with --fix: `make numbers`)')
    args = ap.parse_args(argv)
    root = args.root.resolve()
    rendered = {}
    errors = check_rendered(root/'nbs', fix=args.fix, seen=rendered)
    if not args.rendered_only: errors += check_quoted(root, documents(root), rendered)
    for e in errors: print(e)
    n = sum(1 for _ in rendered_cells(root/'nbs'))
    if errors:
        print(f'check_numbers: {len(errors)} problem(s)'); return 1
    print(f'check_numbers: {n} rendered cell(s) current; every number next to a citing link is in the text it cites')
    return 0


if __name__ == '__main__': sys.exit(main())
