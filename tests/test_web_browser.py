"""``kestrel serve`` in a real browser: Debian's Chromium, headless, driven by Playwright.

A transformers-saved random-weight SAM 2.1 (small widths, 512 px) is exported as the ONNX edge split;
the page is served on loopback; Chromium opens a photo-like image, clicks, shift-clicks and drags a
box, on WASM and on WebGPU (SwiftShader). Each mask the page shows is compared with Kestrel's Python
decode of the same prompt (IoU >= 0.99), and the encoder and per-click decoder latencies are printed.
A click on image B while B still encodes (just after A was encoded) yields B's mask, never A's; a
20000 x 20000 PNG is refused with its size and the limit in both encoder modes; bad files are named
with their cause; the mask has an outline and a toggle.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
if not Path(CHROMIUM).exists():
    pytest.skip(f"Debian's chromium is not installed ({CHROMIUM}); `make setup` installs it",
                allow_module_level=True)

from kestrel.cli.serve import vendor_dir  # noqa: E402

if not (vendor_dir() / "ort.all.min.mjs").is_file():
    pytest.skip(f"onnxruntime-web is not installed at {vendor_dir()}; `make web` installs it",
                allow_module_level=True)

CHROMIUM_ARGS = ["--no-sandbox", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
BACKENDS = {"wasm": ["--disable-gpu"], "webgpu": ["--enable-unsafe-webgpu", "--use-webgpu-adapter=swiftshader"]}
SIZE = 512
LATENCY = Path(__file__).resolve().parent / "artifacts" / "web_latency.json"
SHOTS = Path(os.environ.get("KESTREL_TEST_ARTIFACTS", Path(__file__).resolve().parents[1] / "build" /
                            "test-artifacts")) / "web"


def photo(width: int = 640, height: int = 480) -> np.ndarray:
    """Sky, ground, three soft-edged objects and sensor noise: an image with regions to segment."""
    rng = np.random.default_rng(7)
    y, x = np.mgrid[0:height, 0:width] / np.array([height, width]).reshape(2, 1, 1)
    img = np.where((y < 0.55)[..., None], [110, 165, 240], [90, 115, 50]).astype(float) * (0.8 + 0.2 * x[..., None])
    for cx, cy, r, colour in ((0.45, 0.4, 0.18, (205, 50, 40)), (0.75, 0.75, 0.12, (240, 215, 80)),
                              (0.2, 0.7, 0.1, (60, 60, 150))):
        d = np.sqrt(((x - cx) * width / height) ** 2 + (y - cy) ** 2)
        alpha = 1 / (1 + np.exp((d - r) * 60))
        img = img * (1 - alpha[..., None]) + np.array(colour) * alpha[..., None]
    img += rng.normal(0, 4, img.shape)
    return img.clip(0, 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    """(model directory, ONNX edge export, photo path) for a random-weight SAM 2.1 at 512 px."""
    from kestrel.cli.main import main
    from test_sam2 import seeded_sam2, small_config

    reuse = os.environ.get("KESTREL_WEB_TEST_EXPORT")  # a folder an earlier run wrote: skips the export
    if reuse and (Path(reuse) / "edge" / "manifest.json").is_file():
        return Path(reuse) / "sam2", Path(reuse) / "edge", Path(reuse) / "photo.png"
    root = tmp_path_factory.mktemp("web")
    model_dir = root / "sam2"
    seeded_sam2(small_config(SIZE)).save_pretrained(model_dir)
    export = root / "edge"
    assert main(["export", str(model_dir), "--target", "onnx", "--size", str(SIZE), "--out", str(export),
                 "--no-validate"]) == 0
    image = root / "photo.png"
    Image.fromarray(photo()).save(image)
    return model_dir, export, image


@pytest.fixture(scope="module")
def servers(edge):
    """Two servers on loopback: the encoder in the page, and the encoder here (``--encode server``)."""
    import kestrel
    from kestrel.cli.serve import server_encoder
    from kestrel.web.server import App, make_server, serve_in_thread

    model_dir, export, _ = edge
    model = kestrel.load(str(model_dir), E=SIZE // 16)
    encode = server_encoder(model)

    def slow(image):  # an encoder slow enough that a click always arrives while it runs
        time.sleep(3)
        return encode(image)

    running = {}
    for mode, encoder in (("page", None), ("server", encode), ("slow", slow)):
        app = App(export_dir=export, vendor_dir=vendor_dir(), encode="page" if encoder is None else "server",
                  encoder=encoder)
        srv = make_server(app, "127.0.0.1", 0)
        serve_in_thread(srv)
        running[mode] = srv
    yield {mode: f"http://127.0.0.1:{srv.server_address[1]}/" for mode, srv in running.items()}
    for srv in running.values():
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def reference_for(edge):
    """Kestrel's Python decode of a page prompt on an image: its preprocessing, prompt composer and
    ``decode_tokens``."""
    import kestrel

    model_dir, _, _ = edge
    model = kestrel.load(str(model_dir), E=SIZE // 16)
    return lambda image_path: _reference(model, image_path)


@pytest.fixture(scope="module")
def reference(edge, reference_for):
    return reference_for(edge[2])


def _reference(model, image_path):
    from kestrel.pipelines.sam2_processing import PromptTables, compose
    from kestrel.pipelines.sam2_segment import Sam2Segmenter

    segmenter = Sam2Segmenter(model)
    emb = segmenter.encode(Image.open(image_path))
    tables = PromptTables.from_model(model)
    with torch.no_grad():
        image_pe, dense = model.image_positions(), model.dense_prompt()

    def decode(points: list[dict], box: dict | None) -> np.ndarray:
        frame = [tuple(segmenter.to_frame((p["x"], p["y"]), emb.original_size)) for p in points]
        corners = None if box is None else tuple(
            segmenter.to_frame((box["x0"], box["y0"], box["x1"], box["y1"]), emb.original_size))
        sparse = compose(tables, frame, [p["label"] for p in points], corners, count=3)
        t = emb.tensors
        with torch.no_grad():
            masks, iou, _ = model.decode_tokens(t["image_embeddings"], image_pe, sparse, dense, t["hr0"], t["hr1"])
        best = int(iou[0, 0].argmax())
        return segmenter.postprocess(masks[0, 0, best][None, None], emb)[0, 0].numpy()

    return decode


def iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return 1.0 if union == 0 else float(np.logical_and(a, b).sum() / union)


class Page:
    """The served page in Chromium, with the image's pixel coordinates mapped to the screen."""

    def __init__(self, page, width: int, height: int) -> None:
        self.page, self.width, self.height = page, width, height

    def at(self, x: float, y: float) -> tuple[float, float]:
        box = self.page.locator("#overlay").bounding_box()
        return box["x"] + (x + 0.5) * box["width"] / self.width, box["y"] + (y + 0.5) * box["height"] / self.height

    def decoded(self, count: int) -> dict:
        self.page.wait_for_function(f"window.kestrel.decodeMs.length >= {count}", timeout=120_000)
        return self.page.evaluate("""() => { const s = window.kestrel;
            return {points: s.prompt.points, box: s.prompt.box, best: s.decode && s.decode.best,
                    mask: s.decode && Array.from(s.decode.mask), decodeMs: s.decodeMs, encodeMs: s.encodeMs,
                    clickMs: s.clickMs, waited: s.waitedForEncoder,
                    backend: s.backend, error: document.getElementById('status').className}; }""")

    def click(self, x: float, y: float, shift: bool = False) -> None:
        if shift:
            self.page.keyboard.down("Shift")
        self.page.mouse.click(*self.at(x, y))
        if shift:
            self.page.keyboard.up("Shift")

    def drag(self, x0: float, y0: float, x1: float, y1: float) -> None:
        self.page.mouse.move(*self.at(x0, y0))
        self.page.mouse.down()
        self.page.mouse.move(*self.at(x1, y1), steps=6)
        self.page.mouse.up()


