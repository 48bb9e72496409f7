"""Read nbdev's processed notebooks (`_proc/`) the way Quarto reads them, for the tools that render them without Quarto.

`nbdev-proc-nbs` writes notebooks meant for Quarto: the title and summary move into YAML front matter in a raw first
cell (with `output-file`, the page's name), `show_doc` cells carry the cell options `#| echo: false` and
`#| output: asis`, and `show_doc` output uses Pandoc's link attributes (`[source](url){target="_blank"}`). Jupyter's
converters know none of this; `load_processed` turns it into plain notebook features they do know."""
from __future__ import annotations
import re
from pathlib import Path
import nbformat, yaml

_front_matter_re = re.compile(r'\A\s*---\s*\n(.*?)\n---\s*\Z', re.S)
_cell_option_re = re.compile(r'^#\|\s*([\w-]+)\s*:\s*(.*?)\s*$')
# `[text](url){attrs}`: Pandoc's attributes on a link, used by nbdev's show_doc for the "source" link
_link_attrs_re = re.compile(r'\[([^\]\n]*)\]\(([^)\s]+)\)\{([^}\n]*)\}')
_attr_re = re.compile(r'([\w-]+)="([^"]*)"|\.([\w-]+)|#([\w-]+)')
# Quarto's fenced divs, as callouts use them: `::: {.callout-note}` ... `:::`
_div_open_re = re.compile(r'^:::+\s*\{([^}]*)\}\s*$')
_div_close_re = re.compile(r'^:::+\s*$')
_cell_keys = {'id', 'cell_type', 'metadata', 'source', 'attachments', 'execution_count', 'outputs'}


def split_front_matter(nb) -> dict:
    "Remove the raw front-matter cell that nbdev puts first, and return its YAML as a dict ({} if there is none)"
    if nb.cells and nb.cells[0].cell_type == 'raw':
        m = _front_matter_re.match(nb.cells[0].source)
        if m:
            nb.cells.pop(0)
            return yaml.safe_load(m.group(1)) or {}
    return {}


def cell_options(source:str) -> tuple[dict, str]:
    "Quarto's `#| key: value` options at the top of a cell, and the source without them"
    lines,opts = source.splitlines(),{}
    while lines and lines[0].startswith('#|'):
        m = _cell_option_re.match(lines.pop(0))
        if m: opts[m.group(1)] = yaml.safe_load(m.group(2)) if m.group(2) else None
    return opts, '\n'.join(lines)


def _html_attrs(attrs:str) -> str:
    res,classes = [],[]
    for name,value,cls,id_ in _attr_re.findall(attrs):
        if cls: classes.append(cls)
        elif id_: res.append(f'id="{id_}"')
        else: res.append(f'{name}="{value}"')
    if classes: res.append(f'class="{" ".join(classes)}"')
    return ' '.join(res)


def plain_markdown(md:str, html:bool=True) -> str:
    "`md` without Pandoc-only syntax: link attributes become HTML links (or are dropped), callouts become divs"
    if html: md = _link_attrs_re.sub(lambda m: f'<a href="{m.group(2)}" {_html_attrs(m.group(3))}>{m.group(1)}</a>', md)
    else: md = _link_attrs_re.sub(r'[\1](\2)', md)
    out = []
    for line in md.splitlines():
        m = _div_open_re.match(line)
        if m:
            # An HTML block ends at a blank line, so the markdown inside the div is still parsed as markdown
            out += ['', f'<div {_html_attrs(m.group(1))}>' if html else '', '']
        elif _div_close_re.match(line): out += ['', '</div>' if html else '', '']
        else: out.append(line)
    return '\n'.join(out)


def apply_cell_options(nb) -> None:
    "Do what Quarto does with `include`, `echo`, `output` and `code-fold`, and drop the option lines from the shown source"
    cells = []
    for cell in nb.cells:
        # nbdev's `has_sd` and its timings (`execution.total`, a number) fail nbformat's validation
        for k in set(cell) - _cell_keys: del cell[k]
        cell.metadata.pop('execution', None)
        if cell.cell_type == 'code':
            opts,cell.source = cell_options(cell.source)
            if opts.get('include') is False: continue
            if opts.get('echo') is False: # nbconvert hides the source; the tag (class `celltag_echo-false`) is for styling
                cell.metadata.setdefault('transient', {})['remove_source'] = True
                cell.metadata.setdefault('tags', []).append('echo-false')
            if opts.get('output') is False: cell.outputs = []
            fold = opts.get('code-fold')
            if fold in (True, 'show'): cell.metadata['code_fold'] = 'show' if fold == 'show' else 'hide'
        cells.append(cell)
    nb.cells = cells


def _markdown_outputs(nb):
    for cell in nb.cells:
        for out in cell.get('outputs', []):
            if 'text/markdown' in out.get('data', {}): yield out.data


_warning_re = re.compile(r'<ipython-input-\d+-[0-9a-f]+>:\d+: (.*?)\n  [^\n]*(?:\n|$)', re.S)

