/* The docs site's behaviour, without a framework or a network: a sidebar that folds away on narrow screens, a copy
   button on every code block, search over every section of every page, tables of prose
   that stack on a phone, a shade on tables that scroll sideways, and sentences in DataFrame cells aligned left. The search index is `search.js`
   (`window.SEARCH_INDEX`, written by tools/build_docs.py): a script rather than JSON, so that pages opened from disk
   can load it too. */
(function () {
  'use strict';

  /* Sidebar: on narrow screens the navbar's menu button shows and hides it */
  function setupSidebar() {
    var button = document.querySelector('.sidebar-toggle');
    if (!button) return;
    button.addEventListener('click', function () {
      var open = document.body.classList.toggle('sidebar-open');
      button.setAttribute('aria-expanded', open ? 'true' : 'false');
    });
  }

  /* Copy buttons: the code as text, without the button's own label */
  function copyText(text) {
    if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
    return new Promise(function (resolve, reject) { // file:// pages: the clipboard API needs a secure context
      var area = document.createElement('textarea');
      area.value = text; area.setAttribute('readonly', ''); area.style.position = 'fixed'; area.style.opacity = '0';
      document.body.appendChild(area); area.select();
      var ok = false;
      try { ok = document.execCommand('copy'); } catch (e) { ok = false; }
      document.body.removeChild(area);
      ok ? resolve() : reject(new Error('copy refused'));
    });
  }

  function setupCopyButtons() {
    var blocks = document.querySelectorAll('.jp-InputArea-editor, .jp-RenderedMarkdown pre');
    blocks.forEach(function (block) {
      if (block.closest('.jp-InputArea-editor') && block.tagName === 'PRE') return; // the editor has its own button
      var pre = block.tagName === 'PRE' ? block : block.querySelector('pre');
      if (!pre) return;
      var holder = block.tagName === 'PRE' ? block.parentElement : block;
      if (block.tagName === 'PRE') { // wrap, so the button stays put while the code scrolls sideways
        holder = document.createElement('div');
        holder.className = 'code-block';
        block.parentNode.insertBefore(holder, block);
        holder.appendChild(block);
      }
      holder.classList.add('has-copy-button');
      var button = document.createElement('button');
      button.type = 'button'; button.className = 'copy-button'; button.textContent = 'Copy';
      button.setAttribute('aria-label', 'Copy code to clipboard');
      button.addEventListener('click', function () {
        copyText(pre.innerText.replace(/\n$/, '')).then(function () {
          button.textContent = 'Copied'; button.dataset.copied = 'true';
        }, function () { button.textContent = 'Copy failed'; button.dataset.copied = 'false'; })
          .then(function () { setTimeout(function () { button.textContent = 'Copy'; }, 1500); });
      });
      holder.appendChild(button);
    });
  }

  /* Search: every query word must occur (as a word prefix) in a section's heading or text; heading hits rank first */
  function tokens(s) { return (s.toLowerCase().match(/[\w.]+/g) || []).filter(function (t) { return t.length > 1 || /\d/.test(t); }); }

  function escapeHtml(s) {
    return s.replace(/[&<>"']/g, function (c) { return {'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;'}[c]; });
  }

  function prepare(index) {
    return index.map(function (e) {
      // a CamelCase name is found by its words too: "gradient accumulation" finds `GradientAccumulation`
      var words = function (s) { return s + ' ' + s.replace(/([a-z0-9])([A-Z])/g, '$1 $2'); };
      return {e: e, head: words(e.t + ' ' + e.h).toLowerCase(), sec: (e.h || '').toLowerCase(), text: words(e.x).toLowerCase()};
    });
  }

  function wordPrefixCount(hay, tok) {
    var n = 0, i = hay.indexOf(tok);
    while (i !== -1 && n < 20) {
      if (i === 0 || !/[a-z0-9]/.test(hay[i - 1])) n++; // "_" and "." start words too: growth_interval
      i = hay.indexOf(tok, i + 1);
    }
    return n;
  }

  function search(entries, query, limit) {
    var toks = tokens(query);
    if (!toks.length) return [];
    var hits = [];
    entries.forEach(function (d) {
      var score = 0;
      for (var i = 0; i < toks.length; i++) {
        var h = wordPrefixCount(d.head, toks[i]), x = wordPrefixCount(d.text, toks[i]);
        if (!h && !x) return;
        score += 10 * Math.min(h, 1) + Math.min(x, 10); // a heading holds a word or not: `LossScaler.from_loss_scale` says it three times
      }
      // a section whose heading holds the query as typed ("loss scale") before those that hold its words apart
      if (toks.length > 1 && d.sec.indexOf(toks.join(' ')) !== -1) score += 25;
      // the section named as typed, its class's name or not: `LossScaler` before `LossScaler.settle`, and
      // `Learner.to_mixed` first for "to_mixed"
      if (d.sec === toks.join(' ') || d.sec.split('.').pop() === toks.join(' ')) score += 10;
      if (d.e.a === '') score -= 1; // a page's top before its sections when they tie
      if (d.e.i) score -= 15; // the Internals and the examples' helpers after the guides and the API, unless named
      hits.push({d: d, score: score});
    });
    hits.sort(function (a, b) { return b.score - a.score; });
    return hits.slice(0, limit).map(function (h) { return h.d.e; });
  }

  function snippet(text, toks) {
    var low = text.toLowerCase(), at = -1;
    toks.forEach(function (t) { var i = low.indexOf(t); if (i !== -1 && (at === -1 || i < at)) at = i; });
    var start = Math.max(0, at - 40), s = (start ? '…' : '') + text.slice(start, start + 140) + (start + 140 < text.length ? '…' : '');
    var html = escapeHtml(s);
    toks.forEach(function (t) {
      html = html.replace(new RegExp('(' + t.replace(/[.*+?^${}()|[\]\\]/g, '\\$&') + ')', 'gi'), '<mark>$1</mark>');
    });
    return html;
  }

  function setupSearch() {
    var input = document.querySelector('.site-search input');
    var list = document.querySelector('.site-search .search-results');
    if (!input || !list || !window.SEARCH_INDEX) return;
    var entries = prepare(window.SEARCH_INDEX), root = document.body.dataset.root || '', selected = 0, results = [];
    function href(e) { return root + e.p + (e.a ? '#' + e.a : ''); }
    function render() {
      var toks = tokens(input.value);
      results = search(entries, input.value, 10);
      selected = 0;
      if (!input.value.trim()) { list.hidden = true; list.innerHTML = ''; return; }
      list.innerHTML = results.length ? results.map(function (e, i) {
        var title = escapeHtml(e.t) + (e.h && e.h !== e.t ? ' › ' + escapeHtml(e.h) : '');
        return '<li role="option"' + (i === 0 ? ' class="selected" aria-selected="true"' : '') + '><a href="' +
          escapeHtml(href(e)) + '"><span class="search-title">' + title + '</span><span class="search-snippet">' +
          snippet(e.x, toks) + '</span></a></li>';
      }).join('') : '<li class="search-empty">No results</li>';
      list.hidden = false;
    }
    function select(i) {
      var items = list.querySelectorAll('li[role=option]');
      if (!items.length) return;
      selected = (i + items.length) % items.length;
      items.forEach(function (li, j) { li.classList.toggle('selected', j === selected); li.setAttribute('aria-selected', j === selected); });
      items[selected].scrollIntoView({block: 'nearest'});
    }
    input.addEventListener('input', render);
    input.addEventListener('focus', function () { if (input.value.trim()) list.hidden = false; });
    input.addEventListener('keydown', function (ev) {
      if (ev.key === 'ArrowDown') { select(selected + 1); ev.preventDefault(); }
      else if (ev.key === 'ArrowUp') { select(selected - 1); ev.preventDefault(); }
      else if (ev.key === 'Enter') { if (results[selected]) window.location.href = href(results[selected]); ev.preventDefault(); }
      else if (ev.key === 'Escape') { input.value = ''; render(); input.blur(); }
    });
    document.addEventListener('click', function (ev) { if (!ev.target.closest('.site-search')) list.hidden = true; });
    document.addEventListener('keydown', function (ev) { // "/" focuses the search box, as on GitHub and Quarto sites
      if (ev.key === '/' && document.activeElement !== input && !/INPUT|TEXTAREA/.test(document.activeElement.tagName)) {
        input.focus(); ev.preventDefault();
      }
    });
  }

  /* Tables of prose (three columns or more, long cells): on a phone each row reads as a block, every cell under its
     column's name (CSS, `.prose-table`), where scrolling sideways would hide the last columns */
  function setupProseTables() {
    document.querySelectorAll('.jp-RenderedHTMLCommon table').forEach(function (table) {
      var heads = Array.prototype.map.call(table.querySelectorAll('thead th'), function (th) { return th.textContent.trim(); });
      var cells = table.querySelectorAll('tbody td');
      if (heads[0] === 'Parameter') table.classList.add('param-table'); // (tools/processed_nb.param_tables)
      if (/^(checked by|where it is checked)/.test(heads[heads.length - 1] || '')) table.classList.add('evidence-table'); // its last column names the tests: set back
      if (heads.length < 3 || !cells.length) return;
      var chars = 0;
      cells.forEach(function (td) { chars += td.textContent.length; });
      if (chars / cells.length < 25 && !table.classList.contains('param-table')) return; // numbers and short words: a table scrolls, and is read as one
      table.classList.add('prose-table');
      table.querySelectorAll('tbody tr').forEach(function (tr) {
        Array.prototype.forEach.call(tr.children, function (td, i) { if (i > 0 && heads[i] && td.textContent.trim()) td.setAttribute('data-label', heads[i]); });
      });
    });
  }

  /* A DataFrame's cells are right-aligned, for numbers: a sentence in one (a report's reason) reads from the left */
  function setupTextCells() {
    document.querySelectorAll('.jp-RenderedHTMLCommon td').forEach(function (td) {
      if (td.textContent.trim().length > 24 && td.textContent.indexOf(' ') >= 0) td.classList.add('text-cell');
    });
  }

  /* A table wider than the page scrolls sideways inside itself (site.css): a shade at its right edge says that more
     columns lie beyond it, until it is scrolled to its end */
  function setupScrollCues() {
    document.querySelectorAll('.jp-RenderedHTMLCommon table').forEach(function (table) {
      var box = document.createElement('div');
      box.className = 'table-scroll';
      table.parentNode.insertBefore(box, table); box.appendChild(table);
      function mark() { box.classList.toggle('more-right', table.scrollLeft + table.clientWidth < table.scrollWidth - 1); }
      table.addEventListener('scroll', mark, { passive: true }); window.addEventListener('resize', mark); mark();
    });
  }

  /* Below 75rem the side table of contents is hidden (site.css): its list goes, folded, under the page's title */
  function setupInlineToc() {
    var list = document.querySelector('.site-toc ul'), header = document.querySelector('.page-header');
    if (!list || !header || !list.querySelector('a')) return;
    var box = document.createElement('details'), summary = document.createElement('summary');
    box.className = 'page-toc-inline'; summary.textContent = 'On this page';
    box.appendChild(summary); box.appendChild(list.cloneNode(true));
    header.parentNode.insertBefore(box, header.nextSibling);
  }

  /* A link or a search hit into a folded section (build_docs.fold_sections) opens the folds around its target */
  function openFoldsForHash() {
    var id = decodeURIComponent(location.hash.slice(1)), el = id && document.getElementById(id), changed = false;
    for (var e = el; e; e = e.parentElement) if (e.tagName === 'DETAILS' && !e.open) { e.open = true; changed = true; }
    if (changed) el.scrollIntoView();
  }
  window.addEventListener('hashchange', openFoldsForHash);

  document.addEventListener('DOMContentLoaded', function () { setupSidebar(); setupCopyButtons(); setupSearch(); setupProseTables(); setupTextCells(); setupScrollCues(); setupInlineToc(); openFoldsForHash(); });
})();
