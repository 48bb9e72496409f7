"""Open every page of the built docs (`_docs/`) in headless Chromium and fail on what a reader would trip over: `make docs-check`.

Checked on each page as the browser rendered it:
- links: internal links resolve (the file exists in `_docs/`, and so does the `#anchor`), and so do the doc links of
  the module docstrings (`Docs: .../cast.html.md`) and every anchor of a public name in `_modidx.py`;
- content: every image loads and is embedded; no output holds a Python traceback, a progress bar, or a path of the
  machine that ran the notebook (a warning's `/home/.../site-packages/...`) or the kernel's cell name (`<ipython-input-...>`); every API entry (show_doc) has text and
  a link to its source; entries shown one after the other are in the order of the source (nbdev lists the
  definitions of one cell in reverse);
- the site: nothing failed to load or threw a JavaScript error, the sidebar lists every page, every page links to the
  previous and the next page in the sidebar's order and to the repository's new-issue form, code blocks have a copy
  button that covers no line's end, search finds and opens sections (typed into the box, the first hit followed), and
  the page's table of contents breaks no word across lines;
- phones: at 400 px no page is wider than the screen, no table or code block is cut off (wider content must scroll in a
  box within the screen that shows its scrollbar; checked at 1280 px too), and the sidebar is folded away behind the
  navbar's toggle, which opens it.
Screenshots at 1280 and 400 px of the home page, the tutorial and the callback's page go to `_docs/screenshots/`.

Chromium is driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: file descriptors 3 and 4, JSON
messages ended by a NUL byte), so one browser serves every page and no websocket library is needed."""
from __future__ import annotations
import argparse, base64, json, os, re, select, shutil, subprocess, sys, tempfile, time
from pathlib import Path
from urllib.parse import unquote, urlparse

# No --hide-scrollbars: a scrollbar is how a reader sees that a table or code block goes on to the right, and the
# phone check measures it (an overlay scrollbar, which phones show only while scrolling, takes no room)
CHROMIUM_FLAGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
                  '--disable-component-update', '--disable-sync', '--no-first-run', '--remote-debugging-pipe']
SCREEN = dict(width=1280, height=2000)
PHONE = dict(width=400, height=800)
SCREENSHOTS = ['index.html', 'tutorial.html', 'callback.html']
TRACEBACK_RE = re.compile(r'Traceback \(most recent call last\)')
# fastprogress's bar as text ("100.00% [3/3 00:01<00:00]") and tqdm's ("45%|████▌     |")
PROGRESS_RE = re.compile(r'\d{1,3}\.\d\d% \[\d+/\d+ [\d:]+<|\d{1,3}%\|[█▉▊▋▌▍▎▏ ]*\|')
# A path of the machine that ran the notebook: absolute Unix paths under the usual roots, Windows drives, site-packages
LOCAL_PATH_RE = re.compile(r'(?<![\w./:])(?:/(?:home|root|tmp|work|Users|usr|opt|var|private|mnt|srv)/[^\s\'"():]+|'
                           r'[A-Za-z]:\\[^\s\'"]+)|\S*site-packages\S*')
# Typed into the search box on the home page; the first hit is followed and must land on `page` at an existing anchor
SEARCHES = [('LossScaler', 'scaler.html#lossscaler'), ('growth interval', None), ('to_unmixed', None),
            ('flush to zero', None), ('loss scale', 'tutorial.html'), ('nan', 'troubleshooting.html'),
            ('resume', 'checkpoint.html'), ('to_mixed', 'learner.html#learner.to_mixed')]
# Markdown link syntax left visible: a link inside a link (nbdev links `name` in backticks itself), or a typo
RAW_LINK_RE = re.compile(r'\]\((?:https?://|[\w./-]+\.(?:html|ipynb))[^)\s]*\)')

