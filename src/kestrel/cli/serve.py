"""``kestrel serve``: segment in the browser with SAM 2.1's edge split, served on loopback."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..kernels import settings
from .options import (
    Choice,
    Command,
    ExistingDir,
    Host,
    ModelRef,
    Option,
    PixelSize,
    Port,
    PositiveInt,
    register,
    weights_option,
)

EPILOG = """\
examples:
  kestrel export sam2.1-hiera-tiny --weights DIR --target onnx --size 512 --out edge/
  kestrel serve --export edge/                         # then open the printed address
  kestrel serve --model DIR                            # export DIR's model once (cached), then serve
  kestrel serve --export edge/ --model DIR --encode server --port 8765
"""


def vendor_dir() -> Path:
    """onnxruntime-web's ``dist`` folder: ``$KESTREL_ORT_DIR``, else the checkout's ``web/node_modules``."""
    env = settings.ort_dir()
    if env is not None:
        return env
    return Path(__file__).resolve().parents[3] / "web" / "node_modules" / "onnxruntime-web" / "dist"


def cmd_serve(args: argparse.Namespace) -> int:
    """segment in the browser (SAM 2.1 edge split, local web page)

    A local web page that segments with SAM 2.1 in the browser. Open or drop an image: the encoder runs
    once (in the page with onnxruntime-web, on WebGPU when the browser has it and on WASM otherwise, or
    here with --encode server); then every click (foreground), shift-click (background) and dragged box
    decodes in the page from the export's prompt tables and decoder, without a round trip. Undo, clear,
    and download the mask as PNG. The page checks every file against the export manifest's sha256.

    The server binds loopback only and serves nothing but the page, onnxruntime-web and the files the
    export's manifest lists; uploads (with --encode server) are bounded in bytes and pixels.
    """
    from ..pipelines.input_rules import check_export_size
    from ..pipelines.readers import read_edge_manifest
    from ..site.serve import serve_until_interrupted
    from ..web.server import App, ServeError, make_server, require_loopback

    require_loopback(args.host)
    if args.export is None and args.model is None:
        raise ServeError("give --export DIR (a `kestrel export --target onnx` folder) or --model NAME|DIR")
    if args.encode == "server" and args.model is None:
        raise ServeError("--encode server needs --model NAME|DIR to encode with")
    if args.export is not None:  # the export's own size, checked before any model loads
        _, export_size = read_edge_manifest(args.export)
        args.size = check_export_size(export_size, args.size, f"the export {args.export}")
    elif args.size is None:
        args.size = DEFAULT_SIZE
    if args.model is not None:
        from .tasks import check_size

        check_size(args.model, args.weights, args.size)
    model = _load(args) if args.model is not None else None
    export = Path(args.export) if args.export else cached_edge_export(model, args.size)
    encoder = server_encoder(model) if args.encode == "server" else None
    app = App(export_dir=export, vendor_dir=vendor_dir(), encode=args.encode, encoder=encoder,
              max_upload_bytes=args.max_upload_mb * 1024 * 1024, max_upload_pixels=args.max_upload_pixels)
    server = make_server(app, args.host, args.port)
    host, port = server.server_address[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/"
    print(f"kestrel serve: {url}  (export {export}; encoder in the {args.encode}; Ctrl-C stops)", flush=True)
    serve_until_interrupted(server)
    return 0


def _load(args: argparse.Namespace):
    from ..runtime.load import load

    return load(args.model, weights=args.weights, E=args.size // 16)


def cached_edge_export(model, size: int) -> Path:
    """The ONNX edge split of ``model``, exported once into Kestrel's cache and reused.

    The key covers what the programs depend on: the checkpoint (card and revision, or the directory
    and its files' sizes and times), the input size and the Kestrel version.
    """
    import hashlib
    import json

    from .. import __version__
    from ..export.edge import export_edge
    from ..kernels.settings import cache_dir

    loaded = model.loaded
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in loaded.directory.glob("*.safetensors"))
    key = json.dumps({"name": loaded.name, "revision": loaded.card.revision if loaded.card else None,
                      "directory": str(loaded.directory.resolve()), "files": files, "size": size,
                      "kestrel": __version__}, sort_keys=True)
    out = cache_dir("edge", f"{loaded.name}-{size}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")
    if not (out / "manifest.json").is_file():
        print(f"exporting {loaded.name} at {size} px for the page (once; cached in {out})", flush=True)
        export_edge(model, out, "onnx", validate=False, progress=lambda msg: print(f"  {msg}", flush=True))
    return out


def server_encoder(model):
    """PIL image -> the encoder program's outputs, computed by Kestrel here (``--encode server``)."""
    from ..pipelines.sam2_segment import Sam2Segmenter

    segmenter = Sam2Segmenter(model)

    def encode(image) -> dict:
        emb = segmenter.encode(image)
        return {name: tensor.float().numpy() for name, tensor in emb.tensors.items()}

    return encode


DEFAULT_SIZE = 512

register(Command(
    "serve", run=cmd_serve, raw=True, epilog=EPILOG,
    options=[
        Option("--export", ExistingDir(hint="give a `kestrel export sam2.1-... --target onnx` folder"),
               help="a `kestrel export --target onnx` folder of SAM 2.1"),
        Option("--model", ModelRef(), help="SAM 2.1 card or save_pretrained directory (exported on first use unless "
                                           "--export is given)"),
        weights_option(),
        Option("--size", PixelSize(), help=f"encoder input size (default: the export's, or {DEFAULT_SIZE}; a "
                                           "multiple of 32)"),
        Option("--encode", Choice(choices=("page", "server")), default="page",
               help="where the encoder runs: in the page (default) or here"),
        Option("--host", Host(), default="127.0.0.1", help="loopback address to bind (default 127.0.0.1)"),
        Option("--port", Port(), default=8765, help="port (default 8765; 0 picks a free one)"),
        Option("--max-upload-mb", PositiveInt(4096, metavar="MB"), default=32,
               help="largest image upload with --encode server, 1 to 4096 (default 32)"),
        Option("--max-upload-pixels", PositiveInt(1 << 31), default=40_000_000,
               help="most pixels in an uploaded image (default 40,000,000)"),
    ]))