# The encoder runs in the page on WASM. On WebGPU through SwiftShader (a CPU emulation of a GPU) one
# Hiera encode takes minutes on these 2 cores, so there the encoder runs on the server and the page
# decodes every click on WebGPU: the per-click path, which is what the decoder program is for.
CASES = [("wasm", "page"), ("webgpu", "server")]


@pytest.mark.parametrize(("backend", "encode"), CASES)
def test_segment_in_the_browser(servers, edge, reference, backend, encode, tmp_path, capsys):
    from playwright.sync_api import sync_playwright

    _, _, image_path = edge
    width, height = Image.open(image_path).size
    console_errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS + BACKENDS[backend])
        try:
            scheme = "light" if backend == "wasm" else "dark"  # a screenshot in each theme
            page = browser.new_page(viewport={"width": 1000, "height": 800}, color_scheme=scheme)
            page.on("console", lambda m: m.type == "error" and console_errors.append(m.text))
            page.on("pageerror", lambda e: console_errors.append(str(e)))
            page.goto(f"{servers[encode]}?backend={backend}")
            assert page.evaluate("window.kestrel.ready"), page.inner_text("#status")
            assert page.evaluate("window.kestrel.backend") == backend
            page.set_input_files("#file", str(image_path))
            page.wait_for_function("window.kestrel.encodeMs !== null", timeout=300_000)
            ui = Page(page, width, height)

            ui.click(280, 190)                       # foreground on the red object
            first = ui.decoded(1)
            overlay = _overlay_pixels(page)
            page.click("#show-mask")                 # the toggle hides the mask, the point stays
            hidden = _overlay_pixels(page)
            page.keyboard.press("m")                 # and m shows it again
            assert _overlay_pixels(page) == overlay
            ui.click(500, 380, shift=True)           # background on the yellow one
            second = ui.decoded(2)
            page.click("#clear")
            page.wait_for_function("window.kestrel.decode === null")
            ui.drag(150, 90, 420, 300)               # a box around the red object
            third = ui.decoded(3)
            SHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SHOTS / f"segment_{backend}.{scheme}.png"))
        finally:
            browser.close()

    assert not console_errors, console_errors
    # the mask: a translucent fill, an opaque white outline inside its edge and black outside it
    masked = int(np.array(first["mask"]).sum())
    assert overlay["fill"] > 0 and overlay["white"] > 50 and overlay["black"] > 50
    assert abs(overlay["fill"] + overlay["white"] - masked) < 100  # every mask pixel is fill or outline (+ the dot)
    assert hidden["fill"] + hidden["white"] < 100 and hidden["black"] < overlay["black"] / 5  # the dot only
    # the status times the whole path from the click to the drawn mask, decoder included
    assert all(c >= d for c, d in zip(third["clickMs"], third["decodeMs"]))
    assert [p["label"] for p in second["points"]] == [1, 0] and third["box"] is not None
    for state in (first, second, third):
        expected = reference(state["points"], state["box"])
        got = np.array(state["mask"], dtype=bool).reshape(height, width)
        assert got.any() or expected.any()
        assert iou(got, expected) >= 0.99, (state["points"], state["box"], iou(got, expected))

    clicks = [round(ms, 1) for ms in third["decodeMs"]]
    record = {"backend": backend, "encoder": f"in the {encode}", "encoder_ms": round(third["encodeMs"], 1),
              "decode_ms": clicks}
    LATENCY.parent.mkdir(exist_ok=True)
    done = json.loads(LATENCY.read_text()) if LATENCY.exists() else {}
    done[backend] = record
    LATENCY.write_text(json.dumps(done, indent=2))
    with capsys.disabled():
        print(f"\n[kestrel serve, decoder on {backend}] encoder (in the {encode}) {record['encoder_ms']} ms; "
              f"per-click decode {clicks} ms "
              f"(image {width}x{height}, small random-weight SAM 2.1 at {SIZE}; {os.cpu_count()} CPUs)")