# What the page reports about itself once loaded: read in the browser, so it is what a reader gets
PAGE_REPORT_JS = """JSON.stringify({
  ids: [...document.querySelectorAll('[id]')].map(e => e.id),
  links: [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href')),
  sidebar: [...document.querySelectorAll('nav.site-sidebar a[href]')].map(a => a.getAttribute('href')),
  images: [...document.images].map(i => ({src: i.getAttribute('src') || '', ok: i.complete && i.naturalWidth > 0,
                                          alt: i.alt})),
  outputs: [...document.querySelectorAll('.jp-OutputArea-output')].map(o => ({text: o.innerText,
    stderr: o.getAttribute('data-mime-type') === 'application/vnd.jupyter.stderr', progress: !!o.querySelector('progress')})),
  showdocs: [...document.querySelectorAll('main .jp-Cell')].flatMap((cell, i) => !cell.classList.contains('celltag_echo-false') ? [] :
    [...cell.querySelectorAll('.jp-RenderedMarkdown')].filter(md => md.querySelector('h2, h3, h4')).map(md => {
      const h = md.querySelector('h2, h3, h4'), src = [...md.querySelectorAll('a[href]')].find(a => a.textContent.trim() === 'source');
      const rest = md.cloneNode(true); // what the entry says beyond its name and signature
      rest.querySelectorAll('h2, h3, h4, pre, hr, button').forEach(e => e.remove());
      rest.querySelectorAll('a').forEach(a => { if (a.textContent.trim() === 'source') a.remove(); });
      return {cell: i, id: h.id, name: h.textContent.replace(/¶\s*$/, '').trim(), source: src ? src.getAttribute('href') : null,
              text: rest.textContent.trim()};
    })),
  code_blocks: document.querySelectorAll('.jp-InputArea-editor pre, .jp-RenderedMarkdown pre').length,
  copy_buttons: document.querySelectorAll('.has-copy-button > .copy-button').length,
  prose: [...document.querySelectorAll('.jp-RenderedMarkdown')].map(o => o.innerText).join('\\n'),
  styled: getComputedStyle(document.querySelector('.site-navbar') || document.body).position === 'sticky',
  text: document.body.innerText.length,
  prev: (document.querySelector('nav.page-navigation a[rel=prev]') || {getAttribute: () => null}).getAttribute('href'),
  next: (document.querySelector('nav.page-navigation a[rel=next]') || {getAttribute: () => null}).getAttribute('href'),
  issue: [...document.querySelectorAll('a.issue-link[href]')].map(a => a.getAttribute('href')),
})"""

# Where a reader cannot read a table or a code block to its end: content past the box that shows it, unless that box
# scrolls sideways, lies within the screen and shows a scrollbar (one that takes room: phones draw overlay scrollbars
# only while scrolling, so a table that scrolls under one looks cut off)
CUT_OFF_JS = """(() => {
  const vw = document.documentElement.clientWidth;
  const describe = e => e.tagName.toLowerCase() + (typeof e.className === 'string' && e.className.trim() ?
    '.' + e.className.trim().split(/\\s+/).slice(0, 2).join('.') : '');
  const scrollbar = s => { const cs = getComputedStyle(s);
    return s.offsetHeight - s.clientHeight - parseFloat(cs.borderTopWidth) - parseFloat(cs.borderBottomWidth) > 0; };
  const cut = [];
  for (const e of document.querySelectorAll('main table, main pre')) {
    const r = e.getBoundingClientRect();
    if (!r.width) continue; // not shown (a folded code block)
    let box = null; // the nearest box that scrolls or clips, the element itself included
    for (let p = e; p && p !== document.body; p = p.parentElement) if (getComputedStyle(p).overflowX !== 'visible') { box = p; break; }
    const right = box === e ? r.left + e.clientLeft + e.scrollWidth : r.left + Math.max(r.width, e.scrollWidth);
    const b = box ? box.getBoundingClientRect() : null;
    const shown = Math.min(box ? b.left + box.clientLeft + box.clientWidth : vw, vw);
    if (right <= shown + 1) continue;
    const how = box && getComputedStyle(box).overflowX;
    if (box && (how === 'auto' || how === 'scroll') && b.left >= -1 && b.right <= vw + 1 && scrollbar(box)) continue;
    const where = box === e ? 'itself' : box ? describe(box) : '';
    cut.push({what: describe(e), shown: Math.round(shown - r.left), needs: Math.round(right - r.left),
              text: e.innerText.trim().split('\\n')[0].slice(0, 50),
              why: !box ? 'it sticks out of the screen' : how === 'hidden' || how === 'clip' ? `${where} cuts it off (overflow-x: ${how})` :
                   !(b.left >= -1 && b.right <= vw + 1) ? `it scrolls inside ${where}, which sticks out of the screen` :
                   `it scrolls inside ${where}, which shows no scrollbar`});
  }
  return JSON.stringify(cut);
})()"""

