"""The registry site in a real browser: Debian's Chromium driven by Playwright, served on loopback.

Every page opens at 1280x800 with no console error, no failed request and no broken link (each in-site
link's page exists and its #anchor is an element there); every entry graph of every model page opens
fitted (at least 95% of its bounding box inside its box), with no output called "result N" and no two
labels overlapping as the browser lays them out; pan and zoom answer the wheel, a drag, the buttons and
the keys; a block node opens its listing; anchors land below the sticky header; listings and card names
are not cut; the Benchmarks section has a chart; SAM 2.1's page shows the 512 split; the theme switch
works. Screenshots of every page in both themes are written to ``$KESTREL_TEST_ARTIFACTS`` (default
``build/test-artifacts``).

Outside CI the test skips when Playwright or Chromium is missing; in CI (``CI`` set) it fails instead,
since ``make setup`` installs both.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from urllib.parse import urldefrag, urlparse

import pytest

from kestrel.models.cards import CARDS
from kestrel.site.serve import make_server
from sitebuild import built_site

CHROMIUM = os.environ.get("KESTREL_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("KESTREL_TEST_ARTIFACTS", Path(__file__).resolve().parents[1] / "build" /
                                "test-artifacts")) / "site"


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Python playwright is not installed (make setup installs it)"
    if not Path(CHROMIUM).exists():
        return f"Chromium is not at {CHROMIUM} (make setup installs Debian's chromium)"
    if shutil.which("dot") is None:
        return "Graphviz `dot` is not installed (make setup installs it)"
    return None


def _require_browser() -> None:
    why = _missing()
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"browser tests must run in CI: {why}")
    pytest.skip(why)


# every label's box as the browser lays it out; pairs that overlap: by more than a pixel across, and by more
# than a third of a line down (the lines of one label touch within their font boxes' ascent and descent)
OVERLAPS_JS = """(svg) => {
  const boxes = [];
  for (const t of svg.querySelectorAll('text')) {
    const b = t.getBBox();
    if (b.width > 0) boxes.push([t.textContent, b.x, b.y, b.x + b.width, b.y + b.height]);
  }
  const bad = [];
  for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
    const a = boxes[i], b = boxes[j];
    const across = Math.min(a[3], b[3]) - Math.max(a[1], b[1]);
    const down = Math.min(a[4], b[4]) - Math.max(a[2], b[2]);
    if (across > 1 && down > Math.min(a[4] - a[2], b[4] - b[2]) / 3) bad.push(a[0] + ' / ' + b[0]);
  }
  return [boxes.length, bad];
}"""


# the share of each graph's bounding box (its Graphviz <g class="graph">) inside its box on the page
FITTED_JS = """(fig) => {
  const box = fig.querySelector('.kg').getBoundingClientRect();
  const g = fig.querySelector('svg.kg-svg g.graph').getBoundingClientRect();
  const w = Math.max(0, Math.min(box.right, g.right) - Math.max(box.left, g.left));
  const h = Math.max(0, Math.min(box.bottom, g.bottom) - Math.max(box.top, g.top));
  return [fig.id, g.width * g.height > 0 ? w * h / (g.width * g.height) : 0];
}"""
RESULT_N = r"/^result( \d+)?$/"


@pytest.fixture(scope="module")
def site_url():
    _require_browser()
    server = make_server(built_site(), 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    assert host == "127.0.0.1"
    yield f"http://{host}:{port}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser(site_url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)  # a fresh, temporary profile each launch
        yield b
        b.close()


def _watch(page) -> list[str]:
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} {r.failure}"))
    page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    return problems


def test_every_page_opens_clean_with_no_broken_link(browser, site_url):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    pages = ["index.html", *(f"models/{name}.html" for name in CARDS)]
    ids: dict[str, set[str]] = {}
    links: dict[str, list[str]] = {}
    for scheme in ("light", "dark"):
        context = browser.new_context(color_scheme=scheme, viewport={"width": 1280, "height": 800})
        page = context.new_page()
        problems = _watch(page)
        for path in pages:
            page.goto(site_url + path, wait_until="load")
            assert page.evaluate("document.documentElement.dataset.theme") == scheme
            if scheme == "light":
                ids[path] = set(page.eval_on_selector_all("[id]", "els => els.map(e => e.id)"))
                links[path] = page.eval_on_selector_all("a[href]", "els => els.map(a => a.href)")
                links[path] += page.eval_on_selector_all(  # the graphs' block links (SVG <a xlink:href>)
                    "svg.kg-svg a", "els => els.filter(a => a.getAttribute('xlink:href'))"
                                   ".map(a => new URL(a.getAttribute('xlink:href'), location.href).href)")
                _check_page_reads_at_a_glance(page, path)
            page.screenshot(path=str(ARTIFACTS / f"{Path(path).stem}.{scheme}.png"))
        assert not problems, "\n".join(problems)
        context.close()

    broken = []
    for source, hrefs in links.items():
        for href in hrefs:
            url, fragment = urldefrag(href)
            parsed = urlparse(url)
            if not url.startswith(site_url):
                broken.append(f"{source}: {href} leaves the site")
                continue
            target = parsed.path.removeprefix(urlparse(site_url).path) or "index.html"
            if target in ids:
                if fragment and fragment not in ids[target]:
                    broken.append(f"{source}: {href} (no #{fragment} there)")
            elif not (built_site() / target).is_file():
                broken.append(f"{source}: {href} (no such file)")
    assert not broken, "\n".join(broken)


def _check_page_reads_at_a_glance(page, path: str) -> None:
    """What a person sees at 1280x800 without doing anything: graphs whole, names whole, nothing cut."""
    # listings wrap rather than hide their ends in a scroller
    cut = page.eval_on_selector_all("pre", "els => els.filter(e => e.scrollWidth > e.clientWidth + 1)"
                                           ".map(e => e.textContent.slice(0, 60))")
    assert not cut, f"{path}: listings cut: {cut[:3]}"
    if path == "index.html":  # card names and checkpoints on one line each
        wrapped = page.eval_on_selector_all("table.models td:first-child a, table.models td:nth-child(3) code",
                                            "els => els.filter(a => a.getClientRects().length > 1 || "
                                            "a.getBoundingClientRect().height > 30).map(a => a.textContent)")
        assert not wrapped, f"card names wrap: {wrapped}"
        return
    figures = page.eval_on_selector_all("figure.graph", f"figs => figs.map({FITTED_JS})")
    assert figures, f"{path}: no graphs"
    for fig_id, share in figures:
        assert share >= 0.95, f"{path} #{fig_id}: only {share:.0%} of the graph is visible on load"
    overlaps = page.eval_on_selector_all("figure.graph svg.kg-svg", f"svgs => svgs.map({OVERLAPS_JS})")
    for i, (count, bad) in enumerate(overlaps):
        assert count > 0 and not bad, f"{path} graph {i}: overlapping labels {bad[:5]}"
    outputs = page.eval_on_selector_all("svg.kg-svg g.node.k-io text", "els => els.map(t => t.textContent)")
    assert not [o for o in outputs if o.startswith("result")], f"{path}: outputs named result N: {outputs}"
    bench = page.locator("#benchmarks")  # every family has committed bench/results rows: a chart, a table
    assert bench.locator("svg.bench-chart").count() >= 1 and "Peak MB" in bench.inner_text(), path
    assert "No benchmark results" not in bench.inner_text() and "threads" in bench.inner_text()


def test_search_finds_a_block_and_its_link_lands_on_it(browser, site_url):
    page = browser.new_page()
    problems = _watch(page)
    page.goto(site_url + "index.html")
    page.fill("#q", "MaskAttention")
    hits = page.locator("#results li", has_text="sam::MaskAttention")
    assert hits.count() >= 1  # one per SAM card
    hits.filter(has_text="in sam-vit-base").locator("a.hit").click()
    page.wait_for_load_state("load")
    assert page.url.endswith("models/sam-vit-base.html#b-sam--MaskAttention")
    block = page.locator("#b-sam--MaskAttention pre")
    assert block.is_visible() and block.inner_text().startswith("sam::MaskAttention<Hd: Dim, Internal: Dim")
    assert _below_header(page, "#b-sam--MaskAttention h3")
    page.goto(site_url + "index.html?q=zzzz-nothing")
    assert "Nothing matches" in page.locator("#results").inner_text()
    assert not problems, "\n".join(problems)
    page.close()


def test_graphs_render_with_typed_edges_and_no_overlapping_labels(browser, site_url):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems = _watch(page)
    page.goto(site_url + "models/sam-vit-base.html")
    graphs = page.locator("figure.graph svg.kg-svg")
    card = CARDS["sam-vit-base"]
    assert graphs.count() == len(card.family.root(card.config).decl().entries)
    for i in range(graphs.count()):
        svg = graphs.nth(i)
        svg.scroll_into_view_if_needed()
        box = svg.bounding_box()
        assert box and box["width"] > 200 and box["height"] > 200
        edges, labelled = svg.evaluate("s => [s.querySelectorAll('g.edge').length, "
                                       "[...s.querySelectorAll('g.edge')].filter(e => "
                                       "(e.querySelector('text') || {}).textContent?.startsWith('Tensor[')).length]")
        assert edges > 0 and labelled == edges
        count, bad = svg.evaluate(OVERLAPS_JS)
        assert count > edges and not bad, bad[:5]
    # decode_points, the graph the issue asked to be readable: grouped, and small enough to take in
    dp = page.locator("#graph-decode_points svg.kg-svg")
    assert dp.locator("g.node").count() < 70
    captions = dp.locator("g.cluster text").all_text_contents()
    assert any(c.endswith("(helper)") for c in captions) and any(c.startswith("mask_decoder:") for c in captions)
    assert dp.locator("g.cluster.k-helper").count() >= 1 and dp.locator("g.node.k-helper").count() >= 1
    # the theme switch repaints the page and its graphs
    before = page.evaluate("getComputedStyle(document.body).backgroundColor")
    page.click("#theme-toggle")
    assert page.evaluate("document.documentElement.dataset.theme") == "dark"
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") != before
    node_fill = dp.locator("g.node.k-op path").first.evaluate("p => getComputedStyle(p).fill")
    assert node_fill == "rgb(30, 36, 48)"  # the dark theme's op colour, not the light SVG's white
    assert not problems, "\n".join(problems)
    # the whole graph at once, 2400 px wide
    page.set_viewport_size({"width": 2400, "height": 1800})
    page.set_content(f'<body style="margin:0"><img id="g" style="width:2400px" '
                     f'src="{site_url}graphs/sam-vit-base.decode_points.svg"></body>', wait_until="load")
    page.locator("#g").screenshot(path=str(ARTIFACTS / "sam-vit-base.decode_points.graph.png"))
    page.close()


def _below_header(page, selector: str) -> bool:
    """The element's top is in view, below the sticky header (not hidden under it)."""
    header, top = page.evaluate(f"""() => [document.querySelector('header.top').getBoundingClientRect().bottom,
                                          document.querySelector({selector!r}).getBoundingClientRect().top]""")
    return header <= top < page.viewport_size["height"] * 0.5


