"""``kestrel site``: build the registry site, and serve it on loopback."""

from __future__ import annotations

import argparse
from pathlib import Path

from .options import Command, ExistingFile, Option, OutDir, Port, Text, register


def cmd_site(args: argparse.Namespace) -> int:
    from ..site.build import build_site
    from ..site.serve import serve

    out = Path(args.out)
    pages = build_site(out, models=args.models or None, bench=Path(args.bench) if args.bench else None, progress=True)
    print(f"wrote {len(pages)} pages under {out}/ (open {out / 'index.html'})")
    if args.serve:
        serve(out, args.port)
    return 0


register(Command(
    "site", run=cmd_site, help="build the model registry site (and serve it on loopback)", raw=True,
    description="Build a static site: an index with search, and a page per model with its entry graph,\n"
                "entries, generics and every block as `inspect` prints them, the card, the parameter\n"
                "manifest, a graph per entry and, with --bench, benchmark charts. Light and dark themes.\n"
                "--serve binds 127.0.0.1 only.",
    epilog="examples:\n  kestrel site --out site/\n  kestrel site --serve --port 8000\n"
           "  kestrel site --bench results.json   (from bench/run.py --out results.json)",
    options=[
        Option("--out", OutDir(), default="site", help="where to write the site (default: site/)"),
        Option("--models", Text(what="card name", metavar="MODEL"), nargs="+",
               help="only these cards (default: every registered model)"),
        Option("--bench", ExistingFile(metavar="FILE"), help="bench/run.py --out results to chart"),
        Option("--serve", help="then serve it at http://127.0.0.1:PORT/ until Ctrl-C"),
        Option("--port", Port(), default=8000, help="port for --serve (default 8000; 0 picks a free one)"),
    ]))
