"""The registry site: pages built from the declarations hold the seeds' tables and blocks, in order.

The site is built here from the code (never from stored text); each seed page in ../shared/seeds is
then found in the built page: its entries table, its generics table and every block, in the seed's order.
"""

from __future__ import annotations

import json
import shutil

import pytest

from kestrel.cli.main import main
from kestrel.models.cards import CARDS
from kestrel.site.build import SiteError, block_anchor, build_site
from seeds import SEED_CARDS, SEEDS, read_seed
from sitebuild import built_site, read_page
from svgcheck import edge_label_boxes, label_clashes, overlapping, text_boxes

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed (make setup)")


def _in_order(wanted: list, found: list, same) -> list:
    """The wanted items missing from ``found`` when each must come after the previous one's match."""
    it = iter(found)
    return [w for w in wanted if not any(same(w, f) for f in it)]


def _lines_in_order(seed_text: str, ours: str) -> bool:
    it = iter(ours.splitlines())
    return all(any(line == mine for mine in it) for line in seed_text.splitlines())


@needs_dot
@pytest.mark.parametrize("prefix", sorted(SEED_CARDS))
def test_model_page_holds_the_seed_tables_and_blocks_in_order(prefix: str) -> None:
    try:
        seed = read_seed(prefix)  # skips (or, where CI requires the seeds, fails) when they are absent
    except StopIteration:
        pytest.skip(f"the seed pages are not at {SEEDS}")
    page = read_page(built_site() / "models" / f"{SEED_CARDS[prefix]}.html")
    kinds = [k if k != "table" else f"table.{v[0]}" for k, v in page.items]
    # the seeds' order of sections: preview graph, entries, generics, blocks
    assert kinds.index("figure") < kinds.index("table.entries") < kinds.index("table.generics") < kinds.index("block")
    tables = {v[0]: v[1] for k, v in page.items if k == "table"}
    entry_rows = tables["entries"][1:]
    missing = _in_order(list(seed.entries.items()), entry_rows, lambda w, row: row[0] == w[0] and row[1] == w[1])
    assert not missing, f"seed entries not in the page's entries table, in order: {missing}"
    generic_rows = [(row[0], row[-1]) for row in tables["generics"][1:]]
    assert generic_rows == list(seed.generics.items())
    blocks = [v for k, v in page.items if k == "block"]
    missing = _in_order(list(seed.blocks.values()), blocks, lambda w, b: w == b or _lines_in_order(w, b))
    assert not missing, "seed blocks not in the page, in order:\n" + "\n\n".join(missing)


@needs_dot
def test_every_registered_model_has_a_page_with_graphs_and_linked_blocks() -> None:
    site = built_site()
    index = (site / "index.html").read_text()
    for name, card in CARDS.items():
        page = site / "models" / f"{name}.html"
        assert f'href="models/{name}.html"' in index
        text = page.read_text()
        root = card.family.root(card.config).decl()
        for fn in root.entries:
            assert (site / "graphs" / f"{name}.{fn.name}.svg").read_text().lstrip().startswith("<?xml")
            assert f'id="graph-{fn.name}"' in text
        assert f'id="{block_anchor(root.qualname)}"' in text
        assert card.revision in text and card.repo in text
        assert 'id="parameters"' in text and "<details>" in text
    sam = (site / "models" / "sam-vit-base.html").read_text()
    # a sub's block type links to that block's anchor
    assert f'sub mask_decoder: <a href="#{block_anchor("sam::MaskDecoder")}">MaskDecoder</a>&lt;Hd' in sam
    # tasks are the CLI commands that run the program's entries
    assert "<code>kestrel classify</code>" in (site / "models" / "vit-base-patch16-224.html").read_text()
    siglip = (site / "models" / "siglip-base-patch16-224.html").read_text()
    assert "<code>kestrel zero-shot</code>" in siglip and "<code>kestrel classify</code>" not in siglip
    search = json.loads((site / "search.json").read_text())
    assert {"kind": "block", "name": "sam::MaskAttention"}.items() <= next(
        s for s in search if s["name"] == "sam::MaskAttention").items()


