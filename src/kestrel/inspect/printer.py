"""Printing a program as the seeds show it: entries, bound generics, and every block.

Everything printed is derived from the declarations (and, for generics, the checkpoint's binding).
"""

from __future__ import annotations

from ..blocks.block import REGISTRY, Block
from ..blocks.decl import BlockDecl, GenericDecl, ParamDecl, SubDecl, format_signature
from ..checker.check import program_blocks
from ..shapes.poly import AtomOrder, Poly, format_poly
from ..types.dtypes import DTypeKind


def format_generic(g: GenericDecl) -> str:
    kind = g.kind.name if isinstance(g.kind, DTypeKind) else g.kind.__name__
    prefix = "*" if kind == "Shape" else ""
    default = f" = {g.default}" if g.default is not None else ""
    return f"{prefix}{g.name}: {kind}{default}"


def format_sub_type(sub: SubDecl, order: AtomOrder) -> str:
    callee = sub.block.decl()
    args = ", ".join(format_poly(a, order) if isinstance(a, Poly) else str(a) for a in sub.args)
    text = f"{callee.name}<{args}>"
    if sub.count is not None:
        text = f"[{text}; {format_poly(sub.count, order)}]"
    return text


_KEYWORD = {"entry": "pub entry", "pub": "pub fn", "private": "fn"}


def format_block(decl: BlockDecl) -> str:
    """One block as ``inspect`` prints it: header, members, functions."""
    generics = ", ".join(format_generic(g) for g in decl.generics)
    lines = [f"{decl.qualname}<{generics}>" if generics else decl.qualname]
    for m in decl.members:
        if isinstance(m, ParamDecl):
            lines.append(f"  param {m.name}: {m.type.format(decl.order)}")
        else:
            lines.append(f"  sub {m.name}: {format_sub_type(m, decl.order)}")
    for fn in decl.functions:
        lines.append(f"  {_KEYWORD[fn.visibility]} {format_signature(fn, decl.order)}")
    return "\n".join(lines)


def program_modules(root: type[Block]) -> list[str]:
    """The kestrel modules a program uses: its blocks' modules and the root's declared imports."""
    mods: dict[str, None] = {}
    for cls in program_blocks(root):
        mods.setdefault(cls._kestrel_module, None)
    for extra in getattr(root, "imports", ()):
        mods.setdefault(extra, None)
    return list(mods)


def listed_blocks(root: type[Block]) -> list[BlockDecl]:
    """Every block of every module the program uses, sorted by name (as the seeds list them)."""
    own = {(c._kestrel_module, c.__name__): c for c in program_blocks(root)}  # blocks built from a config
    classes = [own.get((m, c.__name__), c) for m in program_modules(root) for c in REGISTRY.get(m, [])]
    return sorted((c.decl() for c in classes), key=lambda d: (d.name, d.module))


def format_generics_table(decl: BlockDecl, bound: dict[str, object]) -> list[str]:
    width = max((len(g.name) for g in decl.generics), default=0)
    return [f"  {g.name.ljust(width)}  {bound.get(g.name, '?')}" for g in decl.generics]


def format_program(root: type[Block], bound: dict[str, object] | None = None, title: str | None = None) -> str:
    """The whole listing: entries, generics (as a checkpoint binds them), blocks."""
    decl = root.decl()
    out: list[str] = []
    if title:
        out += [title, ""]
    out.append("Entries")
    out += [f"  {format_signature(fn, decl.order)}" for fn in decl.entries]
    if bound is not None:
        out += ["", "Generics"]
        out += format_generics_table(decl, bound)
    out += ["", "Blocks", ""]
    out.append("\n\n".join(format_block(b) for b in listed_blocks(root)))
    return "\n".join(out)
