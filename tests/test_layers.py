"""The layer order of DESIGN.md, enforced: every import in ``src/kestrel`` (module level and inside functions)
points down the table below or within its own layer, and no modules import each other in a cycle. Also the
source rules that keep contracts explicit (``ops.gelu_`` only on inline temporaries)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# The layers, bottom first: each may import the layers before it (and itself), never one after it.
LAYERS = ("errors", "kernels", "shapes", "types", "blocks", "checker", "std", "models", "runtime", "pipelines",
          "export", "inspect", "cli")
# Applications beside cli: they may import every layer but cli and each other; cli, their command line, may
# import them.
APPLICATIONS = ("site", "web", "scale")
# ``kestrel`` itself is the public face of the runtime and the pipelines (``kestrel.load``, ``kestrel.track``);
# ``kestrel.exported`` (a module beside the packages, re-exporting ``kestrel.runtime.exported``) is the runtime's
ROOT_LAYER = "pipelines"
ROOT_MODULES = {"exported": "runtime"}


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in sorted((SRC / "kestrel").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        if package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, package)
    return out


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, int]]:
    """Every kestrel module ``name`` imports, with the line, at any depth of its code."""
    path, package = MODULES[name]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "kestrel"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if package else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "kestrel":
                continue
            for alias in node.names:  # `from . import kernels` imports the module kestrel.kernels
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in MODULES else target, node.lineno))
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return ROOT_MODULES.get(parts[1], parts[1]) if len(parts) > 1 else ROOT_LAYER


def _allowed(src: str, dst: str) -> bool:
    if src == dst:
        return True
    if dst in APPLICATIONS:
        return src == "cli"
    if dst == "cli":
        return False
    if src in APPLICATIONS:
        return dst in LAYERS
    return LAYERS.index(dst) <= LAYERS.index(src)


def test_every_package_has_a_layer():
    unknown = sorted({_layer(m) for m in MODULES} - set(LAYERS) - set(APPLICATIONS))
    assert not unknown, f"packages without a place in the layer table: {unknown}"


def test_no_import_climbs_the_layers():
    bad = [f"{MODULES[m][0].relative_to(SRC)}:{line}: {m} ({_layer(m)}) imports {t} ({_layer(t)})"
           for m in MODULES for t, line in _imports(m) if not _allowed(_layer(m), _layer(t))]
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    part = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        part.append(top)
                        if top == node:
                            break
                    if len(part) > 1:
                        out.append(sorted(part))
    return out


def test_no_import_cycle():
    graph = {m: {t for t, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_checks_catch_what_they_look_for():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert not _allowed("kernels", "runtime") and not _allowed("blocks", "runtime")
    assert not _allowed("site", "cli") and not _allowed("scale", "web")
    assert _allowed("cli", "site") and _allowed("std", "kernels") and _allowed("web", "pipelines")


def _gelu_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func  # `ops.gelu_(...)` or a bare `gelu_(...)`, not torch's own kernel inside the op
        if (isinstance(f, ast.Name) and f.id == "gelu_") or (
                isinstance(f, ast.Attribute) and f.attr == "gelu_" and isinstance(f.value, ast.Name)
                and f.value.id == "ops"):
            yield node


@pytest.mark.parametrize("name", sorted(m for m in MODULES if _layer(m) in ("models", "std", "pipelines")))
def test_gelu_in_place_takes_only_inline_temporaries(name):
    """``ops.gelu_`` consumes its argument: every call passes a value computed right there (a call or an
    arithmetic expression), never a name or an element the caller may read again."""
    path = MODULES[name][0]
    for call in _gelu_calls(ast.parse(path.read_text())):
        if not call.args:
            continue
        assert isinstance(call.args[0], ast.Call | ast.BinOp), (
            f"{path.relative_to(SRC)}:{call.lineno}: gelu_ overwrites its argument; pass an inline temporary "
            f"(gelu_(self.up(x))), or use ops.gelu")