# Copy buttons sit on the code's top right corner: no line may end under one, where the reader cannot see its end
# (lines longer than the box are checked scrolled to the end, as a reader would read them)
COPY_COVER_JS = """(() => {
  const covered = [];
  document.querySelectorAll('.has-copy-button').forEach(holder => {
    const btn = holder.querySelector(':scope > .copy-button'), pre = holder.querySelector('pre');
    if (!btn || !pre || !btn.getBoundingClientRect().width) return;
    let box = pre; while (box !== holder && getComputedStyle(box).overflowX === 'visible') box = box.parentElement;
    const start = box.scrollLeft;
    for (const pos of [0, box.scrollWidth]) {
      box.scrollLeft = pos;
      const b = btn.getBoundingClientRect(), br = box.getBoundingClientRect(), edge = br.left + box.clientLeft + box.clientWidth;
      const range = document.createRange(); range.selectNodeContents(pre);
      const lines = new Map(); // top -> [right, bottom]
      for (const r of range.getClientRects()) { if (!r.width) continue; const k = Math.round(r.top), l = lines.get(k);
        lines.set(k, l ? [Math.max(l[0], r.right), Math.max(l[1], r.bottom)] : [r.right, r.bottom]); }
      [...lines.entries()].sort((x, y) => x[0] - y[0]).forEach(([top, [right, bottom]], i) => {
        if (right <= edge + .5 && right > b.left + 1 && top < b.bottom - 1 && bottom > b.top + 1)
          covered.push(`line ${i + 1} of "${pre.innerText.trim().split('\\n')[0].slice(0, 40)}"`); });
    }
    box.scrollLeft = start;
  });
  return JSON.stringify([...new Set(covered)]);
})()"""

# The page's table of contents (shown at 1280 px): entries wrap between words, or after the `.` and `_` of a name,
# never inside a word ("LossScaler.from_loss_sc" / "ale")
TOC_BREAKS_JS = """JSON.stringify([...document.querySelectorAll('nav.site-toc a')].flatMap(a => {
  const chars = [], walk = document.createTreeWalker(a, NodeFilter.SHOW_TEXT);
  while (walk.nextNode()) { const n = walk.currentNode;
    for (let i = 0; i < n.length; i++) { const r = document.createRange(); r.setStart(n, i); r.setEnd(n, i + 1);
      const rs = r.getClientRects(); if (rs.length) chars.push([n.data[i], rs[0].top]); } }
  const text = chars.map(c => c[0]).join(''), out = [];
  for (let i = 1; i < chars.length; i++)
    if (chars[i][1] > chars[i - 1][1] + 2 && /[A-Za-z0-9]/.test(chars[i - 1][0]) && /[A-Za-z0-9_]/.test(chars[i][0]))
      out.push(text.slice(0, i) + ' / ' + text.slice(i));
  return out;
}))"""


