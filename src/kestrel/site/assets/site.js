// Kestrel registry: the theme switch, graph pan and zoom, and the search over models, entries and blocks.
(function () {
  'use strict';
  var root = document.documentElement;
  var toggle = document.getElementById('theme-toggle');
  function label() {
    toggle.textContent = root.getAttribute('data-theme') === 'dark' ? 'Light theme' : 'Dark theme';
  }
  if (toggle) {
    label();
    toggle.addEventListener('click', function () {
      var next = root.getAttribute('data-theme') === 'dark' ? 'light' : 'dark';
      root.setAttribute('data-theme', next);
      try { localStorage.setItem('kestrel-theme', next); } catch (e) { /* private mode: session only */ }
      label();
    });
  }

  // Graphs: each opens fitted whole in its box (the SVG's viewBox does that without any script); with
  // svg-pan-zoom (npm, copied in at build time) it pans by dragging and zooms by the wheel, the buttons
  // and the keys + - 0 1 and the arrows once the box has focus.
  function setUpGraph(figure) {
    var box = figure.querySelector('.kg');
    var svg = box && box.querySelector('svg.kg-svg');
    if (!svg) { return; }
    if (typeof window.svgPanZoom !== 'function') {
      figure.querySelectorAll('[data-zoom], button.level, .graph-blocks button').forEach(function (b) { b.disabled = true; });
      return;
    }
    var pz = null;
    function attach(element) {
      if (pz) { pz.destroy(); }
      svg = element;
      pz = window.svgPanZoom(svg, {
        zoomEnabled: true, panEnabled: true, controlIconsEnabled: false, fit: true, center: true,
        minZoom: 0.25, maxZoom: 60, zoomScaleSensitivity: 0.25, dblClickZoomEnabled: true,
        mouseWheelZoomEnabled: false, preventMouseEventsDefault: false,
      });
      figure.panZoom = pz;  // read by the browser tests
    }
    attach(svg);
    function fit() { pz.resize(); pz.fit(); pz.center(); }
    var actions = {
      in: function () { pz.zoomIn(); }, out: function () { pz.zoomOut(); }, fit: fit,
      actual: function () { pz.zoom(pz.getZoom() / pz.getSizes().realZoom); pz.center(); },  // 1 SVG unit = 1 px
    };
    figure.querySelectorAll('[data-zoom]').forEach(function (button) {
      button.addEventListener('click', function () { actions[button.getAttribute('data-zoom')](); box.focus(); });
    });
    // the wheel zooms about the pointer, by the wheel's distance (lines or pixels)
    box.addEventListener('wheel', function (e) {
      e.preventDefault();
      var pixels = e.deltaY * (e.deltaMode === 1 ? 16 : e.deltaMode === 2 ? 400 : 1);
      var rect = svg.getBoundingClientRect();
      pz.zoomAtPointBy(Math.exp(-pixels * 0.0015), { x: e.clientX - rect.left, y: e.clientY - rect.top });
    }, { passive: false });
    box.addEventListener('keydown', function (e) {
      var step = 60;
      var keys = { '+': actions.in, '=': actions.in, '-': actions.out, '_': actions.out, '0': fit, '1': actions.actual,
        ArrowLeft: function () { pz.panBy({ x: step, y: 0 }); }, ArrowRight: function () { pz.panBy({ x: -step, y: 0 }); },
        ArrowUp: function () { pz.panBy({ x: 0, y: step }); }, ArrowDown: function () { pz.panBy({ x: 0, y: -step }); } };
      var act = keys[e.key];
      if (act && !e.ctrlKey && !e.metaKey && !e.altKey) { e.preventDefault(); act(); }
    });
    // a link inside the graph (a block's listing) is followed on a click, not at the end of a drag
    var down = null;
    box.addEventListener('mousedown', function (e) { down = [e.clientX, e.clientY]; });
    box.addEventListener('click', function (e) {
      if (down && Math.hypot(e.clientX - down[0], e.clientY - down[1]) > 4) { e.preventDefault(); }
    }, true);
    window.addEventListener('resize', fit);

    // Blocks collapse one by one: state is a bit per collapsible group (the toolbar's switches, [-] on a
    // group's caption, [+] on its collapsed node). Every combination was laid out at build time as
    // graphs/<card>.<entry>.m<mask>.svg, with no group collapsed inside a collapsed one (it looks the same).
    var prefix = figure.getAttribute('data-graphs');
    if (!prefix) { return; }
    var parents = figure.getAttribute('data-parents').split(' ').map(Number);
    var all = (1 << parents.length) - 1;
    var mask = 0;
    var shown = 0;  // the laid-out combination on screen
    var graphs = { 0: svg };
    var level = figure.querySelector('button.level');
    var switches = figure.querySelectorAll('.graph-blocks button[data-unit]');
    var asked = 0;  // the latest request wins when fetches come back out of order
    function drawn(m) {  // the combination that looks like m: bits under a set bit cleared
      var out = m;
      parents.forEach(function (p, i) {
        for (var q = p; q >= 0; q = parents[q]) { if (m >> q & 1) { out &= ~(1 << i); break; } }
      });
      return out;
    }
    function graph(m) {
      if (graphs[m]) { return Promise.resolve(graphs[m]); }
      return fetch(prefix + '.m' + m + '.svg').then(function (r) {
        if (!r.ok) { throw new Error('HTTP ' + r.status); }
        return r.text();
      }).then(function (text) {
        var doc = new DOMParser().parseFromString(text, 'image/svg+xml');
        var next = document.importNode(doc.documentElement, true);
        next.querySelectorAll('[id]').forEach(function (el) { el.id = figure.id + '-' + el.id; });
        next.querySelectorAll('a').forEach(function (a) {  // the file links to the model page; here, to this page
          var href = a.getAttribute('xlink:href');
          if (href && href.indexOf('#') >= 0) { a.setAttribute('xlink:href', href.slice(href.indexOf('#'))); }
        });
        next.setAttribute('width', '100%');
        next.setAttribute('height', '100%');
        next.setAttribute('class', 'kg-svg');
        next.setAttribute('role', 'img');
        graphs[m] = next;
        return next;
      });
    }
    function mark(element) {  // the [-] and [+] texts Graphviz drew become switches
      parents.forEach(function (p, i) {
        var group = element.querySelector('[id="' + figure.id + '-kb' + i + '"]');
        if (!group) { return; }
        group.querySelectorAll('text').forEach(function (t) {
          if (t.textContent === '[-]' || t.textContent === '[+]') {
            t.classList.add('kg-toggle');
            t.setAttribute('data-unit', String(i));
          }
        });
      });
    }
    mark(svg);
    figure.setAttribute('data-shown', '0');
    function set(m) {
      mask = m;
      switches.forEach(function (b) {
        b.setAttribute('aria-pressed', String((mask >> Number(b.getAttribute('data-unit')) & 1) === 1));
      });
      if (level) { level.textContent = mask === all ? 'Expand blocks' : 'Collapse blocks'; }
      figure.classList.toggle('collapsed', mask !== 0);
      var want = drawn(mask);
      var ticket = ++asked;
      if (want === shown) { return Promise.resolve(); }
      figure.setAttribute('aria-busy', 'true');
      return graph(want).then(function (next) {
        if (ticket !== asked) { return; }
        var current = svg;
        pz.destroy();
        pz = null;
        current.replaceWith(next);
        mark(next);
        attach(next);
        shown = want;
        figure.setAttribute('data-shown', String(shown));  // what the tests wait for
      }).catch(function (err) {
        if (level) { level.textContent = 'Collapse blocks (unavailable: ' + err.message + ')'; }
      }).finally(function () { if (ticket === asked) { figure.removeAttribute('aria-busy'); } });
    }
    switches.forEach(function (b) {
      b.addEventListener('click', function () { set(mask ^ (1 << Number(b.getAttribute('data-unit')))); });
    });
    if (level) { level.addEventListener('click', function () { set(mask === all ? 0 : all); }); }
    // a click on [-] or [+] in the graph (not the end of a drag) switches that group, and follows no link
    box.addEventListener('click', function (e) {
      var t = e.target.closest ? e.target.closest('.kg-toggle') : null;
      if (!t) { return; }
      e.preventDefault();
      e.stopPropagation();
      if (down && Math.hypot(e.clientX - down[0], e.clientY - down[1]) > 4) { return; }
      set(mask ^ (1 << Number(t.getAttribute('data-unit'))));
    });
  }
  document.querySelectorAll('figure.graph').forEach(setUpGraph);

  var data = document.getElementById('search-index');
  var input = document.getElementById('q');
  var list = document.getElementById('results');
  if (!data || !input || !list) { return; }
  var items = JSON.parse(data.textContent);

  function score(item, words) {
    var name = item.name.toLowerCase();
    var text = (item.name + ' ' + item.text + ' ' + (item.model || '')).toLowerCase();
    var s = 0;
    for (var i = 0; i < words.length; i++) {
      var w = words[i];
      if (text.indexOf(w) < 0) { return 0; }
      var short = name.split('::').pop();
      s += short === w ? 8 : short.indexOf(w) === 0 ? 4 : name.indexOf(w) >= 0 ? 2 : 1;
    }
    return s + (item.kind === 'model' ? 1 : 0);
  }

  function show() {
    var words = input.value.trim().toLowerCase().split(/\s+/).filter(Boolean);
    list.textContent = '';
    if (!words.length) { return; }
    var hits = items.map(function (it) { return [score(it, words), it]; })
      .filter(function (p) { return p[0] > 0; })
      .sort(function (a, b) { return b[0] - a[0] || a[1].name.localeCompare(b[1].name); })
      .slice(0, 40);
    if (!hits.length) {
      var none = document.createElement('li');
      none.textContent = 'Nothing matches "' + input.value + '".';
      list.appendChild(none);
      return;
    }
    hits.forEach(function (p) {
      var it = p[1];
      var li = document.createElement('li');
      var kind = document.createElement('span');
      kind.className = 'kind';
      kind.textContent = it.kind;
      var a = document.createElement('a');
      a.href = it.url;
      a.className = 'hit';
      a.textContent = it.name;
      li.appendChild(kind);
      li.appendChild(a);
      if (it.model) {
        var where = document.createElement('span');
        where.className = 'in';
        where.textContent = ' in ' + it.model;
        li.appendChild(where);
      }
      list.appendChild(li);
    });
  }
  input.addEventListener('input', show);
  var initial = new URLSearchParams(window.location.search).get('q');
  if (initial) { input.value = initial; }
  show();
})();
