"""Open every page of the built docs (`_docs/`) in headless Chromium and fail on what a reader would trip over: `make docs-check`.

Checked on each page as the browser rendered it: internal links resolve (the file exists in `_docs/`, and so does
the `#anchor`), every image loads and is embedded, no output holds a Python traceback, nothing failed to load or threw
a JavaScript error, and the sidebar lists every page. Screenshots of the home page and the tutorial go to
`_docs/screenshots/` for review.

Chromium is driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: file descriptors 3 and 4, JSON
messages ended by a NUL byte), so one browser serves every page and no websocket library is needed."""
from __future__ import annotations
import argparse, base64, json, os, re, select, shutil, subprocess, sys, tempfile, time
from pathlib import Path
from urllib.parse import unquote, urlparse

CHROMIUM_FLAGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
                  '--disable-component-update', '--disable-sync', '--no-first-run', '--hide-scrollbars',
                  '--remote-debugging-pipe']
SCREEN = dict(width=1280, height=2000)
SCREENSHOTS = ['index.html', 'tutorial.html']
TRACEBACK_RE = re.compile(r'Traceback \(most recent call last\)')
# Markdown link syntax left visible: a link inside a link (nbdev links `name` in backticks itself), or a typo
RAW_LINK_RE = re.compile(r'\]\((?:https?://|[\w./-]+\.(?:html|ipynb))[^)\s]*\)')

# What the page reports about itself once loaded: read in the browser, so it is what a reader gets
PAGE_REPORT_JS = """JSON.stringify({
  ids: [...document.querySelectorAll('[id]')].map(e => e.id),
  links: [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href')),
  sidebar: [...document.querySelectorAll('nav.site-sidebar a[href]')].map(a => a.getAttribute('href')),
  images: [...document.images].map(i => ({src: i.getAttribute('src') || '', ok: i.complete && i.naturalWidth > 0,
                                          alt: i.alt})),
  outputs: [...document.querySelectorAll('.jp-OutputArea-output')].map(o => o.innerText),
  prose: [...document.querySelectorAll('.jp-RenderedMarkdown')].map(o => o.innerText).join('\\n'),
  styled: getComputedStyle(document.querySelector('.site-navbar') || document.body).position === 'sticky',
  text: document.body.innerText.length,
})"""


