"""Write README.md from nbs/index.ipynb without Quarto: `make readme` (and `make readme-check`, into a temporary file).

`nbdev-readme` renders the processed home page with Quarto to GitHub markdown; Quarto cannot be installed here.
This takes the same processed notebook (`_proc/index.ipynb`, nbdev's doc links already absolute, so they work on
GitHub and PyPI) through nbconvert's markdown exporter. Quarto's parts are done here: the front matter becomes the
`# title` and the `> summary` at the top, instead of a YAML block; hidden cells stay hidden; Pandoc-only syntax is
turned into plain markdown.

README.md is also the project's PyPI page, and PyPI's renderer (readme_renderer: GFM, then an HTML sanitizer) drops
`<style>` tags but shows their CSS as text, and knows no LaTeX. So what the notebook shows as HTML tables (DataFrames)
becomes a markdown table, and `$...$` formulas become plain text (`$2^{16}$` -> `2¹⁶`) or code. `tools/check_package.py`
renders the result as PyPI does and fails on CSS or TeX left in it."""
from __future__ import annotations
import argparse, re
from pathlib import Path
from bs4 import BeautifulSoup
from nbconvert import MarkdownExporter
from processed_nb import load_processed

_math_re = re.compile(r'\$\$(.+?)\$\$|(?<![\\$\w])\$(?=\S)(.+?)(?<=\S)\$(?![\w$])', re.S)
_sup = str.maketrans('0123456789+-=()n', '⁰¹²³⁴⁵⁶⁷⁸⁹⁺⁻⁼⁽⁾ⁿ')
_sub = str.maketrans('0123456789+-=()', '₀₁₂₃₄₅₆₇₈₉₊₋₌₍₎')


def plain_math(tex:str) -> str:
    "A formula as text: powers and indices of digits as Unicode super/subscripts, anything else as code"
    t = tex.strip()
    t = re.sub(r'\^\{([0-9+\-=()n]+)\}|\^([0-9n])', lambda m: (m.group(1) or m.group(2)).translate(_sup), t)
    t = re.sub(r'_\{([0-9+\-=()]+)\}|_([0-9])', lambda m: (m.group(1) or m.group(2)).translate(_sub), t)
    t = t.replace(r'\times', '×').replace(r'\cdot', '·').replace(r'\approx', '≈').replace(r'\le', '≤').replace(r'\ge', '≥')
    return t if re.fullmatch(r'[\w.,+\-=×·≈≤≥ ⁰-⁹⁺⁻⁼⁽⁾ⁿ₀-₉₊₋₌₍₎¹²³]*', t) else f'`{tex.strip()}`'


def html_table_markdown(html:str) -> str|None:
    "A GitHub-flavoured markdown table for the single HTML table in `html` (a DataFrame's), or None if there is none"
    tables = BeautifulSoup(html, 'html.parser').find_all('table')
    if len(tables) != 1: return None
    rows = [[c.get_text(' ', strip=True).replace('|', '\\|') for c in tr.find_all(['th', 'td'])] for tr in tables[0].find_all('tr')]
    rows = [r for r in rows if r]
    if not rows: return None
    width = max(map(len, rows))
    rows = [r + [''] * (width - len(r)) for r in rows]
    lines = ['| ' + ' | '.join(rows[0]) + ' |', '|' + '---|' * width] + ['| ' + ' | '.join(r) + ' |' for r in rows[1:]]
    return '\n'.join(lines) + '\n'


def for_pypi(nb) -> None:
    "Turn what PyPI cannot render into what it can: HTML tables into markdown tables, formulas into text"
    for cell in nb.cells:
        if cell.cell_type == 'markdown': cell.source = _math_re.sub(lambda m: plain_math(m.group(1) or m.group(2)), cell.source)
        for out in cell.get('outputs', []):
            data = out.get('data', {})
            if 'text/html' in data:
                md = html_table_markdown(data['text/html'])
                if md is None: raise SystemExit('make readme: an HTML output that is not a table; PyPI would show its markup')
                data['text/markdown'] = md
                del data['text/html']


def readme_markdown(nb_path:Path) -> tuple[str, dict]:
    "README text for the processed notebook `nb_path`, and the output files (images) it refers to"
    meta,nb = load_processed(nb_path, html=False)
    for_pypi(nb)
    # nbdev-clean strips `language_info`; the exporter needs it to label the code blocks
    nb.metadata.setdefault('language_info', {})['name'] = nb.metadata.get('kernelspec', {}).get('language', 'python')
    body,resources = MarkdownExporter(exclude_input_prompt=True, exclude_output_prompt=True).from_notebook_node(
        nb, resources={'output_files_dir': 'README_files'})
    head = f"# {meta['title']}\n\n" + (f"> {meta['description']}\n\n" if meta.get('description') else '')
    text = head + body
    text = '\n'.join(line.rstrip() for line in text.splitlines()) # stable output: no trailing spaces
    text = re.sub(r'\n{3,}', '\n\n', text).strip() + '\n'
    return text, resources.get('outputs', {})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('dest', nargs='?', default='README.md', help='Where to write the README')
    args = ap.parse_args()
    from nbdev.config import get_config
    from nbdev.serve import proc_nbs # what `nbdev-proc-nbs` runs, without its attempt to install Quarto
    cfg = get_config()
    proc = proc_nbs(file_glob=cfg.readme_nb)
    text,files = readme_markdown(proc/cfg.readme_nb)
    dest = Path(args.dest)
    dest.write_text(text)
    for name,data in files.items(): # images of outputs, if the home page ever has some
        (dest.parent/name).parent.mkdir(parents=True, exist_ok=True)
        (dest.parent/name).write_bytes(data)
    print(f'{dest}: written from {cfg.nbs_path.name}/{cfg.readme_nb}' + (f' with {len(files)} image(s)' if files else ''))


if __name__ == '__main__': main() # `proc_nbs` starts worker processes, which import this module again