# At phone width: how wide the page is, what sticks out (outermost elements past the right edge, not inside something
# that scrolls or clips), and whether the sidebar is folded away and opens with the toggle
PHONE_REPORT_JS = """(() => {
  const vw = document.documentElement.clientWidth, clips = e => {
    for (let p = e.parentElement; p && p !== document.body; p = p.parentElement)
      if (getComputedStyle(p).overflowX !== 'visible') return true;
    return false; };
  const past = e => { const r = e.getBoundingClientRect(); return r.width > 0 && r.right > vw + 1; };
  const offenders = [...document.querySelectorAll('body *')].filter(e => past(e) && !clips(e) && !(e.parentElement && past(e.parentElement)))
    .slice(0, 5).map(e => e.tagName.toLowerCase() + (typeof e.className === 'string' && e.className.trim() ?
      '.' + e.className.trim().split(/\\s+/).slice(0, 3).join('.') : '') + ` (right edge ${Math.round(e.getBoundingClientRect().right)} px)`);
  const sidebar = document.querySelector('nav.site-sidebar'), toggle = document.querySelector('.sidebar-toggle');
  const shown = e => !!e && getComputedStyle(e).display !== 'none' && e.getBoundingClientRect().width > 0;
  const res = {width: document.documentElement.scrollWidth, viewport: vw, offenders,
               sidebar_folded: !shown(sidebar), toggle_shown: shown(toggle)};
  if (toggle) { toggle.click(); res.sidebar_opens = shown(sidebar) && sidebar.getBoundingClientRect().right <= vw + 1;
                toggle.click(); res.sidebar_closes = !shown(sidebar); }
  return JSON.stringify(res);
})()"""

DESKTOP_LAYOUT_JS = """JSON.stringify({sidebar: getComputedStyle(document.querySelector('nav.site-sidebar')).display !== 'none',
  toggle: getComputedStyle(document.querySelector('.sidebar-toggle') || document.body).display === 'none' ? false : !!document.querySelector('.sidebar-toggle'),
  width: document.documentElement.scrollWidth, viewport: document.documentElement.clientWidth})"""


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


def open_tab(browser:DevToolsPipe, screen:dict=SCREEN, mobile:bool=False) -> str:
    "A new tab, its events on, at the size `screen` (a phone's viewport if `mobile`); returns its session id"
    target = browser.send('Target.createTarget', url='about:blank')['targetId']
    session = browser.send('Target.attachToTarget', targetId=target, flatten=True)['sessionId']
    for domain in ('Page', 'Network', 'Runtime', 'Log'): browser.send(f'{domain}.enable', session)
    browser.send('Emulation.setDeviceMetricsOverride', session, deviceScaleFactor=1, mobile=mobile, **screen)
    return session


def evaluate(browser:DevToolsPipe, session:str, expression:str):
    "The JSON value `expression` evaluates to in the page"
    res = browser.send('Runtime.evaluate', session, expression=expression, returnByValue=True, awaitPromise=True)
    if 'exceptionDetails' in res: raise RuntimeError(f"evaluating in the page failed: {res['exceptionDetails']}")
    return json.loads(res['result']['value'])


def load(browser:DevToolsPipe, session:str, path:Path) -> tuple[dict, list]:
    "Open `path`, wait for it to load, and return its report and the problems the browser logged"
    browser.events.clear()
    browser.send('Page.navigate', session, url=path.resolve().as_uri())
    browser.wait_for('Page.loadEventFired', session)
    report = evaluate(browser, session, PAGE_REPORT_JS)
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


def check_page(page:str, report:dict, pages:list, order:list, repo_url:str) -> list:
    problems = []
    for img in report['images']:
        if not img['ok']: problems.append(f"image does not load: {img['src'][:80]!r} (alt {img['alt']!r})")
        elif not img['src'].startswith('data:'): problems.append(f"image not embedded: {img['src'][:80]!r}")
    for out in report['outputs']:
        text,kind = out['text'],('stderr output' if out['stderr'] else 'output')
        if TRACEBACK_RE.search(text): problems.append('Python traceback in an output: ' + text.strip().splitlines()[-1][:200])
        if out['progress'] or PROGRESS_RE.search(text):
            problems.append(f'progress bar committed in an {kind}: {text.strip()[:80]!r} (run it under learn.no_bar())')
        m = LOCAL_PATH_RE.search(text)
        if m: problems.append(f'{kind} shows a path of the machine that ran it: {m.group(0)[:100]!r}')
        if '<ipython-input-' in text: problems.append(f"{kind} shows the kernel's cell name: {text.strip()[:80]!r} (tools/processed_nb.py's plain_warnings)")
    for m in RAW_LINK_RE.finditer(report['prose']): problems.append(f'markdown link shown as text: ...{m.group(0)[:80]}')
    missing = sorted(set(pages) - set(report['sidebar']))
    if missing: problems.append(f'sidebar does not list {", ".join(missing)} (add them to nbs/sidebar.yml)')
    if not report['styled']: problems.append('stylesheets did not apply')
    if report['text'] < 200: problems.append(f"page is nearly empty ({report['text']} characters of text)")
    if report['copy_buttons'] < report['code_blocks']:
        problems.append(f"{report['code_blocks'] - report['copy_buttons']} of {report['code_blocks']} code blocks have no copy button")
    if page in order: # previous and next page, in the sidebar's order
        i = order.index(page)
        for rel,want in (('prev', order[i-1] if i > 0 else None), ('next', order[i+1] if i+1 < len(order) else None)):
            if report[rel] != want: problems.append(f"the {rel} page link leads to {report[rel]}, not {want} (the sidebar's order)")
    if repo_url and not any(h.startswith(repo_url.rstrip('/') + '/issues/new') for h in report['issue']):
        problems.append(f"no link to report an issue ({repo_url.rstrip('/')}/issues/new)")
    return problems + check_showdocs(report['showdocs'])