def test_anchors_land_below_the_header(browser, site_url):
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    for url, selector in (("models/sam-vit-base.html#graph-decode_points", "#graph-decode_points .graph-tools"),
                          ("models/sam-vit-base.html#b-sam--MaskAttention", "#b-sam--MaskAttention h3"),
                          ("models/siglip-base-patch16-224.html#graph-similarity", "#graph-similarity .graph-tools"),
                          ("models/sam2.1-hiera-tiny.html#edge-split", "#edge-split h2")):
        page.goto(site_url + url, wait_until="load")
        assert _below_header(page, selector), url
    # an index link to an entry graph, followed
    page.goto(site_url + "index.html")
    page.locator("table.models a", has_text="decode_points").first.click()
    page.wait_for_load_state("load")
    assert page.url.endswith("#graph-decode_points") and _below_header(page, "#graph-decode_points .graph-tools")
    page.close()


def test_graphs_pan_and_zoom_and_open_block_listings(browser, site_url):
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    problems = _watch(page)
    page.goto(site_url + "models/sam-vit-base.html#graph-decode_points")
    fig = page.locator("#graph-decode_points")
    box = fig.locator(".kg")
    zoom = "f => [f.panZoom.getZoom(), f.panZoom.getPan().x, f.panZoom.getPan().y]"
    fitted = fig.evaluate(zoom)
    fig.locator("[data-zoom=in]").click()
    assert fig.evaluate(zoom)[0] > fitted[0] * 1.1
    fig.locator("[data-zoom=fit]").click()
    assert abs(fig.evaluate(zoom)[0] - fitted[0]) < 1e-6 and fig.evaluate(FITTED_JS)[1] >= 0.95
    # the wheel over the graph zooms in, a drag pans
    b = box.bounding_box()
    page.mouse.move(b["x"] + b["width"] / 2, b["y"] + b["height"] / 2)
    page.mouse.wheel(0, -300)
    page.wait_for_timeout(100)
    wheeled = fig.evaluate(zoom)
    assert wheeled[0] > fitted[0] * 1.1
    page.mouse.down()
    page.mouse.move(b["x"] + b["width"] / 2 + 120, b["y"] + b["height"] / 2 + 40, steps=5)
    page.mouse.up()
    dragged = fig.evaluate(zoom)
    assert abs(dragged[1] - wheeled[1] - 120) < 2 and abs(dragged[2] - wheeled[2] - 40) < 2
    # keys once the box has focus: - zooms out, 0 fits, arrows move
    box.focus()
    page.keyboard.press("0")
    assert abs(fig.evaluate(zoom)[0] - fitted[0]) < 1e-6
    page.keyboard.press("+")
    page.keyboard.press("+")
    bigger = fig.evaluate(zoom)
    page.keyboard.press("-")
    assert fitted[0] < fig.evaluate(zoom)[0] < bigger[0]
    page.keyboard.press("ArrowLeft")
    assert fig.evaluate(zoom)[1] > bigger[1]
    page.keyboard.press("1")  # actual size: one SVG unit to one pixel
    assert abs(fig.evaluate("f => f.panZoom.getSizes().realZoom") - 1) < 1e-3
    page.keyboard.press("0")
    # a block node opens that block's listing, below the header
    node = fig.locator("svg a", has=page.locator("text", has_text="transformer")).first
    node.click()
    page.wait_for_function("location.hash.startsWith('#b-')")
    target = page.evaluate("location.hash")
    assert target == "#b-sam--TwoWayTransformer" and _below_header(page, target + " h3")
    # every collapsible block to one node, fitted whole again, and back
    expanded = fig.locator("svg.kg-svg g.node").count()
    fig.locator("button.level").click()
    assert fig.locator("button.level").inner_text() == "Expand blocks"
    _shown(page, "graph-decode_points", 3)  # _points and _decode (mask_decoder is drawn inside _decode)
    collapsed = fig.locator("svg.kg-svg g.node").count()
    assert 0 < collapsed < expanded / 2 and fig.evaluate(FITTED_JS)[1] >= 0.95
    assert fig.locator('svg.kg-svg g.cluster[id*="-kb"]').count() == 0  # no collapsible group left open
    fig.locator("button.level").click()
    _shown(page, "graph-decode_points", 0)
    assert fig.locator("svg.kg-svg g.node").count() == expanded and fig.evaluate(FITTED_JS)[1] >= 0.95
    # collapsed, encode_image is one call of the vision encoder, which links to its listing
    preview = page.locator("#preview")
    preview.locator("button.level").click()
    _shown(page, "preview", 1)
    encoder = preview.locator("svg.kg-svg a", has=page.locator("text", has_text="vision_encoder")).first
    assert encoder.get_attribute("xlink:href") == "#b-sam--VisionEncoder"
    encoder.click()
    page.wait_for_function("location.hash === '#b-sam--VisionEncoder'")
    assert _below_header(page, "#b-sam--VisionEncoder h3")
    assert not problems, "\n".join(problems)
    page.close()


