"""``kestrel site``: build the registry site, and serve it on loopback."""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_site(args: argparse.Namespace) -> int:
    from ..site.build import build_site
    from ..site.serve import serve

    out = Path(args.out)
    pages = build_site(out, models=args.models or None, bench=args.bench, progress=True)
    print(f"wrote {len(pages)} pages under {out}/ (open {out / 'index.html'})")
    if args.serve:
        serve(out, args.port)
    return 0


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port is a number from 0 to 65535, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a number from 0 to 65535, got {port}")
    return port


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "site", help="build the model registry site (and serve it on loopback)",
        description="Build a static site: an index with search, and a page per model with its entry graph,\n"
                    "entries, generics and every block as `inspect` prints them, the card, the parameter\n"
                    "manifest, a graph per entry and, with --bench, benchmark charts. Light and dark themes.\n"
                    "--serve binds 127.0.0.1 only.",
        epilog="examples:\n  kestrel site --out site/\n  kestrel site --serve --port 8000\n"
               "  kestrel site --bench results.json   (from bench/run.py --out results.json)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="site", metavar="DIR", help="where to write the site (default: site/)")
    p.add_argument("--models", nargs="+", metavar="MODEL", help="only these cards (default: every registered model)")
    p.add_argument("--bench", type=Path, metavar="FILE", help="bench/run.py --out results to chart")
    p.add_argument("--serve", action="store_true", help="then serve it at http://127.0.0.1:PORT/ until Ctrl-C")
    p.add_argument("--port", type=_port, default=8000, help="port for --serve (default 8000; 0 picks a free one)")
    p.set_defaults(run=cmd_site)
