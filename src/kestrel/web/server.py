"""The local segmentation app behind ``kestrel serve``: a loopback-only HTTP server for one page.

The page (``static/``) segments in the browser from an edge export of SAM 2.1 (``kestrel export ...
--target onnx``): it reads the export's ``manifest.json``, checks every file's sha256, composes prompt
tokens from the prompt tables and runs the decoder with onnxruntime-web on every click. The encoder
runs once per image, in the page (``encode="page"``) or here (``encode="server"``: the image is
uploaded, encoded by Kestrel and the embedding and high-resolution features are sent back).

The server only ever serves three closed sets of files, each fixed when it starts: the page's own
assets, onnxruntime-web's distribution files, and the files the export's manifest lists. Nothing is
looked up from a request path, so no request reaches another file. Uploads are bounded in bytes and
in pixels, and their image format is recognised from the first bytes before anything decodes them.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import struct
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np

from ..errors import KestrelError

STATIC = Path(__file__).with_name("static")
MAX_UPLOAD_BYTES = 32 * 1024 * 1024
MAX_UPLOAD_PIXELS = 40_000_000

# The formats the page may upload, by their first bytes (decoders are never tried on anything else).
IMAGE_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "png"), (b"\xff\xd8\xff", "jpeg"), (b"GIF87a", "gif"), (b"GIF89a", "gif"),
    (b"BM", "bmp"),
)

CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".mjs": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
                 ".json": "application/json", ".wasm": "application/wasm", ".svg": "image/svg+xml",
                 ".png": "image/png"}


class ServeError(KestrelError, ValueError):
    """A server that cannot start as asked: a non-loopback address, a missing export or runtime."""


class UploadError(KestrelError, ValueError):
    """An upload refused before decoding: too large, not an image we accept, or too many pixels."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def image_format(head: bytes) -> str | None:
    """The image format named by a file's first bytes (``png``, ``jpeg``, ...), or None."""
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return next((name for magic, name in IMAGE_MAGIC if head.startswith(magic)), None)


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from an accepted image's header, without decoding it; None where the header is cut.

    The page reads the same fields (``static/imageinfo.js``), so both refuse the same images.
    """
    fmt = image_format(data[:16])
    try:
        if fmt == "png" and data[12:16] == b"IHDR":
            return struct.unpack(">II", data[16:24])
        if fmt == "gif":
            return struct.unpack("<HH", data[6:10])
        if fmt == "bmp":
            w, h = struct.unpack("<ii", data[18:26])
            return abs(w), abs(h)
        if fmt == "webp":
            kind = data[12:16]
            if kind == b"VP8 ":
                w, h = struct.unpack("<HH", data[26:30])
                return w & 0x3FFF, h & 0x3FFF
            if kind == b"VP8L":
                bits = int.from_bytes(data[21:25], "little")
                return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
            if kind == b"VP8X":
                return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
        if fmt == "jpeg":
            at = 2
            while at + 9 < len(data):
                if data[at] != 0xFF:
                    return None
                marker = data[at + 1]
                if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
                    at += 2
                    continue
                (length,) = struct.unpack(">H", data[at + 2:at + 4])
                if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
                    h, w = struct.unpack(">HH", data[at + 5:at + 9])
                    return w, h
                at += 2 + length
    except struct.error:
        return None
    return None


def too_many_pixels(width: int, height: int, limit: int) -> str:
    """The one message for an image over the pixel limit (the page writes the same, with the file's name)."""
    return f"{width} x {height} = {width * height:,} pixels; the limit is {limit:,} pixels"


def check_upload(data: bytes, max_bytes: int = MAX_UPLOAD_BYTES, max_pixels: int = MAX_UPLOAD_PIXELS):
    """Validate an uploaded image and return it decoded as RGB (PIL), or raise :class:`UploadError`.

    The size and format are checked first, then the header's width x height (read from the header's
    bytes, as the page does, or by PIL without decoding pixels); only then are the pixels decoded.
    """
    import io

    from PIL import Image

    if not data:
        raise UploadError(HTTPStatus.BAD_REQUEST, "the upload is empty (0 bytes)")
    if len(data) > max_bytes:
        raise UploadError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                          f"upload is {len(data):,} bytes; the limit is {max_bytes:,} bytes")
    fmt = image_format(data[:16])
    if fmt is None:
        raise UploadError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                          "upload is not a PNG, JPEG, GIF, BMP or WebP image (by its first bytes)")
    size = image_size(data)
    if size is not None and size[0] * size[1] > max_pixels:
        raise UploadError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "image is " + too_many_pixels(*size, max_pixels))
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
    except Image.DecompressionBombError as e:  # a header claiming far more pixels than PIL's own ceiling
        found = re.search(r"\((\d+) pixels\)", str(e))
        count = f"{int(found[1]):,}" if found else "too many"
        raise UploadError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                          f"image is {count} pixels; the limit is {max_pixels:,} pixels") from None
    except Exception as e:  # PIL raises many types for a broken header
        raise UploadError(HTTPStatus.BAD_REQUEST, f"unreadable {fmt} image: {e}") from None
    if width * height > max_pixels:
        raise UploadError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "image is " + too_many_pixels(width, height, max_pixels))
    try:
        return image.convert("RGB")
    except Exception as e:
        raise UploadError(HTTPStatus.BAD_REQUEST, f"unreadable {fmt} image: {e}") from None