def check_showdocs(entries:list) -> list:
    "API entries: each has text and a source link; consecutive entries follow the source's order"
    problems = []
    for e in entries:
        if not e['text']: problems.append(f"empty API entry: {e['name']} shows only its signature (give it a docstring)")
        if not e['source']: problems.append(f"API entry without a link to its source: {e['name']}")
        elif not re.search(r'#L\d+$', e['source']): problems.append(f"API entry's source link has no line: {e['name']} -> {e['source']}")
    def where(e):
        m = re.search(r'/blob/[^/]+/(.+?)#L(\d+)$', e['source'] or '')
        return (m.group(1), int(m.group(2))) if m else None
    for prev,cur in zip(entries, entries[1:]):
        if cur['cell'] != prev['cell'] + 1 and cur['cell'] != prev['cell']: continue # prose between: the author's order
        a,b = where(prev),where(cur)
        if a and b and a[0] == b[0] and b[1] < a[1]:
            problems.append(f"API entries out of source order: {prev['name']} ({a[0]}:{a[1]}) is shown before {cur['name']} "
                            f"({b[0]}:{b[1]}): nbdev lists one cell's definitions in reverse, so give each its own cell")
    return problems


def check_phone(page:str, report:dict) -> list:
    "At 400 px: nothing wider than the screen or cut off, and the sidebar folded away behind a toggle that opens it"
    problems = []
    if report['width'] > report['viewport']:
        problems.append(f"at {PHONE['width']} px the page is {report['width']} px wide (scrolls sideways): "
                        + '; '.join(report['offenders'] or ['?']))
    for c in report['cut_off']:
        problems.append(f"at {PHONE['width']} px a {c['what']} is cut off, {c['needs']} px of content in {c['shown']} px: "
                        f"{c['why']} ({c['text']!r})")
    if not report['sidebar_folded']: problems.append(f"at {PHONE['width']} px the sidebar is not folded away")
    if not report['toggle_shown']: problems.append(f"at {PHONE['width']} px there is no sidebar toggle")
    elif not (report.get('sidebar_opens') and report.get('sidebar_closes')):
        problems.append(f"at {PHONE['width']} px the sidebar toggle does not open and close the sidebar within the screen")
    return problems


def check_desktop(report:dict) -> list:
    problems = [f"the table of contents breaks a word: {b!r}" for b in report['toc_breaks']]
    problems += [f"at {SCREEN['width']} px a {c['what']} is cut off, {c['needs']} px of content in {c['shown']} px: {c['why']} "
                 f"({c['text']!r})" for c in report['cut_off']]
    if not report['sidebar']: problems.append(f"at {SCREEN['width']} px the sidebar is hidden")
    if report['toggle']: problems.append(f"at {SCREEN['width']} px the sidebar toggle shows")
    if report['width'] > report['viewport']: problems.append(f"at {SCREEN['width']} px the page is {report['width']} px wide")
    return problems


def type_text(browser:DevToolsPipe, session:str, text:str) -> None:
    "Type as a user does: key events into the focused element"
    for ch in text: browser.send('Input.dispatchKeyEvent', session, type='char', text=ch)


