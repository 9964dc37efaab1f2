"""The page's image check (static/imageinfo.js, run by Node.js) against the server's (kestrel.web.server).

Both read width x height from the same header fields, so the page and the server refuse the same images,
with the same words; every bad file's message names the file and the cause.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from kestrel.web.server import UploadError, check_upload, image_size

STATIC = Path(__file__).resolve().parents[1] / "src" / "kestrel" / "web" / "static"
NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="Node.js is not installed (the page's JavaScript runs on it)")

SCRIPT = """
import { inspectImage } from '%s/imageinfo.js';
import fs from 'fs';
const jobs = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
const out = [];
for (const job of jobs) {
  const bytes = fs.readFileSync(job.path);
  const file = { name: job.name, size: bytes.length, arrayBuffer: async () => bytes.buffer.slice(bytes.byteOffset,
                 bytes.byteOffset + bytes.length) };
  try { out.push({ ok: await inspectImage(file, { maxBytes: job.maxBytes, maxPixels: job.maxPixels }) }); }
  catch (e) { out.push({ error: e.message }); }
}
console.log(JSON.stringify(out));
"""


def _saved(fmt: str, width: int, height: int, **kw) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, format=fmt, **kw)
    return buf.getvalue()


def _bomb(width: int, height: int) -> bytes:
    from test_web_server import png_header_only

    return png_header_only(width, height)


CASES = {
    "small.png": (_saved("PNG", 33, 17), None),
    "small.jpg": (_saved("JPEG", 40, 23), None),
    "small.gif": (_saved("GIF", 9, 12), None),
    "small.bmp": (_saved("BMP", 21, 8), None),
    "small.webp": (_saved("WEBP", 30, 19), None),
    "lossless.webp": (_saved("WEBP", 30, 19, lossless=True), None),
    "huge.png": (_bomb(20_000, 20_000),
                 "huge.png is 20000 x 20000 = 400,000,000 pixels; the limit is 40,000,000 pixels"),
    "empty.png": (b"", "empty.png is empty (0 bytes)"),
    "notes.txt": (b"just some text, not an image", "notes.txt is not an image"),
    "scan.tiff": (_saved("TIFF", 8, 8), "scan.tiff is a TIFF file; this page opens PNG, JPEG, GIF, BMP, WebP images"),
    "cut.png": (b"\x89PNG\r\n\x1a\n\0\0", "cut.png: its PNG header is damaged or cut short"),
}


def test_page_and_server_read_the_same_sizes_and_refuse_the_same_files(tmp_path):
    jobs = []
    for name, (data, _) in CASES.items():
        (tmp_path / name).write_bytes(data)
        jobs.append({"path": str(tmp_path / name), "name": name, "maxBytes": 32 * 1024 * 1024,
                     "maxPixels": 40_000_000})
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    script = tmp_path / "run.mjs"
    script.write_text(SCRIPT % STATIC.as_posix())
    proc = subprocess.run([NODE, str(script), str(tmp_path / "jobs.json")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    results = dict(zip(CASES, json.loads(proc.stdout)))
    for name, (data, expected) in CASES.items():
        got = results[name]
        if expected is None:
            assert "ok" in got, (name, got)
            assert (got["ok"]["width"], got["ok"]["height"]) == image_size(data) == Image.open(io.BytesIO(data)).size
        else:
            assert got.get("error", "").startswith(expected), (name, got)
    # the server's words for the same bomb: the same size and limit, without the file name it never sees
    with pytest.raises(UploadError) as e:
        check_upload(CASES["huge.png"][0])
    assert str(e.value) == "image is 20000 x 20000 = 400,000,000 pixels; the limit is 40,000,000 pixels"
    assert results["huge.png"]["error"].endswith(str(e.value).removeprefix("image is "))
