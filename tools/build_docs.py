"""Build the docs site into `_docs/` without Quarto: `make docs`.

nbdev renders its docs with Quarto (`nbdev-docs`), which cannot be installed everywhere we build. This script makes
the same site from the same input, nbdev's processed notebooks in `_proc/`, with nbconvert's HTML exporter:

- nbconvert is Jupyter's own converter, maintained with the notebook format, already a dev dependency, and it renders
  every output type a notebook holds (images, DataFrames, nbdev's `show_doc` markdown) as JupyterLab does. Sphinx or
  mkdocs notebook plugins would bring a second site generator and its config to keep in step with nbdev's.
- What Quarto adds on top of the notebooks is done here: the front matter gives each page its title, summary and file
  name (`cast.html` for `00_cast.ipynb`); `nbs/sidebar.yml` gives the navigation; headings get Pandoc's identifiers,
  so nbdev's doc links (`callback.html#mastermixedprecision`) resolve; links to the published site become relative;
  formulas are drawn as SVG by matplotlib's mathtext.
- Each page stands alone: images are embedded (base64), and nothing is loaded from a network.
- Next to each page, its markdown (`cast.html.md`), as Quarto writes it for nbdev 3 (`format: commonmark`,
  `keep-md`): the module docstrings nbdev exports link there.
- Search: `search.js`, an index of every section of every page (`window.SEARCH_INDEX`), read by `site.js`, which also
  folds the sidebar away on narrow screens and puts a copy button on code blocks.
- As on Quarto's nbdev sites, each page links to the previous and the next page in the sidebar's order, and to the
  repository's new-issue form ("Report an issue", `repo-actions: [issue]` in `_quarto.yml`).
- Phones: names in the table of contents and in table cells may wrap after their `.` and `_` (`<wbr>`), and the
  lines of an API signature wrap with a hanging indent, so that long parameter comments are read, not cut off.

`nbs/_quarto.yml`, `nbs/nbdev.yml` and `nbs/sidebar.yml` stay as nbdev wants them, so `nbdev-docs` keeps working
wherever Quarto exists."""
from __future__ import annotations
import base64, html, io, json, mimetypes, re, shutil, sys
from pathlib import Path
from urllib.parse import quote
import yaml
from bs4 import BeautifulSoup, NavigableString
from jupyter_core.paths import jupyter_path
from nbconvert import HTMLExporter, MarkdownExporter
from nbconvert.filters.markdown import markdown2html
from processed_nb import load_processed, pandoc_id

TEMPLATES = Path(__file__).parent/'docs_template'
_name_break_re = re.compile(r'(?<=[A-Za-z0-9])([._])(?=[A-Za-z0-9_])') # where a dotted or snake_case name may wrap
_math_re = re.compile(r'\$\$(.+?)\$\$|(?<![\\$\w])\$(?=\S)(.+?)(?<=\S)\$(?![\w$])', re.S)


def process_notebooks() -> Path:
    "Run nbdev's notebook processing into `_proc/` and return that folder"
    # `nbdev-proc-nbs` runs this same `proc_nbs`, but first tries to install Quarto (with sudo and curl: a download on a
    # CI runner, a failure here) and refreshes `_modidx.py`, which `nbdev-export` owns.
    from nbdev.serve import proc_nbs
    return proc_nbs()


def sidebar_entries(path:Path) -> list:
    "`nbs/sidebar.yml` as a list of notebook names and `{'section': title, 'contents': [...]}` dicts"
    contents = yaml.safe_load(path.read_text())['website']['sidebar']['contents']
    def norm(o):
        if isinstance(o, str): return o
        if 'section' in o: return {'section': o['section'], 'contents': [norm(c) for c in o.get('contents', [])]}
        if 'href' in o: return o['href']
        raise ValueError(f"{path}: cannot read sidebar entry {o!r}")
    return [norm(o) for o in contents]


def inline_markdown(md:str) -> str:
    "HTML of one line of markdown, without the paragraph around it"
    return re.sub(r'^<p>(.*)</p>\s*$', r'\1', markdown2html(md or '').strip(), flags=re.S)


def page_order(entries:list) -> list:
    "The notebooks of the sidebar in reading order: the previous and next page of each"
    return [n for e in entries for n in ([e] if isinstance(e, str) else page_order(e['contents']))]


