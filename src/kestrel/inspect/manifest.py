"""The parameter manifest of a bound program, and the JSON form of a listing."""

from __future__ import annotations

from typing import Any

from ..blocks import Block, parameter_manifest
from ..blocks.block import bind_generics
from .printer import format_block, format_signature, listed_blocks


def parameter_rows(root: type[Block], generics: dict[str, Any]) -> list[dict[str, Any]]:
    """Every parameter path with its shape after binding, its dtype, and whether it is optional."""
    return [
        {"path": path, "shape": list(shape), "dtype": str(dtype), "optional": optional}
        for path, shape, dtype, optional in parameter_manifest(root, generics)
    ]


def format_parameters(root: type[Block], generics: dict[str, Any]) -> str:
    rows = parameter_rows(root, generics)
    width = max((len(r["path"]) for r in rows), default=0)
    lines = []
    total = 0
    for r in rows:
        count = 1
        for s in r["shape"]:
            count *= s
        total += count
        shape = "[" + ", ".join(map(str, r["shape"])) + "]"
        lines.append(f"  {r['path'].ljust(width)}  {shape}{'?' if r['optional'] else ''}  {r['dtype']}")
    lines.append(f"\n  {len(rows)} parameters, {total:,} values")
    return "\n".join(lines)


def program_json(root: type[Block], generics: dict[str, Any], name: str) -> dict[str, Any]:
    decl = root.decl()
    bound = bind_generics(decl, generics)
    return {
        "model": name,
        "root": decl.qualname,
        "entries": [{"name": fn.name, "signature": format_signature(fn, decl.order)} for fn in decl.entries],
        "generics": {k: (v if isinstance(v, int) else str(v)) for k, v in bound.items()},
        "blocks": [{"name": b.qualname, "text": format_block(b)} for b in listed_blocks(root)],
        "parameters": parameter_rows(root, generics),
    }