def plain_warnings(text:str) -> str:
    "A warning as a reader of the page needs it: `SkippedStepsWarning: ...`, without the kernel's cell name, line and echoed source"
    return _warning_re.sub(lambda m: m.group(1) + '\n', text)


def _documented(mod:str, name:str):
    "The object `name` of module `mod` (`mpcallbacks/callback` or `mpcallbacks.callback`), or None where it is not there"
    import importlib
    try: return getattr(importlib.import_module(mod.replace('/', '.')), name)
    except (ImportError, AttributeError): return None


# show_doc of a property renders its getter as a method of no argument: `def loss_scale()->float:`
_doc_sig_re = re.compile(r'(\[source\]\([^)\s]*/(?P<mod>mpcallbacks/[\w/]+)\.py#L\d+\)[^\n]*\n\n### (?P<cls>\w+)\.(?P<name>\w+)\n\n```python\n)'
                         r'def (?P=name)\(\)(?P<ret>->[^\n]*?)?:(?P<tail>[ \t]*#[^\n]*)?\n```')

def mark_properties(md:str) -> str:
    "A documented property's signature as Python writes one, `@property` and `self`, where show_doc wrote a method that takes no argument"
    import inspect
    def fix(m):
        cls = _documented(m['mod'], m['cls'])
        if cls is None or not isinstance(inspect.getattr_static(cls, m['name'], None), property): return m[0]
        return f"{m[1]}@property\ndef {m['name']}(self){m['ret'] or ''}:{m['tail'] or ''}\n```"
    return _doc_sig_re.sub(fix, md)


# show_doc of a class renders it as a function of its `__init__`'s parameters: `def MasterMixedPrecision(`
_class_sig_re = re.compile(r'(\[source\]\([^)\s]*/(?P<mod>mpcallbacks/[\w/]+)\.py#L\d+\)[^\n]*\n\n### (?P<name>\w+)\n\n```python\n)'
                           r'def (?P=name)\((?P<params>(?:(?!```)[^\n]*\n)*?[^\n]*?)\)(?:\s*->[^\n:#]*)?:(?P<tail>[ \t]*#[^\n]*)?\n```')

def mark_classes(md:str) -> str:
    "A documented class's signature as Python writes one: `class X(Base):`, and its `__init__` where it takes parameters of its own"
    import inspect
    def fix(m):
        cls = _documented(m['mod'], m['name'])
        if not inspect.isclass(cls): return m[0]
        public = lambda b: next(c for c in b.__mro__ if not c.__name__.startswith('_')) # (a private base: the first public one above it)
        bases = ', '.join(public(b).__name__ for b in cls.__bases__ if b is not object)
        head = f"class {m['name']}({bases}):" if bases else f"class {m['name']}:"
        params = m['params']
        if re.fullmatch(r'\s*(\*args,\s*\*\*kw\w*)?\s*', params): return f"{m[1]}{head}\n```" # nothing of its own to pass
        if '\n' not in params: return f"{m[1]}{head}\n    def __init__(self, {params}):{m['tail'] or ''}\n```"
        lines = params.strip('\n').split('\n')
        return f"{m[1]}{head}\n    def __init__(self,\n" + '\n'.join('    ' + l for l in lines) + f"\n    ):{m['tail'] or ''}\n```"
    return _class_sig_re.sub(fix, md)


# Defaults that show_doc would print as their value, shown by the name a reader can look up instead
_named_defaults = {'always_fp32': 'mpcallbacks.policy'}

def name_defaults(md:str) -> str:
    "A signature's default that is one of the package's named constants, written as its name, not its value"
    for name,mod in _named_defaults.items():
        value = _documented(mod, name)
        if value is not None: md = md.replace(f'={value!r}', f'={name}')
    return md


def _outside_strings(text:str):
    "Each `(i, ch)` of `text` outside its string literals (a backslash in a string escapes the character after it)"
    quote,escaped = None,False
    for i,ch in enumerate(text):
        if escaped: escaped = False
        elif quote:
            if ch == '\\': escaped = True
            elif ch == quote: quote = None
        elif ch in '\'"': quote = ch
        else: yield i,ch


def _split_comment(line:str) -> tuple[str, str]:
    "A line of code and its `# comment` (outside strings), each stripped"
    i = next((i for i,ch in _outside_strings(line) if ch == '#'), None)
    return (line.rstrip(), '') if i is None else (line[:i].rstrip(), line[i+1:].strip())


def _top_level(text:str, sep:str) -> int:
    "Where `sep` first occurs in `text` outside brackets and strings, or -1"
    depth = 0
    for i,ch in _outside_strings(text):
        if ch in '([{': depth += 1
        elif ch in ')]}': depth -= 1
        elif ch == sep and depth == 0: return i
    return -1


def _code_cell(text:str) -> str:
    "`text` as inline code in a markdown table cell: HTML, whose `|` does not end the cell"
    import html as _html
    return f"<code>{_html.escape(text).replace('|', '&#124;')}</code>" if text else ''