def press(browser:DevToolsPipe, session:str, key:str, code:int) -> None:
    for t in ('rawKeyDown', 'keyUp'): browser.send('Input.dispatchKeyEvent', session, type=t, key=key, code=key,
                                                   windowsVirtualKeyCode=code, nativeVirtualKeyCode=code)


def check_search(browser:DevToolsPipe, session:str, docs:Path, ids:dict) -> tuple[list, list]:
    "Type each query of SEARCHES into the home page's search box, press Enter, and check where the first hit leads"
    problems,seen = [],[]
    for query,expected in SEARCHES:
        browser.events.clear()
        browser.send('Page.navigate', session, url=(docs/'index.html').resolve().as_uri())
        browser.wait_for('Page.loadEventFired', session)
        evaluate(browser, session, "document.querySelector('.site-search input').focus(), 'null'")
        type_text(browser, session, query)
        hits = evaluate(browser, session, "JSON.stringify([...document.querySelectorAll('.search-results li a')]"
                                          ".map(a => [a.getAttribute('href'), a.querySelector('.search-title').textContent]))")
        if not hits: problems.append(f'search for {query!r} finds nothing'); continue
        browser.events.clear()
        press(browser, session, 'Enter', 13)
        browser.wait_for('Page.loadEventFired', session)
        landed = evaluate(browser, session, "JSON.stringify([location.pathname.split('/').pop(), decodeURIComponent(location.hash.slice(1)),"
                                            " !!(location.hash && document.getElementById(decodeURIComponent(location.hash.slice(1))))])")
        page,anchor,found = landed
        seen.append(f'{query!r}: {len(hits)} hits, Enter -> {page}#{anchor}')
        if f'{page}#{anchor}'.rstrip('#') != hits[0][0].rstrip('#'): problems.append(f'search for {query!r}: Enter opened {page}#{anchor}, not the first hit {hits[0][0]}')
        if anchor and not found: problems.append(f'search for {query!r}: the first hit {hits[0][0]} has no such anchor')
        where = f'{page}#{anchor}' if expected and '#' in expected else page # (a page, or a page and its section)
        if expected and where != expected: problems.append(f'search for {query!r}: first hit is {where}, expected {expected}')
        text = evaluate(browser, session, "JSON.stringify(document.body.innerText.toLowerCase())")
        missing = [w for w in query.lower().split() if w not in text]
        if missing: problems.append(f'search for {query!r}: {page} does not contain {missing}')
    return problems, seen


