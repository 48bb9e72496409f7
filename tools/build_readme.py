"""Write README.md from nbs/index.ipynb without Quarto: `make readme` (and `make readme-check`, into a temporary file).

`nbdev-readme` renders the processed home page with Quarto to GitHub markdown; Quarto cannot be installed here.
This takes the same processed notebook (`_proc/index.ipynb`, nbdev's doc links already absolute, so they work on
GitHub and PyPI) through nbconvert's markdown exporter. Quarto's parts are done here: the front matter becomes the
`# title` and the `> summary` at the top, instead of a YAML block; hidden cells stay hidden; Pandoc-only syntax is
turned into plain markdown."""
from __future__ import annotations
import argparse, re
from pathlib import Path
from nbconvert import MarkdownExporter
from processed_nb import load_processed


def readme_markdown(nb_path:Path) -> tuple[str, dict]:
    "README text for the processed notebook `nb_path`, and the output files (images) it refers to"
    meta,nb = load_processed(nb_path, html=False)
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
