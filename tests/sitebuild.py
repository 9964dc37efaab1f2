"""One registry site per test session (building it checks every program and runs Graphviz per entry)."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from html.parser import HTMLParser
from pathlib import Path

from kestrel.models.cards import CARDS


@functools.cache
def built_site() -> Path:
    from kestrel.site import build_site

    tmp = Path(tempfile.mkdtemp(prefix="kestrel-site-"))
    atexit.register(shutil.rmtree, tmp, True)
    build_site(tmp / "site", models=list(CARDS))
    return tmp / "site"


class PageText(HTMLParser):
    """A page read back as the reader sees it: tables (rows of cell texts) and block listings, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[tuple[str, object]] = []  # ("table", (class, rows)) | ("block", text) | ("figure", id)
        self._table: tuple[str, list[list[str]]] | None = None
        self._row: list[str] | None = None
        self._cell: list[str] | None = None
        self._pre: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "table":
            self._table = (a.get("class") or "", [])
        elif tag == "tr" and self._table is not None:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        elif tag == "pre" and "block-text" in (a.get("class") or ""):
            self._pre = []
        elif tag == "figure":
            self.items.append(("figure", a.get("id")))

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None and self._table is not None:
            self._table[1].append(self._row)
            self._row = None
        elif tag == "table" and self._table is not None:
            self.items.append(("table", self._table))
            self._table = None
        elif tag == "pre" and self._pre is not None:
            self.items.append(("block", "".join(self._pre)))
            self._pre = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._pre is not None:
            self._pre.append(data)


def read_page(path: Path) -> PageText:
    p = PageText()
    p.feed(path.read_text())
    return p