@needs_dot
def test_bench_results_become_charts(tmp_path) -> None:
    results = {"cases": [{"case": "vit@224", "model": "vit", "image": 224, "gflop_per_item": 35.1, "rows": [
        {"variant": "kestrel", "batch": 1, "median": 0.05}, {"variant": "hf", "batch": 1, "median": 0.06},
        {"variant": "kestrel", "batch": 8, "median": 0.30}, {"variant": "hf", "batch": 8, "median": 0.40},
        {"variant": "onnx", "batch": 8, "error": "export failed"}]}]}
    bench = tmp_path / "results.json"
    bench.write_text(json.dumps(results))
    out = tmp_path / "site"
    assert main(["site", "--out", str(out), "--models", "vit-base-patch16-224", "--bench", str(bench)]) == 0
    page = (out / "models" / "vit-base-patch16-224.html").read_text()
    assert 'class="bench-chart"' in page and "0.83x transformers" in page and "0.75x transformers" in page
    assert page.count('class="bc-bar bc-kestrel"') == 2


def test_bad_requests_are_clear_errors(tmp_path) -> None:
    with pytest.raises(SiteError, match="unknown model nope"):
        build_site(tmp_path / "s", models=["nope"])
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep me")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["site", "--out", str(tmp_path / "x"), "--bench", str(bad)]) == 2
    if shutil.which("dot"):
        assert main(["site", "--out", str(tmp_path / "notes"), "--models", "vit-base-patch16-224"]) == 2
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep me"  # never replaces a folder it did not build


def test_benchmarks_come_from_the_committed_results_with_where_and_when() -> None:
    from kestrel.site.build import BENCH_RESULTS, read_bench
    from kestrel.site.charts import bench_charts

    runs = read_bench(None)  # the checkout's bench/results/*.json
    assert runs and BENCH_RESULTS.is_dir()
    families = {c.family.name for c in CARDS.values()}
    for family in families:  # every registered family has measured rows
        html = bench_charts(runs, family)
        assert "bench-chart" in html and "threads" in html and "measured 20" in html, family
    vit = bench_charts(runs, "vit")
    assert "transformers eager" in vit and "onnxruntime" in vit and "Peak MB" in vit
    assert bench_charts(runs, "no-such-family") == ""
    raced = {"cases": [{"model": "vit", "case": "vit@224", "rows": [
        {"variant": "kestrel", "batch": 1, "median": 0.2, "backend": "onnxruntime"},
        {"variant": "kestrel", "batch": 8, "median": 1.5, "backend": "eager"}]}]}
    html = bench_charts(raced, "vit")
    assert html.count("Kestrel (onnxruntime, raced)") == 2 and html.count("Kestrel eager") == 2  # bar + table row


@needs_dot
def test_edge_labels_never_overlap_in_any_built_graph() -> None:
    """Every graph the site ships (each entry of each model, in every collapsed combination): no two edge
    labels intersect, no edge label lies on a node's outline, and no two texts overlap at all."""
    graphs = sorted((built_site() / "graphs").glob("*.svg"))
    for name, card in CARDS.items():  # every entry of every model is among them
        for fn in card.family.root(card.config).decl().entries:
            assert (built_site() / "graphs" / f"{name}.{fn.name}.svg") in graphs
    labels = 0
    bad = {}
    for path in graphs:
        svg = path.read_text()
        labels += len(edge_label_boxes(svg))
        clash = label_clashes(svg) + [f"{a.text!r} / {b.text!r}" for a, b in overlapping(text_boxes(svg))]
        if clash:
            bad[path.name] = clash[:3]
    print(f"{len(graphs)} graphs, {labels} edge labels, {len(bad)} with clashes")
    assert labels > 10 * len(graphs) and not bad, bad


