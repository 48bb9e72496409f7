"""Check the built packages as PyPI and pip users get them: `make dist-check` (after `python -m build` and `twine check --strict`).

- the LICENSE file is in the wheel and in the sdist, and the metadata names it (`License-File`);
- the sdist ships no half test suite: the tests need the repository around them (conftest.py, bench/, the notebooks);
- the long description (README.md, the PyPI page) rendered with readme_renderer, the renderer PyPI uses, shows no CSS
  (a DataFrame's `<style scoped>` ends up as text), no LaTeX (`$2^{16}$` stays raw) and no raw HTML tags as text."""
from __future__ import annotations
import argparse, re, sys, tarfile, zipfile
from email.parser import Parser
from pathlib import Path

TEX_RE = re.compile(r'\$\$.+?\$\$|(?<![\\$\w])\$(?=\S)[^$\n]+?(?<=\S)\$(?![\w$])')
CSS_RE = re.compile(r'\{\s*[\w-]+\s*:\s*[^}]*\}|<style|\.dataframe')


def readme_problems(markdown:str) -> list:
    "What PyPI would show wrongly of this markdown: rendered as PyPI renders it, then read as text"
    from bs4 import BeautifulSoup
    from readme_renderer.markdown import render
    html = render(markdown, variant='GFM')
    if html is None: return ['readme_renderer could not render the README (is readme_renderer[md] installed?)']
    soup = BeautifulSoup(html, 'html.parser')
    for code in soup.find_all(['code', 'pre']): code.decompose() # code may hold `$` and braces
    text,problems = soup.get_text(' '),[]
    for m in CSS_RE.finditer(text): problems.append(f'CSS shown as text: {m.group(0)[:60]!r}')
    for m in TEX_RE.finditer(text): problems.append(f'LaTeX shown raw: {m.group(0)[:60]!r}')
    for m in re.finditer(r'</?(?:div|table|style|span|img)\b[^>]*>', text): problems.append(f'HTML tag shown as text: {m.group(0)[:60]!r}')
    return problems


def check(dist:Path) -> list:
    problems = []
    wheels,sdists = sorted(dist.glob('*.whl')),sorted(dist.glob('*.tar.gz'))
    if not wheels or not sdists: return [f'{dist}/ needs a wheel and an sdist (python -m build)']
    for whl in wheels:
        with zipfile.ZipFile(whl) as z:
            names = z.namelist()
            meta = Parser().parsestr(z.read(next(n for n in names if n.endswith('.dist-info/METADATA'))).decode())
        if not any(re.search(r'\.dist-info/licenses/LICENSE$', n) for n in names): problems.append(f'{whl.name}: no LICENSE')
        if 'LICENSE' not in (meta.get_all('License-File') or []): problems.append(f'{whl.name}: metadata has no License-File: LICENSE')
        problems += [f'{whl.name}: README: {p}' for p in readme_problems(meta.get_payload())]
    for sd in sdists:
        with tarfile.open(sd) as t: names = [n.split('/', 1)[1] for n in t.getnames() if '/' in n]
        if 'LICENSE' not in names: problems.append(f'{sd.name}: no LICENSE')
        tests = [n for n in names if n.startswith('tests/')]
        if tests and 'tests/conftest.py' not in names: problems.append(f'{sd.name}: ships {len(tests)} test files without tests/conftest.py')
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('dist', nargs='?', default='dist', help='Folder with the wheel and the sdist')
    ap.add_argument('--readme', help='Only check that this markdown file renders on PyPI')
    args = ap.parse_args()
    if args.readme: problems = [f'{args.readme}: {p}' for p in readme_problems(Path(args.readme).read_text())]
    else: problems = check(Path(args.dist))
    for p in problems: print(f'  - {p}')
    if problems: sys.exit(f'{len(problems)} problem(s)')
    print(f'{args.readme or args.dist}: ' + ('renders on PyPI without CSS, LaTeX or HTML shown as text' if args.readme else
          'LICENSE in wheel and sdist, no partial test suite, README renders on PyPI'))


if __name__ == '__main__': main()