def _overlay_pixels(page) -> dict:
    """Counts of the overlay's pixels: translucent fill, opaque white and opaque black (the outline)."""
    return page.evaluate("""() => { const c = document.getElementById('overlay');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let fill = 0, white = 0, black = 0;
        for (let i = 0; i < d.length; i += 4) {
          if (d[i + 3] > 0 && d[i + 3] < 255) fill++;
          else if (d[i + 3] === 255 && d[i] === 255 && d[i + 1] === 255 && d[i + 2] === 255) white++;
          else if (d[i + 3] === 255 && d[i] === 0 && d[i + 1] === 0 && d[i + 2] === 0) black++;
        }
        return { fill, white, black }; }""")


def _open(p, url: str):
    browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS + BACKENDS["wasm"])
    page = browser.new_page(viewport={"width": 1000, "height": 800})
    page.goto(f"{url}?backend=wasm")
    assert page.evaluate("window.kestrel.ready"), page.inner_text("#status")
    return browser, page


def test_a_click_on_a_new_image_is_decoded_against_that_image(servers, edge, reference, reference_for, tmp_path):
    """A then B, click at once: the click waits for B's features and yields B's mask, never A's.

    The encoder is the server's, made slow (3 s) so that the click surely arrives while B encodes; the
    page's wait is the same code for either encoder (the load's features promise)."""
    from playwright.sync_api import sync_playwright

    _, _, image_a = edge
    image_b = tmp_path / "b.png"
    Image.fromarray(np.ascontiguousarray(photo()[::-1, ::-1])).save(image_b)  # the scene turned upside down
    width, height = Image.open(image_a).size
    with sync_playwright() as p:
        browser, page = _open(p, servers["slow"])
        try:
            page.set_input_files("#file", str(image_a))
            page.wait_for_function("window.kestrel.encodeMs !== null", timeout=300_000)
            page.set_input_files("#file", str(image_b))
            page.wait_for_function("window.kestrel.image && window.kestrel.image.name === 'b.png' && "
                                   "window.kestrel.shown === window.kestrel.load")
            ui = Page(page, width, height)
            assert page.evaluate("window.kestrel.features === null")  # B is encoding
            ui.click(280, 190)
            page.wait_for_function("document.getElementById('status').textContent.startsWith('encoding b.png')")
            state = ui.decoded(1)
            assert state["waited"] == 1, "the click came after B was encoded: no race was tested"
            SHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SHOTS / "segment_race.png"))
        finally:
            browser.close()
    got = np.array(state["mask"], dtype=bool).reshape(height, width)
    mask_b = reference_for(image_b)([{"x": p["x"], "y": p["y"], "label": p["label"]} for p in state["points"]], None)
    mask_a = reference(state["points"], None)
    assert iou(mask_a, mask_b) < 0.9  # the two images' masks differ, so the test can tell them apart
    assert iou(got, mask_b) >= 0.99, iou(got, mask_b)