class DevToolsPipe:
    "A headless Chromium and the DevTools protocol over its pipe"
    def __init__(self, exe:str):
        self.profile = tempfile.mkdtemp(prefix='docs-check-chromium-')
        to_chrome_r,self.to_chrome = os.pipe()
        self.from_chrome,from_chrome_w = os.pipe()
        # Chromium reads commands from fd 3 and writes to fd 4: the shell puts our pipe ends there
        cmd = ['sh', '-c', f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}', exe, *CHROMIUM_FLAGS,
               f'--user-data-dir={self.profile}', f'--window-size={SCREEN["width"]},{SCREEN["height"]}', 'about:blank']
        self.proc = subprocess.Popen(cmd, pass_fds=(to_chrome_r, from_chrome_w), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(to_chrome_r); os.close(from_chrome_w)
        self.buf,self.events,self.next_id = b'',[],0

    def close(self):
        try: self.send('Browser.close', timeout=5)
        except Exception: pass
        try: self.proc.wait(5)
        except subprocess.TimeoutExpired: self.proc.kill()
        for fd in (self.to_chrome, self.from_chrome): os.close(fd)
        shutil.rmtree(self.profile, ignore_errors=True)

    def _read(self, timeout:float) -> dict:
        end = time.monotonic() + timeout
        while b'\0' not in self.buf:
            if time.monotonic() > end: raise TimeoutError('Chromium did not answer')
            if self.proc.poll() is not None: raise RuntimeError(f'Chromium exited with code {self.proc.returncode}')
            if select.select([self.from_chrome], [], [], .2)[0]: self.buf += os.read(self.from_chrome, 1 << 20)
        msg,self.buf = self.buf.split(b'\0', 1)
        return json.loads(msg)

    def send(self, method:str, session:str|None=None, timeout:float=30, **params) -> dict:
        "Send a command and return its result; events that arrive meanwhile are kept in `self.events`"
        self.next_id += 1
        msg = {'id': self.next_id, 'method': method, 'params': params}
        if session: msg['sessionId'] = session
        os.write(self.to_chrome, json.dumps(msg).encode() + b'\0')
        while True:
            res = self._read(timeout)
            if res.get('id') != self.next_id: self.events.append(res); continue
            if 'error' in res: raise RuntimeError(f"{method}: {res['error']}")
            return res['result']

    def wait_for(self, method:str, session:str, timeout:float=30) -> None:
        "Wait for the event `method` in `session`"
        for i,e in enumerate(self.events):
            if e.get('method') == method and e.get('sessionId') == session: del self.events[i]; return
        end = time.monotonic() + timeout
        while True:
            e = self._read(max(.1, end - time.monotonic()))
            if e.get('method') == method and e.get('sessionId') == session: return
            self.events.append(e)


def open_tab(browser:DevToolsPipe) -> str:
    "A new tab, its events on, at the screenshot size; returns its session id"
    target = browser.send('Target.createTarget', url='about:blank')['targetId']
    session = browser.send('Target.attachToTarget', targetId=target, flatten=True)['sessionId']
    for domain in ('Page', 'Network', 'Runtime', 'Log'): browser.send(f'{domain}.enable', session)
    browser.send('Emulation.setDeviceMetricsOverride', session, deviceScaleFactor=1, mobile=False, **SCREEN)
    return session


def load(browser:DevToolsPipe, session:str, path:Path) -> tuple[dict, list]:
    "Open `path`, wait for it to load, and return its report and the problems the browser logged"
    browser.events.clear()
    browser.send('Page.navigate', session, url=path.resolve().as_uri())
    browser.wait_for('Page.loadEventFired', session)
    res = browser.send('Runtime.evaluate', session, expression=PAGE_REPORT_JS, returnByValue=True)
    if 'exceptionDetails' in res: raise RuntimeError(f"page report failed on {path}: {res['exceptionDetails']}")
    report = json.loads(res['result']['value'])
    urls,problems = {},[]
    for e in browser.events:
        m,p = e.get('method'),e.get('params', {})
        if m == 'Network.requestWillBeSent': urls[p['requestId']] = p['request']['url']
        elif m == 'Network.loadingFailed':
            problems.append(f"failed to load {urls.get(p['requestId'], '?')[:120]}: {p.get('errorText')}")
        elif m == 'Runtime.exceptionThrown':
            d = p['exceptionDetails']
            problems.append(f"JavaScript error: {d.get('exception', {}).get('description') or d.get('text')}"[:200])
        elif m == 'Log.entryAdded' and p['entry']['level'] == 'error': problems.append(f"console: {p['entry']['text'][:200]}")
    return report, problems


def screenshot(browser:DevToolsPipe, session:str, dest:Path, full_page:bool=False) -> None:
    "Save what the 1280x2000 window shows, or the whole page"
    kw = {}
    if full_page:
        size = browser.send('Page.getLayoutMetrics', session)['cssContentSize']
        kw = dict(captureBeyondViewport=True, clip=dict(x=0, y=0, width=size['width'], height=size['height'], scale=1))
    data = browser.send('Page.captureScreenshot', session, format='png', **kw)['data']
    dest.write_bytes(base64.b64decode(data))


def check_links(page:str, report:dict, ids:dict, docs:Path, site_url:str) -> list:
    "Problems with the links of `page`: internal ones must reach a file in `docs` and an anchor in it"
    problems = []
    for href in report['links']:
        if site_url and href.startswith(site_url):
            problems.append(f'absolute link to the published site (the build makes these relative): {href}'); continue
        url = urlparse(href)
        if url.scheme or href.startswith('//'): continue # external: not checked (no network here)
        path,frag = unquote(url.path),unquote(url.fragment)
        target = page if not path else os.path.normpath(os.path.join(os.path.dirname(page), path))
        if path.endswith('.ipynb'): problems.append(f'link to a notebook, not a page: {href}'); continue
        if not (docs/target).is_file(): problems.append(f'broken link: {href} ({target} is not in {docs.name}/)'); continue
        if frag and target in ids and frag not in ids[target]: problems.append(f'broken anchor: {href} (no id "{frag}" in {target})')
    return problems


def check_page(page:str, report:dict, pages:list) -> list:
    problems = []
    for img in report['images']:
        if not img['ok']: problems.append(f"image does not load: {img['src'][:80]!r} (alt {img['alt']!r})")
        elif not img['src'].startswith('data:'): problems.append(f"image not embedded: {img['src'][:80]!r}")
    for text in report['outputs']:
        if TRACEBACK_RE.search(text): problems.append('Python traceback in an output: ' + text.strip().splitlines()[-1][:200])
    for m in RAW_LINK_RE.finditer(report['prose']): problems.append(f'markdown link shown as text: ...{m.group(0)[:80]}')
    missing = sorted(set(pages) - set(report['sidebar']))
    if missing: problems.append(f'sidebar does not list {", ".join(missing)} (add them to nbs/sidebar.yml)')
    if not report['styled']: problems.append('stylesheets did not apply')
    if report['text'] < 200: problems.append(f"page is nearly empty ({report['text']} characters of text)")
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--docs', default='_docs', help='Folder of the built site')
    ap.add_argument('--chromium', default=shutil.which('chromium') or shutil.which('chromium-browser') or 'chromium')
    ap.add_argument('--site-url', default=None, help="The published site's URL (default: from nbdev's config)")
    ap.add_argument('--screenshots', nargs='*', default=SCREENSHOTS, help='Pages to save a screenshot of')
    ap.add_argument('--full-page', action='store_true', help='Screenshots of whole pages, not of the window')
    args = ap.parse_args()
    docs = Path(args.docs)
    pages = sorted(p.name for p in docs.glob('*.html'))
    if not pages: sys.exit(f'No pages in {docs}/: run `make docs` first')
    site_url = args.site_url
    if site_url is None:
        from nbdev.config import get_config
        cfg = get_config()
        site_url = (cfg.get('doc_host', '') + cfg.get('doc_baseurl', '')).rstrip('/')
    shots = docs/'screenshots'
    shots.mkdir(exist_ok=True)

    start = time.monotonic()
    browser = DevToolsPipe(args.chromium)
    reports,problems = {},{}
    try:
        session = open_tab(browser)
        for page in pages:
            reports[page],problems[page] = load(browser, session, docs/page)
            if page in args.screenshots: screenshot(browser, session, shots/Path(page).with_suffix('.png'), args.full_page)
    finally: browser.close()

    ids = {page: set(r['ids']) for page,r in reports.items()}
    for page,report in reports.items():
        problems[page] += check_links(page, report, ids, docs, site_url) + check_page(page, report, pages)
    n_links = sum(len(r['links']) for r in reports.values())
    n_images = sum(len(r['images']) for r in reports.values())
    bad = {p: ps for p,ps in problems.items() if ps}
    for page,ps in bad.items():
        print(f'{docs.name}/{page}:')
        for p in dict.fromkeys(ps): print(f'  - {p}')
    print(f'{len(pages)} pages, {n_links} links, {n_images} images checked in headless Chromium in '
          f'{time.monotonic()-start:.1f} s; screenshots of {", ".join(args.screenshots)} in {shots}/')
    if bad: sys.exit(f'{sum(len(set(v)) for v in bad.values())} problem(s) on {len(bad)} page(s)')


if __name__ == '__main__': main()
