// Kestrel registry: the theme switch, graph zoom, and the search over models, entries and blocks.
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

  document.querySelectorAll('figure.graph button.zoom').forEach(function (button) {
    button.addEventListener('click', function () {
      var box = button.closest('figure').querySelector('.kg');
      var actual = box.classList.toggle('actual');
      button.textContent = actual ? 'Fit to page' : 'Actual size';
    });
  });

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
