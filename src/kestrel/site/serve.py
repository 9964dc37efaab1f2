"""Serving a built site on loopback only."""

from __future__ import annotations

import functools
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

LOOPBACK = "127.0.0.1"


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def make_server(root: Path, port: int = 8000, quiet: bool = True) -> ThreadingHTTPServer:
    """A threaded static server for ``root`` bound to 127.0.0.1 (``port`` 0 picks a free one)."""
    handler = functools.partial(_Quiet if quiet else SimpleHTTPRequestHandler, directory=str(root))
    return ThreadingHTTPServer((LOOPBACK, port), handler)


def serve(root: Path, port: int = 8000) -> None:
    """Serve until interrupted, printing the address."""
    server = make_server(root, port, quiet=False)
    host, bound = server.server_address[:2]
    print(f"serving {root} at http://{host}:{bound}/ (loopback only; Ctrl-C stops)", flush=True)
    serve_until_interrupted(server)


def serve_until_interrupted(server: ThreadingHTTPServer) -> None:
    """Serve until Ctrl-C, then close the socket (``kestrel site --serve`` and ``kestrel serve``)."""
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