def _huge_png(path: Path, width: int = 20_000, height: int = 20_000) -> None:
    """A valid PNG of width x height black pixels (1 bit grey, so it stays small)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    squeeze = zlib.compressobj(9)
    row = b"\0" * (1 + (width + 7) // 8)
    data = b"".join(squeeze.compress(row) for _ in range(height)) + squeeze.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", data) + chunk(b"IEND", b""))


@pytest.mark.parametrize("encode", ["page", "server"])
def test_bad_files_are_refused_with_their_name_and_cause(servers, edge, encode, tmp_path):
    from playwright.sync_api import sync_playwright

    huge = tmp_path / "huge.png"
    _huge_png(huge)
    from kestrel.web.server import image_size

    assert image_size(huge.read_bytes()) == (20_000, 20_000) and huge.stat().st_size < 200_000
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "notes.png").write_text("a text file with an image's name")
    (tmp_path / "broken.png").write_bytes(Path(edge[2]).read_bytes()[:400])  # header fine, pixels cut off
    expected = {
        "huge.png": "huge.png is 20000 x 20000 = 400,000,000 pixels; the limit is 40,000,000 pixels",
        "empty.png": "empty.png is empty (0 bytes)",
        "notes.png": "notes.png is not an image",
        "broken.png": "broken.png: the browser could not decode this PNG image",
    }
    with sync_playwright() as p:
        browser, page = _open(p, servers[encode])
        try:
            for name, words in expected.items():
                page.set_input_files("#file", str(tmp_path / name))
                page.wait_for_function("document.getElementById('status').className === 'error'")
                status = page.inner_text("#status")
                assert status.startswith("error: " + words), (name, status)
                assert page.evaluate("window.kestrel.encodeMs === null && window.kestrel.decode === null")
                page.evaluate("document.getElementById('status').className = ''")
            SHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SHOTS / f"segment_refused_{encode}.png"))
        finally:
            browser.close()


def test_the_site_describes_the_split_the_export_writes(edge):
    """SAM 2.1's site page derives the two programs' ports from the entries; a real export agrees."""
    import kestrel
    from kestrel.site.edge import split_programs

    model_dir, export, _ = edge
    model = kestrel.load(str(model_dir), E=SIZE // 16)
    manifest = json.loads((export / "manifest.json").read_text())
    written = {name.rsplit(".", 1)[0]: spec for name, spec in manifest["export"]["programs"].items()}
    described = split_programs(type(model), model.generics["Hd"], SIZE // 16, written["sam2_decoder"]["prompt_tokens"])
    for program in described:
        spec = written[program["name"]]
        assert [(p["name"], p["shape"]) for p in spec["inputs"]] == [(n, s) for n, s in program["inputs"]]
        assert [(p["name"], p["shape"]) for p in spec["outputs"]] == [(n, s) for n, s in program["outputs"]]