def pack_tensors(tensors: dict[str, np.ndarray]) -> bytes:
    """``u32 header length | JSON header | f32 data``: the encode response the page unpacks."""
    header, chunks, offset = [], [], 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype="<f4").tobytes()
        header.append({"name": name, "shape": list(array.shape), "offset": offset, "bytes": len(data)})
        chunks.append(data)
        offset += len(data)
    head = json.dumps({"tensors": header}).encode()
    head += b" " * (-len(head) % 4)  # keep the f32 data 4-byte aligned for Float32Array views
    return struct.pack("<I", len(head)) + head + b"".join(chunks)


def require_loopback(host: str) -> str:
    """The host if every address it names is loopback; else :class:`ServeError`."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        raise ServeError(f"cannot resolve host {host!r}: {e}") from None
    outside = sorted(a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_loopback)
    if outside:
        raise ServeError(f"kestrel serve binds loopback only; {host!r} resolves to {', '.join(outside)}")
    return host


@dataclass
class App:
    """What the server serves: fixed at start, looked up by exact URL path only."""

    export_dir: Path
    vendor_dir: Path
    encode: str = "page"
    encoder: Callable[[Any], dict[str, np.ndarray]] | None = None  # PIL RGB image -> outputs
    max_upload_bytes: int = MAX_UPLOAD_BYTES
    max_upload_pixels: int = MAX_UPLOAD_PIXELS
    routes: dict[str, Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.encode not in ("page", "server"):
            raise ServeError(f"--encode must be page or server, got {self.encode!r}")
        if self.encode == "server" and self.encoder is None:
            raise ServeError("--encode server needs a model to encode with")
        manifest_path = self.export_dir / "manifest.json"
        if not manifest_path.is_file():
            raise ServeError(f"{self.export_dir}: no manifest.json; make one with "
                             f"`kestrel export sam2.1-hiera-tiny --target onnx --size 512 --out {self.export_dir}`")
        from ..pipelines.readers import read_json_object

        manifest = read_json_object(manifest_path, "manifest.json")
        if not isinstance(manifest.get("files"), dict):  # a ViT's plain ONNX export lists its files as rows
            raise ServeError(f"{manifest_path}: not a SAM 2.1 edge export (no table of files); make one with "
                             "`kestrel export sam2.1-hiera-tiny --target onnx --size 512 --out DIR`")
        self.routes["/"] = STATIC / "index.html"
        for f in STATIC.iterdir():
            if f.is_file():
                self.routes[f"/static/{f.name}"] = f
        if not (self.vendor_dir / "ort.all.min.mjs").is_file():
            raise ServeError(f"onnxruntime-web is not installed at {self.vendor_dir}; run `make web` "
                             "(npm ci in web/) or set KESTREL_ORT_DIR to its dist folder")
        for f in self.vendor_dir.iterdir():
            if f.is_file() and f.suffix in (".mjs", ".wasm"):
                self.routes[f"/vendor/{f.name}"] = f
        self.routes["/export/manifest.json"] = manifest_path
        for name in manifest.get("files", {}):
            path = self.export_dir / name
            if "/" in name or "\\" in name or name.startswith(".") or not path.is_file():
                raise ServeError(f"{manifest_path}: lists {name!r}, which is not a file in {self.export_dir}")
            self.routes[f"/export/{name}"] = path

    def config(self) -> dict[str, Any]:
        from ..pipelines.input_rules import as_json

        return {"encode": self.encode, "manifest": "/export/manifest.json",
                "max_upload_bytes": self.max_upload_bytes, "max_upload_pixels": self.max_upload_pixels,
                "rules": as_json()}  # the prompt and size rules the page applies (kestrel.pipelines.input_rules)


class Handler(BaseHTTPRequestHandler):
    server_version = "kestrel-serve"
    app: App  # set on the subclass made by make_server

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the CLI prints one line per start
        pass

    def handle_one_request(self) -> None:
        """One request; a client that goes away mid-request is one line on stderr, not a traceback."""
        try:
            super().handle_one_request()
        except (ConnectionError, TimeoutError) as e:
            self.close_connection = True
            host, port = self.client_address[:2]
            what = f"{self.command} {urlsplit(self.path).path}" if getattr(self, "command", None) else "a request"
            print(f"kestrel serve: client {host}:{port} disconnected during {what} "
                  f"({type(e).__name__}); nothing more was sent", file=sys.stderr, flush=True)

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        # cross-origin isolation: lets onnxruntime-web use threads (SharedArrayBuffer)
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._send(status, json.dumps({"error": message}).encode(), "application/json")

    def do_GET(self) -> None:
        path = unquote(urlsplit(self.path).path)
        if path == "/api/config":
            return self._send(HTTPStatus.OK, json.dumps(self.app.config()).encode(), "application/json")
        target = self.app.routes.get(path)
        if target is None:
            return self._error(HTTPStatus.NOT_FOUND, f"not found: {path}")
        self._send(HTTPStatus.OK, target.read_bytes(),
                   CONTENT_TYPES.get(target.suffix, "application/octet-stream"))

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        if path != "/api/encode" or self.app.encoder is None:
            return self._error(HTTPStatus.NOT_FOUND, f"not found: {path}")
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            return self._error(HTTPStatus.LENGTH_REQUIRED, "an upload needs a Content-Length")
        if int(length) > self.app.max_upload_bytes:
            self.close_connection = True  # do not read a body we refuse
            return self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                               f"upload is {int(length):,} bytes; the limit is {self.app.max_upload_bytes:,} bytes")
        data = self.rfile.read(int(length))
        if len(data) < int(length):
            raise ConnectionResetError(f"the upload ended after {len(data)} of {length} bytes")
        try:
            image = check_upload(data, self.app.max_upload_bytes, self.app.max_upload_pixels)
        except UploadError as e:
            return self._error(e.status, str(e))
        outputs = self.app.encoder(image)
        self._send(HTTPStatus.OK, pack_tensors(outputs), "application/octet-stream")


def make_server(app: App, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A started-on-demand server for ``app`` on loopback (port 0 picks a free port)."""
    require_loopback(host)
    handler = type("AppHandler", (Handler,), {"app": app})
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_cls = type("AppServer", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True})
    return server_cls((host, port), handler)


def serve_in_thread(server: ThreadingHTTPServer) -> threading.Thread:
    """Run ``server`` in a daemon thread (tests and notebooks); stop it with ``server.shutdown()``."""
    thread = threading.Thread(target=server.serve_forever, name="kestrel-serve", daemon=True)
    thread.start()
    return thread