def check_index(docs:Path, ids:dict, site_url:str) -> list:
    "The doc links nbdev writes outside the pages: `_modidx.py` (public names) and the exported modules' docstrings"
    import ast
    from nbdev.config import get_config
    cfg = get_config()
    problems = []
    ns = {}
    exec((cfg.lib_path/'_modidx.py').read_text(), ns)
    for mod,syms in ns['d']['syms'].items():
        for name,(url,src) in syms.items():
            if any(part.startswith('_') for part in name.split('.')): continue # private: nbdev documents none of these
            page,_,frag = url.partition('#')
            if page not in ids: problems.append(f'_modidx.py: {name} -> {url}: no page {page}')
            elif frag and frag not in ids[page]: problems.append(f'_modidx.py: {name} -> {url}: no anchor "{frag}" in {page} (show_doc it)')
    for py in sorted(cfg.lib_path.glob('*.py')):
        doc = ast.get_docstring(ast.parse(py.read_text())) or ''
        for url in re.findall(r'https?://\S+', doc):
            url = url.rstrip('.,)')
            if not (site_url and url.startswith(site_url + '/')): continue
            path,_,frag = url[len(site_url)+1:].partition('#')
            if not (docs/path).is_file(): problems.append(f'{cfg.lib_path.name}/{py.name} docstring: {url}: {path} is not in {docs.name}/')
            elif frag and path in ids and frag not in ids[path]: problems.append(f'{cfg.lib_path.name}/{py.name} docstring: {url}: no anchor "{frag}"')
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--docs', default='_docs', help='Folder of the built site')
    ap.add_argument('--chromium', default=shutil.which('chromium') or shutil.which('chromium-browser') or 'chromium')
    ap.add_argument('--site-url', default=None, help="The published site's URL (default: from nbdev's config)")
    ap.add_argument('--screenshots', nargs='*', default=SCREENSHOTS, help='Pages to save screenshots of')
    ap.add_argument('--full-page', action='store_true', help='Screenshots of whole pages, not of the window')
    args = ap.parse_args()
    docs = Path(args.docs)
    pages = sorted(p.name for p in docs.glob('*.html'))
    if not pages: sys.exit(f'No pages in {docs}/: run `make docs` first')
    from nbdev.config import get_config
    cfg = get_config()
    site_url,repo_url = args.site_url,cfg.get('git_url', '')
    if site_url is None: site_url = (cfg.get('doc_host', '') + cfg.get('doc_baseurl', '')).rstrip('/')
    shots = docs/'screenshots'
    shots.mkdir(exist_ok=True)

    start = time.monotonic()
    browser = DevToolsPipe(args.chromium)
    reports,problems,phone,desktop = {},{},{},{}
    try:
        session = open_tab(browser)
        for page in pages:
            reports[page],problems[page] = load(browser, session, docs/page)
            desktop[page] = evaluate(browser, session, DESKTOP_LAYOUT_JS)
            desktop[page]['toc_breaks'] = evaluate(browser, session, TOC_BREAKS_JS)
            desktop[page]['cut_off'] = evaluate(browser, session, CUT_OFF_JS)
            problems[page] += [f"at {SCREEN['width']} px the copy button covers the end of {c}" for c in evaluate(browser, session, COPY_COVER_JS)]
            if page in args.screenshots: screenshot(browser, session, shots/f'{Path(page).stem}-{SCREEN["width"]}.png', args.full_page)
        ids = {page: set(r['ids']) for page,r in reports.items()}
        search_problems,searches = check_search(browser, session, docs, ids)
        small = open_tab(browser, PHONE, mobile=True)
        for page in pages:
            _,more = load(browser, small, docs/page)
            problems[page] += more
            if page in args.screenshots: screenshot(browser, small, shots/f'{Path(page).stem}-{PHONE["width"]}.png', args.full_page)
            phone[page] = evaluate(browser, small, PHONE_REPORT_JS)
            phone[page]['cut_off'] = evaluate(browser, small, CUT_OFF_JS)
            problems[page] += [f"at {PHONE['width']} px the copy button covers the end of {c}" for c in evaluate(browser, small, COPY_COVER_JS)]
    finally: browser.close()

    order = [h for h in reports.get('index.html', next(iter(reports.values())))['sidebar'] if h in reports]
    for page,report in reports.items():
        problems[page] += (check_links(page, report, ids, docs, site_url) + check_page(page, report, pages, order, repo_url) +
                           check_desktop(desktop[page]) + check_phone(page, phone[page]))
    problems['search'] = search_problems
    problems['_modidx.py and module docstrings'] = check_index(docs, ids, site_url)
    n_links = sum(len(r['links']) for r in reports.values())
    n_images = sum(len(r['images']) for r in reports.values())
    n_entries = sum(len(r['showdocs']) for r in reports.values())
    bad = {p: ps for p,ps in problems.items() if ps}
    for page,ps in bad.items():
        print(f'{docs.name}/{page}:' if page.endswith('.html') else f'{page}:')
        for p in dict.fromkeys(ps): print(f'  - {p}')
    print('search: ' + '; '.join(searches))
    widths = [phone[p]['width'] for p in pages]
    print(f'{len(pages)} pages, {n_links} links, {n_images} images, {n_entries} API entries checked in headless Chromium in '
          f'{time.monotonic()-start:.1f} s; at {PHONE["width"]} px pages are {min(widths)}-{max(widths)} px wide; '
          f'screenshots of {", ".join(args.screenshots)} at {SCREEN["width"]} and {PHONE["width"]} px in {shots}/')
    if bad: sys.exit(f'{sum(len(set(v)) for v in bad.values())} problem(s) on {len(bad)} page(s)')


if __name__ == '__main__': main()