def sidebar_html(entries:list, pages:dict, current:str) -> str:
    "The sidebar as nested lists, with the current page marked"
    def item(name):
        if name not in pages: raise SystemExit(f"nbs/sidebar.yml lists {name}, which is not a notebook in nbs/")
        p = pages[name]
        active = ' class="active" aria-current="page"' if p['file'] == current else ''
        return f'<li><a href="{p["file"]}"{active}>{p["title_html"]}</a></li>'
    def render(es):
        out = []
        for e in es:
            if isinstance(e, str): out.append(item(e))
            else: out.append(f'<li><div class="section-title">{html.escape(e["section"])}</div><ul>{render(e["contents"])}</ul></li>')
        return ''.join(out)
    return f'<ul>{render(entries)}</ul>'


def math_img(tex:str, display:bool) -> str:
    "An <img> of the formula `tex`, drawn by matplotlib's mathtext as an SVG data URI sized in em"
    from matplotlib.font_manager import FontProperties
    from matplotlib.mathtext import math_to_image
    size = 12. # points; the SVG is sized in em relative to this, so the formula follows the text's size
    buf = io.BytesIO()
    try: depth = math_to_image(f'${tex}$', buf, prop=FontProperties(size=size), dpi=72, format='svg')
    except ValueError as e: # mathtext knows a subset of TeX: show the source rather than fail the build
        print(f'make docs: cannot draw ${tex}$ ({str(e).splitlines()[0]}); shown as TeX source', file=sys.stderr)
        return f'<code class="math">{html.escape(tex)}</code>'
    svg = buf.getvalue()
    height = float(re.search(rb'height="([\d.]+)pt"', svg).group(1))
    style = f'height:{height/size:.3f}em' + ('' if display else f';vertical-align:-{depth/size:.3f}em')
    src = 'data:image/svg+xml;base64,' + base64.b64encode(svg).decode()
    cls = 'math display' if display else 'math'
    return f'<img class="{cls}" alt="{html.escape(tex)}" style="{style}" src="{src}">'


def render_math(soup) -> None:
    "Replace `$...$` and `$$...$$` in rendered markdown (not in code) with images, so no MathJax is needed"
    for area in soup.select('.jp-RenderedMarkdown'):
        for text in list(area.find_all(string=_math_re)):
            if text.find_parent(['code', 'pre', 'script', 'style']): continue
            parts,pos = [],0
            for m in _math_re.finditer(text):
                parts += [html.escape(text[pos:m.start()]), math_img(m.group(1) or m.group(2), m.group(1) is not None)]
                pos = m.end()
            parts.append(html.escape(text[pos:]))
            text.replace_with(BeautifulSoup(''.join(parts), 'html.parser'))


def embed_images(soup, folder:Path) -> None:
    "Images that markdown cells load from files, as base64 data, so that each page stands alone"
    for img in soup.find_all('img', src=True):
        src = img['src']
        if re.match(r'^[a-z][a-z0-9+.-]*:', src) or src.startswith('//'): continue # data:, http(s):, attachment:
        f = folder/src
        if not f.is_file(): continue # left as is: `make docs-check` reports it
        mime = mimetypes.guess_type(f.name)[0] or 'application/octet-stream'
        img['src'] = f'data:{mime};base64,' + base64.b64encode(f.read_bytes()).decode()


def fold_sections(soup) -> None:
    """A markdown cell holding `<span data-fold="summary"></span>` folds the cells after it, up to the next cell with an h2,
    into a `<details>` with that summary: a section for contributors (show_doc's API entries included) stays on its page,
    out of the reader's way; site.js opens the fold when a link or a search hit leads into it"""
    for mark in soup.select('span[data-fold]'):
        cell = mark.find_parent('div', class_='jp-Cell')
        summary = mark['data-fold']
        mark.decompose()
        if cell is None: continue
        rest = []
        for sib in cell.find_next_siblings('div'):
            if 'jp-Cell' not in (sib.get('class') or []) or sib.find('h2'): break
            rest.append(sib)
        if not rest: continue
        fold = soup.new_tag('details', attrs={'class': 'section-fold'})
        head = soup.new_tag('summary'); head.string = summary; fold.append(head)
        cell.insert_after(fold)
        for sib in rest: fold.append(sib.extract())