_sig_block_re = re.compile(r'```python\n(?P<code>(?:(?!```)[^\n]*\n)+?)```')

_source_re = re.compile(r'\[source\]\(https://github\.com/[^/]+/[^/]+/blob/[^/]+/(?P<path>[^#)]+)#L(?P<line>\d+)\)')

def _source_comments(md:str) -> dict|None:
    """The comments of the `**kwargs` line and of the closing `)` line of the signature that show_doc's source link points to
    (fastcore's docments gives a `**kwargs` comment to the return), or None where the source cannot be read"""
    m = _source_re.search(md)
    f = Path(__file__).resolve().parent.parent/m['path'] if m else None
    if f is None or not f.is_file(): return None
    lines = f.read_text().splitlines()[int(m['line']) - 1:]
    res = {}
    for line in lines[1:40]:
        code,comment = _split_comment(line)
        if code.lstrip().startswith('**'): res['kwargs'] = comment
        if code.lstrip().startswith(')'): res['returns'] = comment; return res
    return None


def param_tables(md:str) -> str:
    """A signature that show_doc wrote with a comment on each parameter, shown without the comments, and the parameters
    in a table under the summary: name, type, default and what the comment said (and what it returns)"""
    m = _sig_block_re.search(md)
    if m is None or '\n### ' not in md[:m.start()]: return md
    lines = m['code'].rstrip('\n').split('\n')
    if len(lines) < 3: return md # a signature on one line reads as it is
    split = [_split_comment(l) for l in lines]
    if any(c.strip().startswith('**') and not comment for c,comment in split) and (src := _source_comments(md)):
        split = [(c, src.get('kwargs', comment) if c.strip().startswith('**') else
                     src.get('returns', comment) if c.strip().startswith(')') else comment) for c,comment in split]
    rows,code = [],[]
    for i,(c,comment) in enumerate(split):
        c = re.sub(r':\s*NoneType\s*=\s*None\b', '=None', c) # (show_doc's type for an unannotated None default says nothing)
        code.append(c)
        stripped = c.strip()
        if i == len(lines) - 1 or stripped.startswith(')'):
            ret = stripped[stripped.index('->') + 2:].rstrip(':').strip() if '->' in stripped else ''
            if comment: rows.append(('**returns**', ret, '', comment))
            continue
        if stripped.endswith('(') or stripped.startswith(('class ', 'def ', '@')) or stripped.rstrip(',') in ('*', '/', 'self'): continue
        p = re.sub(r'^(?:[*/]\s*,\s*)+', '', stripped.rstrip(',')) # (`*, init_scale:...`: the bare `*` on the parameter's line)
        eq = _top_level(p, '='); head,default = (p[:eq], p[eq+1:]) if eq >= 0 else (p, '')
        colon = _top_level(head, ':'); name,typ = (head[:colon], head[colon+1:]) if colon >= 0 else (head, '')
        rows.append((f'`{name.strip()}`', typ.strip(), default.strip(), comment))
    if not any(r[3] for r in rows): return md
    table = '\n'.join(['| Parameter | Type | Default | Details |', '|---|---|---|---|'] +
                      [f"| {n} | {_code_cell(t)} | {_code_cell(d)} | {c.replace('|', '&#124;')} |" for n,t,d,c in rows])
    return md[:m.start()] + '```python\n' + '\n'.join(code) + '\n```' + md[m.end():].rstrip('\n') + '\n\n' + table + '\n'


def load_processed(path:Path, html:bool=True) -> tuple[dict, nbformat.NotebookNode]:
    "The front matter and the notebook at `path` (in `_proc/`), with Quarto's markup turned into plain notebook features"
    nb = nbformat.read(path, as_version=4)
    meta = split_front_matter(nb)
    meta.setdefault('output-file', re.sub(r'^\d+_', '', Path(path).stem) + '.html')
    meta.setdefault('title', Path(path).stem)
    apply_cell_options(nb)
    for cell in nb.cells:
        if cell.cell_type == 'markdown': cell.source = plain_markdown(cell.source, html)
    _tables = param_tables if html else (lambda md: md) # (the table's inline code is HTML)
    for data in _markdown_outputs(nb): data['text/markdown'] = plain_markdown(_tables(name_defaults(mark_classes(mark_properties(data['text/markdown'])))), html)
    for cell in nb.cells:
        for out in cell.get('outputs', []):
            if out.get('name') == 'stderr': out['text'] = plain_warnings(out['text'])
    return meta, nb


def pandoc_id(text:str) -> str:
    "The identifier Pandoc (and so Quarto, and nbdev's doc links) gives a heading with this text"
    s = re.sub(r'[^\w\s.-]', '', text.strip(), flags=re.UNICODE)
    s = re.sub(r'\s+', '-', s).lower()
    s = re.sub(r'^[^a-z]+', '', s) # identifiers start with a letter
    return s or 'section'
