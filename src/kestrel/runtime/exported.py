"""Exported programs, called with their types checked: ``kestrel.exported.load(path)``.

>>> import kestrel.exported
>>> decoder = kestrel.exported.load("out/decode_points.onnx")      # or "out/forward.pte"
>>> decoder.signature.text
'decode_points<B: Dim, Pts: Dim, N: Dim>(image_embeddings: Tensor[B, Hd, 64, 64; T], ...) -> (...)'
>>> masks, iou = decoder(embeddings, points, labels)                # checked, then onnxruntime
>>> decoder(embeddings, points, labels[:, :1])
SignatureError: sam::Model.decode_points (decode_points.onnx): input_labels has Pts = 1, input_points has Pts = 2: ...

An ``.onnx`` file carries its signature in ``metadata_props`` (read through onnxruntime, no other
package needed); a ``.pte`` program's is in the ``manifest.json`` beside it, which ``kestrel export``
writes. Every call binds the entry's generics from its inputs and refuses a mismatch before the
runtime sees it (:meth:`kestrel.runtime.signature.Signature.bind`), then runs onnxruntime's CPU
provider or ``executorch.runtime``, and checks that the outputs have the declared shapes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..blocks.decl import arguments_by_name
from ..errors import KestrelError, import_extra
from ..types.dtypes import from_torch
from .signature import KEY, Signature, SignatureError

MANIFEST = "manifest.json"
TWINS = ("_portable.pte", "_xnnpack.pte")  # what an edge export writes beside a program


class ExportedError(KestrelError, RuntimeError):
    """An exported program that cannot be loaded, or whose outputs break its signature."""


class ExportedProgram:
    """One exported program with its carried signature; call it like the entry it was exported from."""

    def __init__(self, path: Path, signature: Signature, runtime: str, run: Any) -> None:
        self.path = path
        self.signature = signature
        self.runtime = runtime  # "onnxruntime" or "executorch"
        self._run = run

    @property
    def input_names(self) -> list[str]:
        return [p.name for p in self.signature.inputs]

    @property
    def output_names(self) -> list[str]:
        return [p.name for p in self.signature.outputs]

    def __repr__(self) -> str:
        return f"<{self.signature.model} {self.signature.text} from {self.path.name} on {self.runtime}>"

    def inputs(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        """The call's inputs in signature order, as tensors (numpy arrays are taken as they are)."""
        names = self.input_names
        where = f"{self.signature.qualname} ({self.path.name})"
        values = arguments_by_name(names, args, kwargs, f"{where}:", SignatureError, once=True)
        missing = [n for n in names if n not in values]
        if missing:
            raise SignatureError(f"{where}: missing input {', '.join(missing)}")
        out = []
        for n in names:
            v = values[n]
            if isinstance(v, np.ndarray):
                v = torch.from_numpy(v)
            if not isinstance(v, torch.Tensor):
                raise SignatureError(f"{where}: input {n} must be a torch.Tensor or numpy array, "
                                     f"got {type(v).__name__}")
            out.append(v)
        return out

    def bind(self, *args: Any, **kwargs: Any) -> dict[str, int]:
        """Check a call without running it: the entry's generics it binds, or a :class:`SignatureError`."""
        return self._bind(self.inputs(*args, **kwargs))

    def _bind(self, tensors: Sequence[torch.Tensor]) -> dict[str, int]:
        dtypes = []
        for t in tensors:
            try:
                dtypes.append(str(from_torch(t.dtype)))
            except TypeError:
                dtypes.append(str(t.dtype).removeprefix("torch."))
        return self.signature.bind([tuple(t.shape) for t in tensors], dtypes, self.path.name)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
        tensors = self.inputs(*args, **kwargs)
        binding = self._bind(tensors)
        outputs = self._run([t.detach().cpu().contiguous() for t in tensors])
        want = self.signature.output_shapes(binding)
        if len(outputs) != len(want):
            raise ExportedError(f"{self.signature.qualname} ({self.path.name}): the program returned {len(outputs)} "
                                f"outputs, its signature declares {len(want)}")
        for port, out, shape in zip(self.signature.outputs, outputs, want):
            if tuple(out.shape) != shape:
                raise ExportedError(
                    f"{self.signature.qualname} ({self.path.name}): output {port.name} has shape {tuple(out.shape)} "
                    f"at {_said(binding)}, its signature declares {port.type} = {list(shape)}: the exported program "
                    "does not follow its signature (re-export it)")
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _said(binding: dict[str, int]) -> str:
    return ", ".join(f"{k} = {v}" for k, v in binding.items()) or "its fixed shapes"


def load(path: str | os.PathLike[str], *, threads: int | None = None) -> ExportedProgram:
    """An exported ``.onnx`` or ``.pte`` program with its signature, ready to call.

    ``threads`` sets onnxruntime's intra-op threads (default: its own choice). Raises
    :class:`ExportedError` for a file without a Kestrel signature or a runtime that is not installed.
    """
    p = Path(path)
    if not p.is_file():
        raise ExportedError(f"no such file: {p}")
    if p.suffix == ".onnx":
        return _load_onnx(p, threads)
    if p.suffix == ".pte":
        return _load_pte(p)
    raise ExportedError(f"{p}: expected an exported .onnx or .pte program")