def fix_headings(soup) -> list:
    "Give every heading Pandoc's identifier, as Quarto does, and return the page's h2/h3 for its table of contents"
    seen,toc = {},[]
    for h in soup.select('main h1, main h2, main h3, main h4, main h5, main h6'):
        if 'page-title' in (h.get('class') or []): continue
        for a in h.select('a.anchor-link'): a.extract()
        text = h.get_text(' ', strip=True)
        base = pandoc_id(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        hid = base if n == 0 else f'{base}-{n}'
        h['id'] = hid
        link = soup.new_tag('a', attrs={'class': 'anchor-link', 'href': f'#{hid}'})
        link.string = '¶'
        h.append(link)
        if h.name in ('h2', 'h3'): toc.append((h.name, hid, text))
    return toc


def fix_links(soup, site_url:str, pages:dict) -> None:
    "Links to the published site become relative, links to notebooks point at their pages"
    by_nb = {name: p['file'] for name,p in pages.items()}
    for a in soup.find_all('a', href=True):
        href = a['href']
        if site_url and href.startswith(site_url + '/'): href = href[len(site_url)+1:]
        path,sep,frag = href.partition('#')
        if path.endswith('.html.md'): path = path[:-3] # nbdev's links to the markdown version of a page
        if not re.match(r'^[a-z][a-z0-9+.-]*:', path) and path.endswith('.ipynb'):
            path = by_nb.get(Path(path).name, path)
        a['href'] = path + sep + frag


def page_markdown(proc_nb:Path, title:str, description:str) -> str:
    "The page as markdown (`<page>.html.md`): Quarto's commonmark output, which nbdev's module docstrings link to"
    meta,nb = load_processed(proc_nb, html=False)
    nb.metadata.setdefault('language_info', {})['name'] = nb.metadata.get('kernelspec', {}).get('language', 'python')
    for cell in nb.cells: # images live in the HTML page; the markdown keeps the text
        for out in cell.get('outputs', []):
            for k in [k for k in out.get('data', {}) if k.startswith('image/')]: del out['data'][k]
    body,_ = MarkdownExporter(exclude_input_prompt=True, exclude_output_prompt=True).from_notebook_node(nb)
    head = f"# {title}\n\n" + (f"> {description}\n\n" if description else '')
    return re.sub(r'\n{3,}', '\n\n', head + body).strip() + '\n'


_section_tags = ('h1', 'h2', 'h3', 'h4')
_skip_tags = ('script', 'style', 'button', 'nav', 'header', 'footer')
_block_tags = ('p', 'li', 'div', 'pre', 'td', 'th', 'tr', 'table', 'blockquote', 'dt', 'dd', 'br', 'hr')


_tex_words = {'approx': '≈', 'times': '×', 'cdot': '·', 'le': '≤', 'ge': '≥', 'leq': '≤', 'geq': '≥', 'log': 'log', 'max': 'max',
              'min': 'min', 'text': '', 'mathrm': '', 'frac': '', 'left': '', 'right': '', 'infty': '∞', 'epsilon': 'ε'}

def plain_tex(tex:str) -> str:
    "A formula's TeX as a search snippet shows it: `2^{-24}\\approx 6\\times10^{-8}` as `2^-24 ≈ 6×10^-8`"
    s = re.sub(r'\\([A-Za-z]+)', lambda m: _tex_words.get(m[1], m[1]), tex)
    return re.sub(r'\s+', ' ', s.replace('{', '').replace('}', '').replace('\\', '')).strip()


def search_entries(soup, page:str, title:str) -> list:
    "Sections of a page for the search index: its headings (with their anchors) and the text up to the next one"
    entries = [dict(p=page, a='', t=title, h=title, x=[])]
    def walk(node):
        for child in node.children:
            name = getattr(child, 'name', None)
            if name is None:
                if type(child).__name__ == 'NavigableString': entries[-1]['x'].append(str(child))
            elif name in _section_tags and child.get('id') and 'page-title' not in (child.get('class') or []):
                heading = re.sub(r'\s*¶$', '', child.get_text(' ', strip=True))
                entries.append(dict(p=page, a=child['id'], t=title, h=heading, x=[]))
            elif name in _skip_tags or (name == 'a' and child.get_text(strip=True) == 'source'): continue
            elif name == 'pre': entries[-1]['x'].append(' ' + child.get_text() + ' ')
            elif name == 'img' and 'math' in (child.get('class') or []): entries[-1]['x'].append(plain_tex(child.get('alt', '')))
            else:
                walk(child)
                if name in _block_tags: entries[-1]['x'].append(' ')
    walk(soup.select_one('main.site-page'))
    for e in entries: e['x'] = re.sub(r'\s+', ' ', ''.join(e['x'])).strip()[:3000]
    return [e for e in entries if e['x'] or e['a']]


def fix_source_links(soup, syms:dict) -> None:
    "nbdev's show_doc links a property's source to line `None` (`cast.py#LNone`): link the line of its getter instead"
    import importlib, inspect
    for a in soup.find_all('a', href=re.compile(r'#LNone$')):
        h = a.find_next(['h2', 'h3', 'h4'])
        name = re.sub(r'\s*¶$', '', h.get_text(' ', strip=True)) if h else ''
        key = next((k for k in syms if k.endswith('.' + name)), None)
        if not key: continue
        obj = importlib.import_module(syms[key])
        for part in name.split('.'): obj = inspect.getattr_static(obj, part)
        obj = getattr(obj, 'fget', obj)
        try: line = inspect.getsourcelines(inspect.unwrap(obj))[1]
        except (TypeError, OSError): continue
        a['href'] = a['href'][:-len('None')] + str(line)


def breakable(text:str) -> str:
    "`text` as HTML in which names may wrap after a `.` or `_` (`LossScaler.` / `from_` / `loss_scale`), never mid-word"
    return _name_break_re.sub(r'\1<wbr>', html.escape(text))


def toc_html(toc:list, issue_url:str='') -> str:
    items = ''.join(f'<li class="toc-{tag}"><a href="#{hid}">{breakable(text)}</a></li>' for tag,hid,text in toc)
    head = f'<div class="toc-title">On this page</div><ul>{items}</ul>' if toc else ''
    return head + (f'<div class="toc-actions"><a class="issue-link" href="{html.escape(issue_url)}">Report an issue</a></div>'
                   if issue_url else '')


def break_table_names(soup) -> None:
    "Names in code in table cells may wrap after `.` and `_`, so that a table of events fits a phone instead of scrolling"
    for code in soup.select('.jp-RenderedHTMLCommon td > code'): # (a column's name stays whole: site.css)
        for text in list(code.find_all(string=_name_break_re)):
            text.replace_with(BeautifulSoup(breakable(str(text)), 'html.parser'))


def describe_images(soup) -> None:
    "An output image's alt text names the code that drew it, where nbconvert writes 'No description has been provided'"
    for img in soup.select('img[alt^="No description"]'):
        cell = img.find_parent(class_='jp-Cell')
        code = cell.select_one('.jp-InputArea pre') if cell else None
        lines = [l.strip() for l in code.get_text().splitlines() if l.strip() and not l.strip().startswith('#')] if code else []
        drawing = [l for l in lines if re.search(r'plot|show|hist|imshow|barh?\(|set_title', l)] or lines # (the call that draws)
        img['alt'] = f"The figure drawn by `{drawing[0][:100]}`" if drawing else 'A figure of this section'


def wrap_signatures(soup) -> None:
    "Each line of an API signature (show_doc) in its own block that wraps with a hanging indent (see site.css)"
    for pre in soup.select('.celltag_echo-false .jp-RenderedMarkdown .highlight pre'):
        if not re.match(r'\s*(async\s+)?(def|class)\s', pre.get_text()): continue
        # pygments' tokens hold no markup of their own; a token with markup across lines: leave the signature as it is
        if any(not isinstance(n, NavigableString) and '\n' in n.get_text() and n.find(True) for n in pre.contents): continue
        lines = [[]]
        for node in list(pre.contents):
            text = str(node) if isinstance(node, NavigableString) else node.get_text()
            if '\n' not in text: lines[-1].append(node.extract()); continue
            for i,part in enumerate(text.split('\n')): # a newline, or a token such as a docstring spanning lines
                if i: lines.append([])
                if not part: continue
                lines[-1].append(NavigableString(part) if isinstance(node, NavigableString) else
                                 soup.new_tag(node.name, attrs=dict(node.attrs), string=part))
            node.extract()
        if not lines[-1]: lines.pop()
        for line in lines:
            span = soup.new_tag('span', attrs={'class': 'sig-line'})
            for n in line: span.append(n)
            pre.append(span)
        pre['class'] = pre.get('class', []) + ['signature']


def build() -> list:
    "Write one HTML page per processed notebook into `_docs/`; return the pages written"
    from nbdev.config import get_config
    cfg = get_config()
    proc = process_notebooks()
    out = cfg.doc_path
    site_url = (cfg.get('doc_host', '') + cfg.get('doc_baseurl', '')).rstrip('/')
    site = dict(title=cfg.title, repo_url=cfg.get('git_url', ''))
    issues = site['repo_url'].rstrip('/') + '/issues/new' if site['repo_url'] else ''

    nbs = sorted(proc.glob('*.ipynb'))
    loaded = {p.name: load_processed(p) for p in nbs}
    pages = {name: dict(file=meta['output-file'], title=meta['title'], title_html=inline_markdown(meta['title']),
                        description_html=inline_markdown(meta.get('description', '')), source=name)
             for name,(meta,nb) in loaded.items()}
    entries = sidebar_entries(cfg.nbs_path/'sidebar.yml')
    order = [pages[n] for n in page_order(entries) if n in pages]

    if out.exists(): shutil.rmtree(out)
    (out/'styles').mkdir(parents=True)
    lab_css = next(Path(p)/'nbconvert'/'templates'/'lab'/'static' for p in jupyter_path()
                   if (Path(p)/'nbconvert'/'templates'/'lab'/'static'/'index.css').exists())
    (out/'styles'/'jupyterlab.css').write_text((lab_css/'index.css').read_text() + (lab_css/'theme-light.css').read_text())
    own_css = cfg.nbs_path/'styles.css'
    (out/'styles'/'site.css').write_text((TEMPLATES/'site'/'site.css').read_text() +
                                         (own_css.read_text() if own_css.exists() else ''))
    shutil.copy(TEMPLATES/'site'/'site.js', out/'site.js')

    # Not `embed_images=True`: it re-parses each inline HTML tag on its own and so breaks nbdev's "source" links
    # (jupyter/nbconvert#2020); `embed_images` below does the same job after rendering.
    exporter = HTMLExporter(template_name='site', extra_template_basedirs=[str(TEMPLATES)],
                            exclude_input_prompt=True, exclude_output_prompt=True)
    ns = {}
    exec((cfg.lib_path/'_modidx.py').read_text(), ns)
    syms = {k: mod for mod,d in ns['d']['syms'].items() for k in d} # full name -> module
    written,index = [],[]
    # the pages outside the Guides and the API (Internals, the examples' helpers): search ranks them after a tie
    backstage = {n for e in entries if isinstance(e, dict) and e['section'] not in ('Guides', 'API') for n in e['contents']}
    for name,(meta,nb) in loaded.items():
        i = next((i for i,p in enumerate(order) if p['source'] == name), None) # None: a page the sidebar does not list
        near = lambda j: order[j] if i is not None and 0 <= j < len(order) else None
        page = dict(pages[name], root='', sidebar_html=sidebar_html(entries, pages, pages[name]['file']),
                    prev=near(i - 1) if i is not None else None, next=near(i + 1) if i is not None else None)
        page_url = f"{site_url}/{page['file']}"
        page['issue_url'] = f"{issues}?body={quote(f'Page: {page_url}')}" if issues else '' # GitHub's form, with the page named
        body,_ = exporter.from_notebook_node(nb, resources={'page': page, 'site': site,
                                                            'metadata': {'name': re.sub('<[^>]+>', '', page['title_html'])}})
        soup = BeautifulSoup(body, 'html.parser')
        title = html.unescape(re.sub('<[^>]+>', '', page['title_html']))
        if soup.title: soup.title.string = title if title == cfg.title else f'{title} | {cfg.title}'
        render_math(soup)
        embed_images(soup, proc)
        fold_sections(soup)
        toc = fix_headings(soup)
        fix_links(soup, site_url, pages)
        fix_source_links(soup, syms)
        break_table_names(soup)
        wrap_signatures(soup)
        describe_images(soup)
        nav = soup.select_one('nav.site-toc')
        nav.clear(); nav.append(BeautifulSoup(toc_html(toc, page['issue_url']), 'html.parser'))
        (out/page['file']).write_text(str(soup))
        (out/(page['file'] + '.md')).write_text(page_markdown(proc/name, meta['title'], meta.get('description', '')))
        index += [dict(e, i=1) if name in backstage else e for e in search_entries(soup, page['file'], title)]
        written.append(page['file'])
    # A script, not JSON: pages opened from disk (file://) may not fetch() a file, but they may load a script
    (out/'search.js').write_text('window.SEARCH_INDEX = ' + json.dumps(index, ensure_ascii=False, separators=(',', ':')) + ';\n')
    return written


if __name__ == '__main__': # `proc_nbs` starts worker processes, which import this module again
    from nbdev.config import get_config
    pages = build()
    print(f"_docs/: {len(pages)} pages ({', '.join(pages)}) built from _proc/ without Quarto; "
          f"search index search.js {(get_config().doc_path/'search.js').stat().st_size:,} bytes")
