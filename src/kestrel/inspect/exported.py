"""``kestrel inspect model.onnx`` (or a ``.pte``, or an export's ``manifest.json``): the signatures the
exported programs carry, printed as the seeds print entries, with the generics as bound (dynamic
ones marked), the ``where`` facts and each input's and output's bound shape.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..runtime.exported import manifest_signatures, signature_of
from ..runtime.signature import Signature

SUFFIXES = (".onnx", ".pte", ".json")


def is_export_file(name: str) -> bool:
    """Whether ``kestrel inspect NAME`` means an exported program or manifest (a file of those kinds)."""
    return Path(name).suffix in SUFFIXES and Path(name).is_file()


def exported_signatures(path: str | os.PathLike[str]) -> list[tuple[list[str], Signature]]:
    """(files, signature) of every program the file describes: one for a program, all of a manifest's."""
    p = Path(path)
    if p.suffix in (".onnx", ".pte"):
        return [([p.name], signature_of(p))]
    try:
        manifest = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{p}: not JSON: {e}") from None
    rows = manifest_signatures(manifest) if isinstance(manifest, dict) else []
    if not rows:
        raise UsageError(f"{p}: no program in it carries a Kestrel signature (is it an export's manifest.json, "
                         "written by this version of kestrel export?)")
    return [([f for f in r["files"] if f], Signature.from_json(r["signature"], f"{p}: {r['files'][0]}")) for r in rows]


def format_exported(files: list[str], sig: Signature) -> str:
    """One program: which files, the entry as the seeds print it, generics, where facts, bound ports."""
    out = [f"{', '.join(files)}: {sig.qualname}, exported with its signature", "",
           "Entries", f"  {sig.text}", "", "Generics"]
    rows: list[tuple[str, str]] = [(k, str(v)) for k, v in sig.bound.items()]
    rows += [(n, "dynamic") if n in sig.dynamic else (n, f"{sig.fixed[n]} (fixed at export)") for n, _ in sig.generics]
    width = max((len(k) for k, _ in rows), default=0)
    out += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    if sig.where:
        out += ["", "Where", f"  {', '.join(sig.where)}"]
    out += ["", "Inputs and outputs (bound)"]
    ports = [*sig.inputs, *sig.outputs]
    width = max((len(p.name) for p in ports), default=0)
    for kind, group in (("in ", sig.inputs), ("out", sig.outputs)):
        out += [f"  {kind} {p.name.ljust(width)}  Tensor[{', '.join(map(str, p.shape))}; {p.dtype}]" for p in group]
    return "\n".join(out)


def inspect_exported(path: str, as_json: bool = False) -> str:
    """What ``kestrel inspect FILE`` prints for an exported file."""
    found = exported_signatures(path)
    if as_json:
        docs: list[dict[str, Any]] = [{"files": files, **sig.to_json()} for files, sig in found]
        return json.dumps(docs[0] if len(docs) == 1 and not path.endswith(".json") else docs, indent=2)
    return ("\n\n" + "=" * 100 + "\n\n").join(format_exported(files, sig) for files, sig in found)