def signature_of(path: str | os.PathLike[str]) -> Signature:
    """The signature an ``.onnx`` file carries, or that a ``.pte`` program's manifest gives it."""
    p = Path(path)
    if p.suffix == ".onnx":
        return Signature.from_json(_onnx_metadata(p), str(p))
    return pte_signature(p)


def _onnx_metadata(path: Path) -> str:
    try:
        import onnx
    except ImportError:
        onnx = None  # type: ignore[assignment]
    if onnx is not None:
        try:
            proto = onnx.load(str(path), load_external_data=False)
        except Exception as e:  # a truncated or corrupt file: protobuf's DecodeError, an OSError
            raise _unreadable(path, e) from e
        props = {m.key: m.value for m in proto.metadata_props}
    else:
        props = _session(path, None).get_modelmeta().custom_metadata_map
    if KEY not in props:
        raise ExportedError(f"{path}: this ONNX file carries no Kestrel signature (metadata_props {KEY!r}); "
                            "export it with kestrel export ... --target onnx")
    return props[KEY]


SPIN_ENTRY = "session.intra_op.allow_spinning"


def _session(path: Path, threads: int | None) -> Any:
    ort = import_extra("onnxruntime", error=ExportedError,
                       message="running an .onnx program needs onnxruntime: pip install 'kestrel[export]'")
    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    # onnxruntime's worker threads spin for ~50 ms after a run by default, and whatever torch runs meanwhile in
    # this process (pre- and post-processing, eager entries) shares the cores with them: on one AMD EPYC (2
    # threads) a mask upsampling after SAM's decode took 33.5 ms instead of 14.2, while the decode itself ran
    # 36.9 ms without spinning against 39.4 with it (SigLIP's text tower: 62.8 against 60.8)
    opts.add_session_config_entry(SPIN_ENTRY, "0")
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's own errors for a file it cannot parse or run
        raise _unreadable(path, e) from e


def _unreadable(path: Path, error: Exception) -> ExportedError:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ExportedError(f"{path}: not a readable ONNX program ({first})")


def _load_onnx(path: Path, threads: int | None) -> ExportedProgram:
    session = _session(path, threads)
    meta = session.get_modelmeta().custom_metadata_map
    if KEY not in meta:
        raise ExportedError(f"{path}: this ONNX file carries no Kestrel signature (metadata_props {KEY!r}); "
                            "export it with kestrel export ... --target onnx")
    sig = Signature.from_json(meta[KEY], str(path))
    names = [i.name for i in session.get_inputs()]
    if names != [p.name for p in sig.inputs]:
        raise ExportedError(f"{path}: the program's inputs {names} are not its signature's "
                            f"{[p.name for p in sig.inputs]}")

    def run(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        feed = {n: t.numpy() for n, t in zip(names, inputs)}
        return [torch.from_numpy(np.asarray(o)) for o in session.run(None, feed)]

    return ExportedProgram(path, sig, "onnxruntime", run)


def pte_signature(path: Path) -> Signature:
    """A ``.pte`` program's signature from the ``manifest.json`` beside it (an edge export's
    ``export.programs`` row, its portable or XNNPACK twin included)."""
    manifest_path = path.parent / MANIFEST
    if not manifest_path.is_file():
        raise ExportedError(f"{path}: no {MANIFEST} beside it: a .pte program's signature lives in the manifest "
                            "kestrel export writes")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        raise ExportedError(f"{manifest_path}: not JSON: {e}") from None
    for row in manifest_signatures(manifest):
        if path.name in row["files"]:
            return Signature.from_json(row["signature"], f"{manifest_path} ({path.name})")
    raise ExportedError(f"{path}: {manifest_path} gives no signature for {path.name}")


def manifest_signatures(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every program of an export manifest that carries a signature: ``{"files": [...], "signature": {...}}``
    (an edge manifest's programs with their ``_portable``/``_xnnpack`` twins, or a ``kestrel-onnx``
    manifest's files)."""
    rows: list[dict[str, Any]] = []
    programs = manifest.get("export", {}).get("programs", {}) if isinstance(manifest.get("export"), dict) else {}
    written = list(manifest.get("files", {})) if isinstance(manifest.get("files"), dict) else []
    for name, row in programs.items():
        if isinstance(row, dict) and "signature" in row:
            stem = name.rsplit(".", 1)[0]
            twins = [stem + t for t in TWINS if stem + t in written]
            rows.append({"files": [name, *twins], "signature": row["signature"]})
    if isinstance(manifest.get("files"), list):
        for row in manifest["files"]:
            if isinstance(row, dict) and "signature" in row:
                rows.append({"files": [row.get("file")], "signature": row["signature"]})
    return rows


def _load_pte(path: Path) -> ExportedProgram:
    sig = pte_signature(path)
    try:
        from executorch.runtime import Runtime
    except ImportError:
        raise ExportedError("running a .pte program needs ExecuTorch's Python runtime: pip install "
                            "'kestrel[edge]' (executorch==1.5.1)") from None
    try:
        method = Runtime.get().load_program(str(path)).load_method("forward")
    except Exception as e:
        raise ExportedError(f"{path}: executorch.runtime cannot load it: {type(e).__name__}: {e}") from None

    def run(inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.as_tensor(o).clone() for o in method.execute(list(inputs))]

    return ExportedProgram(path, sig, "executorch", run)


__all__ = ["ExportedError", "ExportedProgram", "SignatureError", "load", "signature_of"]