def _fake_export(folder, card) -> dict:
    """A SAM 2.1 edge export's file set, its manifest's hashes true, its programs stand-ins."""
    import hashlib

    from kestrel.export.validation import summarize

    folder.mkdir()
    files = {"sam2_encoder.onnx": b"encoder program", "sam2_decoder.onnx": b"decoder program",
             "prompt_dense.bin": bytes(16)}
    for n, data in files.items():
        (folder / n).write_bytes(data)
    manifest = {"model": f"{card.name} (512 encoder/decoder split)",
                "upstream": {"model": card.repo, "revision": card.revision},
                "files": {n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()}}
    cases = [{"program": "sam2_decoder.onnx", "runtime": "onnxruntime", "sample": "prompt: one point",
              "reference": "kestrel eager", "outputs": {"masks": {"relative": 3.2e-6, "mask_iou": 0.9987}}}]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "validation.json").write_text(json.dumps({"cases": cases, "summary": summarize(cases)}))
    return manifest


@needs_dot
def test_sam2_page_links_an_edge_export_copied_into_the_site(tmp_path) -> None:
    card = CARDS["sam2.1-hiera-tiny"]
    manifest = _fake_export(tmp_path / "edge", card)
    out = tmp_path / "site"
    assert main(["site", "--out", str(out), "--models", card.name, "--edge", str(tmp_path / "edge")]) == 0
    page = (out / "models" / f"{card.name}.html").read_text()
    for name, row in manifest["files"].items():  # each file linked, copied byte for byte, its hash shown
        assert f'href="../edge/{card.name}/{name}"' in page and row["sha256"] in page
        assert (out / "edge" / card.name / name).read_bytes() == (tmp_path / "edge" / name).read_bytes()
    for name in ("manifest.json", "validation.json"):
        assert f'href="../edge/{card.name}/{name}"' in page and (out / "edge" / card.name / name).is_file()
    assert "Validation passed</strong>: 1 case," in page and "3.20e-06" in page and "0.9987" in page
    assert f"kestrel serve --export site/edge/{card.name}/" in page and "built without an export" not in page
    # a file that is not what the manifest hashed, or an export of a card not in the build: clear errors
    (tmp_path / "edge" / "sam2_decoder.onnx").write_bytes(b"changed")
    assert main(["site", "--out", str(tmp_path / "s2"), "--models", card.name, "--edge", str(tmp_path / "edge")]) == 2
    with pytest.raises(SiteError, match="sha256 is not the manifest's"):
        build_site(tmp_path / "s3", models=[card.name], edge=tmp_path / "edge")
    _fake_export(tmp_path / "other", card)
    with pytest.raises(SiteError, match=r"which no SAM 2\.1 card of this build is"):
        build_site(tmp_path / "s4", models=["vit-base-patch16-224"], edge=tmp_path / "other")
    with pytest.raises(SiteError, match=r"no manifest\.json"):
        build_site(tmp_path / "s5", models=[card.name], edge=tmp_path)


@needs_dot
def test_sam2_page_without_an_export_says_how_to_make_one() -> None:
    page = (built_site() / "models" / "sam2.1-hiera-tiny.html").read_text()
    section = page[page.index('<section id="edge-split">'):]
    assert "built without an export" in section and "kestrel site --edge edge/" in section
    assert "kestrel export sam2.1-hiera-tiny --target onnx --size 512 --out edge/" in section
    assert "kestrel serve --export edge/" in section and "validation.json" in section


def test_the_label_measure_finds_labels_on_labels_and_on_nodes() -> None:
    svg = """<svg xmlns="http://www.w3.org/2000/svg"><g class="graph">
<g class="node"><title>a</title><polygon points="0,0 100,0 100,-30 0,-30 0,0"/>
<text text-anchor="middle" x="50" y="-10" font-size="10">a</text></g>
<g class="edge"><title>a-&gt;b</title><text text-anchor="middle" x="50" y="-50" font-size="9">Tensor[B, N; T]</text></g>
<g class="edge"><title>a-&gt;c</title><text text-anchor="middle" x="60" y="-48" font-size="9">Tensor[B, M; T]</text></g>
<g class="edge"><title>c-&gt;d</title><text text-anchor="start" x="90" y="-12" font-size="9">Tensor[D]</text></g>
<g class="edge"><title>c-&gt;e</title><text text-anchor="start" x="300" y="-12" font-size="9">Tensor[E]</text></g>
</g></svg>"""
    assert label_clashes(svg) == ["'Tensor[B, N; T]' / 'Tensor[B, M; T]'", "'Tensor[D]' on node 'a'"]
