"""``kestrel site``: build the registry site, and serve it on loopback."""

from __future__ import annotations

import argparse
from pathlib import Path

from .options import Command, ExistingDir, ExistingFile, Option, OutDir, Port, Text, register


def cmd_site(args: argparse.Namespace) -> int:
    """build the model registry site (and serve it on loopback)

    Build a static site: an index with search, and a page per model with its entry graph,
    entries, generics and every block as `inspect` prints them, the card, the parameter
    manifest, a graph per entry and, with --bench, benchmark charts; with --edge, SAM 2.1's
    exported 512 split is copied in and linked from its page. Light and dark themes.
    --serve binds 127.0.0.1 only.
    """
    from ..site.build import build_site
    from ..site.serve import serve

    out = Path(args.out)
    pages = build_site(out, models=args.models or None, bench=Path(args.bench) if args.bench else None,
                       progress=True, edge=Path(args.edge) if args.edge else None)
    print(f"wrote {len(pages)} pages under {out}/ (open {out / 'index.html'})")
    if args.serve:
        serve(out, args.port)
    return 0


register(Command(
    "site", run=cmd_site, raw=True,
    epilog="examples:\n  kestrel site --out site/\n  kestrel site --serve --port 8000\n"
           "  kestrel site --bench results.json   (from bench/run.py --out results.json)\n"
           "  kestrel site --edge edge/           (from kestrel export sam2.1-hiera-tiny --target onnx --size 512 "
           "--out edge/)",
    options=[
        Option("--out", OutDir(), default="site", help="where to write the site (default: site/)"),
        Option("--models", Text(what="card name", metavar="MODEL"), nargs="+",
               help="only these cards (default: every registered model)"),
        Option("--bench", ExistingFile(metavar="FILE"), help="bench/run.py --out results to chart"),
        Option("--edge", ExistingDir(hint="give a `kestrel export sam2.1-... --size 512` folder"),
               help="a SAM 2.1 edge export to copy into the site and link from its card's page"),
        Option("--serve", help="then serve it at http://127.0.0.1:PORT/ until Ctrl-C"),
        Option("--port", Port(), default=8000, help="port for --serve (default 8000; 0 picks a free one)"),
    ]))