def _shown(page, figure: str, mask: int) -> None:
    """Wait until the figure shows the graph laid out for ``mask`` (fetched, swapped in and fitted)."""
    page.wait_for_function(f"document.getElementById({figure!r}).dataset.shown === '{mask}'", timeout=10_000)


def test_blocks_collapse_one_by_one_stay_fitted_and_open_their_listings(browser, site_url):
    """Each sub-block collapses alone (its caption's [-], or the toolbar) and opens again (its node's [+]);
    every state is fitted whole; a group's caption and a collapsed block's node open its listing."""
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    problems = _watch(page)
    page.goto(site_url + "models/sam-vit-base.html#graph-decode_points")
    fig = page.locator("#graph-decode_points")
    switches = fig.locator(".graph-blocks button")
    assert switches.all_inner_texts() == ["_points()", "_decode()", "mask_decoder"]
    nodes = fig.locator("svg.kg-svg g.node")
    expanded = nodes.count()
    pressed = "f => [...f.querySelectorAll('.graph-blocks button')].map(b => b.getAttribute('aria-pressed'))"

    # mask_decoder alone, by the [-] on its group's caption: one node with [+], the rest still open
    caption = fig.locator('g.cluster[id$="-kb2"]')
    assert caption.locator("text.kg-toggle").text_content() == "[-]"
    caption.locator("text.kg-toggle").click()
    _shown(page, "graph-decode_points", 4)
    assert fig.evaluate(pressed) == ["false", "false", "true"]
    node = fig.locator('g.node[id$="-kb2"]')
    assert node.locator("text.kg-toggle").text_content() == "[+]" and "mask_decoder" in node.text_content()
    assert nodes.count() < expanded - 20 and fig.locator('g.cluster[id$="-kb1"]').count() == 1
    share = fig.evaluate(FITTED_JS)[1]
    assert share >= 0.95, f"collapsing mask_decoder left {share:.0%} of the graph in view"
    count, bad = fig.locator("svg.kg-svg").evaluate(OVERLAPS_JS)  # the [+] beside a bold name included
    assert count > 0 and not bad, bad[:5]
    # then _points too, from the toolbar; then mask_decoder open again by its node's [+]
    switches.nth(0).click()
    _shown(page, "graph-decode_points", 5)
    assert fig.evaluate(FITTED_JS)[1] >= 0.95 and fig.evaluate(pressed) == ["true", "false", "true"]
    assert not fig.locator("svg.kg-svg").evaluate(OVERLAPS_JS)[1]
    fig.locator('g.node[id$="-kb2"] text.kg-toggle').click()
    _shown(page, "graph-decode_points", 1)
    assert fig.evaluate(FITTED_JS)[1] >= 0.95 and fig.locator('g.cluster[id$="-kb2"]').count() == 1
    assert page.evaluate("location.hash") == "#graph-decode_points"  # a switch follows no link
    page.screenshot(path=str(ARTIFACTS / "sam-vit-base.decode_points.collapsed-points.png"))
    switches.nth(0).click()
    _shown(page, "graph-decode_points", 0)
    assert nodes.count() == expanded

    # a group's caption opens the block's listing, below the header
    fig.locator('g.cluster[id$="-kb2"] a').click()
    page.wait_for_function("location.hash === '#b-sam--MaskDecoder'")
    assert _below_header(page, "#b-sam--MaskDecoder h3")
    # so does a collapsed block's node (its name, not its [+])
    page.goto(site_url + "models/sam-vit-base.html#graph-decode_points")
    fig.locator('g.cluster[id$="-kb2"] text.kg-toggle').click()
    _shown(page, "graph-decode_points", 4)
    fig.locator('g.node[id$="-kb2"] text', has_text="MaskDecoder<").click()
    page.wait_for_function("location.hash === '#b-sam--MaskDecoder'")
    assert _below_header(page, "#b-sam--MaskDecoder h3")

    # every switch of every graph on the page: collapsed alone, the graph is fitted whole and then opens again
    page.goto(site_url + "models/sam-vit-base.html")
    figures = page.locator("figure.graph[data-graphs]")
    for f in range(figures.count()):
        figure = figures.nth(f)
        name = figure.get_attribute("id")
        for i in range(figure.locator(".graph-blocks button").count()):
            figure.scroll_into_view_if_needed()
            figure.locator(".graph-blocks button").nth(i).click()
            _shown(page, name, 1 << i)
            share = figure.evaluate(FITTED_JS)[1]
            assert share >= 0.95, f"#{name}, block {i} collapsed: {share:.0%} of the graph in view"
            figure.locator(".graph-blocks button").nth(i).click()
            _shown(page, name, 0)
    assert not problems, "\n".join(problems)
    page.close()


def test_sam2_page_shows_the_512_split(browser, site_url):
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(site_url + "models/sam2.1-hiera-tiny.html")
    section = page.locator("#edge-split")
    text = section.inner_text()
    programs = section.locator("table.edge-programs tbody tr").all_inner_texts()
    assert programs[0].startswith("sam2_encoder") and "pixels [1, 3, 512, 512]" in programs[0]
    assert "image_embeddings [1, 256, 32, 32]" in programs[0] and "hr0 [1, 256, 128, 128]" in programs[0]
    assert programs[1].startswith("sam2_decoder") and "sparse [1, 1, 3, 256]" in programs[1]
    assert "masks [1, 3, 128, 128]" in programs[1] and "iou_scores [1, 1, 3]" in programs[1]
    tables = section.locator("table.edge-tables tbody tr").all_inner_texts()
    assert len(tables) == 8 and any(t.startswith("prompt_img_pos.bin") and "[1, 256, 32, 32]" in t for t in tables)
    for words in ("sha256", "validation.json", "kestrel export sam2.1-hiera-tiny --target onnx --size 512",
                  "kestrel serve --export edge/", "instead of 1024x1024", "kestrel site --edge edge/"):
        assert words in text, words
    page.close()
