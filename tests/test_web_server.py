"""``kestrel serve``'s server: loopback only, closed file sets (no traversal), bounded uploads."""

from __future__ import annotations

import http.client
import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from kestrel.web.server import (
    App,
    ServeError,
    check_upload,
    make_server,
    pack_tensors,
    require_loopback,
    serve_in_thread,
)


@pytest.fixture()
def export_dir(tmp_path: Path) -> Path:
    d = tmp_path / "edge"
    d.mkdir()
    (d / "prompt_dense.bin").write_bytes(b"\0" * 16)
    (d / "secret.txt").write_text("not listed in the manifest")
    (d / "manifest.json").write_text(json.dumps({"model": "test", "files": {"prompt_dense.bin": {"bytes": 16}}}))
    (tmp_path / "outside.txt").write_text("outside the export")
    return d


@pytest.fixture()
def vendor(tmp_path: Path) -> Path:
    d = tmp_path / "ort"
    d.mkdir()
    (d / "ort.all.min.mjs").write_text("export {};")
    (d / "ort-wasm-simd-threaded.wasm").write_bytes(b"\0asm")
    (d / "README.md").write_text("not served: only .mjs and .wasm")
    return d


def png_bytes(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height: what a decompression bomb looks like before decoding."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


@pytest.fixture()
def served(export_dir: Path, vendor: Path):
    seen: list[tuple[int, int]] = []

    def encoder(image):
        seen.append(image.size)
        return {"image_embeddings": np.arange(6, dtype=np.float32).reshape(1, 2, 3), "hr0": np.ones((2, 2), np.float32)}

    app = App(export_dir=export_dir, vendor_dir=vendor, encode="server", encoder=encoder,
              max_upload_bytes=64 * 1024, max_upload_pixels=1000 * 1000)
    server = make_server(app, "127.0.0.1", 0)
    serve_in_thread(server)
    yield server, seen
    server.shutdown()
    server.server_close()


def request(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, data, response


def test_serves_the_page_the_vendor_files_and_the_listed_export_files(served):
    server, _ = served
    status, body, response = request(server, "GET", "/")
    assert status == 200 and b"<canvas" in body
    assert response.getheader("Cross-Origin-Opener-Policy") == "same-origin"
    for path in ("/static/app.js", "/static/composer.js", "/vendor/ort.all.min.mjs", "/export/manifest.json",
                 "/export/prompt_dense.bin"):
        assert request(server, "GET", path)[0] == 200, path
    status, body, _ = request(server, "GET", "/api/config")
    assert json.loads(body)["encode"] == "server"


@pytest.mark.parametrize("path", [
    "/export/secret.txt",              # in the folder but not in the manifest
    "/export/../outside.txt", "/export/%2e%2e/outside.txt", "/export/..%2foutside.txt",
    "/static/../server.py", "/static/%2e%2e/server.py", "/vendor/README.md", "/vendor/../edge/manifest.json",
    "//etc/passwd", "/etc/passwd", "/export/prompt_dense.bin/..", "/static/",
])
def test_no_other_file_is_reachable(served, path):
    status, body, _ = request(served[0], "GET", path)
    assert status == 404 and b"not found" in body


def test_upload_is_encoded_and_packed(served):
    server, seen = served
    status, body, _ = request(server, "POST", "/api/encode", png_bytes(40, 30), {"Content-Type": "image/png"})
    assert status == 200 and seen == [(40, 30)]
    (header_len,) = struct.unpack("<I", body[:4])
    header = json.loads(body[4:4 + header_len])
    first = header["tensors"][0]
    assert first["name"] == "image_embeddings" and first["shape"] == [1, 2, 3]
    data = np.frombuffer(body[4 + header_len + first["offset"]:][:first["bytes"]], "<f4")
    assert data.tolist() == list(range(6))


@pytest.mark.parametrize(("body", "status", "message"), [
    (b"GIF89a" + b"\0" * 10, 400, "unreadable gif"),
    (b"not an image at all", 415, "not a PNG"),
    (png_header_only(20_000, 20_000), 413, "20000 x 20000 = 400,000,000 pixels; the limit is 1,000,000 pixels"),
    (png_header_only(2_000, 1_000), 413, "image is 2000 x 1000 = 2,000,000 pixels; the limit is 1,000,000 pixels"),
    (b"\x89PNG\r\n\x1a\n" + b"\0" * (70 * 1024), 413, "the limit is 65,536 bytes"),
    (b"", 400, "the upload is empty"),
])
def test_bad_uploads_are_refused_before_decoding(served, body, status, message):
    server, seen = served
    got, data, _ = request(server, "POST", "/api/encode", body)
    error = json.loads(data)["error"]
    assert got == status and message in error
    assert error.count("limit") <= 1  # one limit named, not PIL's beside ours
    assert seen == []


@pytest.mark.parametrize(("make", "size"), [
    (lambda: png_bytes(33, 17), (33, 17)), (lambda: _saved("JPEG", 40, 23), (40, 23)),
    (lambda: _saved("GIF", 9, 12), (9, 12)), (lambda: _saved("BMP", 21, 8), (21, 8)),
    (lambda: _saved("WEBP", 30, 19), (30, 19)), (lambda: _saved("WEBP", 30, 19, lossless=True), (30, 19)),
])
def test_image_size_is_read_from_the_header(make, size):
    from kestrel.web.server import image_size

    assert image_size(make()) == size


def _saved(fmt: str, width: int, height: int, **kw) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_a_client_that_disconnects_is_one_line_in_the_log(export_dir, vendor, capfd):
    import socket
    import time

    def slow_big_encoder(image):
        time.sleep(0.3)  # the client is gone by the time the answer is written
        return {"image_embeddings": np.zeros((4, 1024, 1024), np.float32)}

    app = App(export_dir=export_dir, vendor_dir=vendor, encode="server", encoder=slow_big_encoder)
    server = make_server(app, "127.0.0.1", 0)
    serve_in_thread(server)
    try:
        body = png_bytes(8, 8)
        sock = socket.create_connection(server.server_address[:2])
        sock.sendall(b"POST /api/encode HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        sock.close()
        time.sleep(1.0)
    finally:
        server.shutdown()
        server.server_close()
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and "disconnected during POST /api/encode" in lines[0], err


def test_upload_without_length_is_refused(served):
    conn = http.client.HTTPConnection(*served[0].server_address[:2], timeout=10)
    conn.putrequest("POST", "/api/encode")
    conn.endheaders()
    assert conn.getresponse().status == 411


@pytest.mark.parametrize("host", ["0.0.0.0", "8.8.8.8", "192.168.1.10"])
def test_only_loopback_is_bound(host):
    with pytest.raises(ServeError, match="loopback only"):
        require_loopback(host)
    assert require_loopback("127.0.0.1") == "127.0.0.1"
    assert require_loopback("localhost") == "localhost"


def test_manifest_naming_a_file_outside_is_refused(export_dir, vendor):
    (export_dir / "manifest.json").write_text(json.dumps({"files": {"../outside.txt": {}}}))
    with pytest.raises(ServeError, match="not a file in"):
        App(export_dir=export_dir, vendor_dir=vendor)


def test_missing_export_or_runtime_is_a_clear_error(tmp_path, export_dir, vendor):
    with pytest.raises(ServeError, match=r"no manifest\.json"):
        App(export_dir=tmp_path / "nowhere", vendor_dir=vendor)
    with pytest.raises(ServeError, match="onnxruntime-web is not installed"):
        App(export_dir=export_dir, vendor_dir=tmp_path / "nowhere")
    with pytest.raises(ServeError, match="needs a model"):
        App(export_dir=export_dir, vendor_dir=vendor, encode="server")


def test_check_upload_returns_rgb():
    image = check_upload(png_bytes(7, 5))
    assert image.mode == "RGB" and image.size == (7, 5)


def test_pack_tensors_keeps_data_aligned():
    packed = pack_tensors({"a": np.zeros((3,), np.float32)})
    (n,) = struct.unpack("<I", packed[:4])
    assert (4 + n) % 4 == 0
