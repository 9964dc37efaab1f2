"""Exported programs that keep their types: ``kestrel.exported.load("out/decode_points.onnx")``.

The program's signature (its entry in the seeds' notation, the generics bound, the ``where`` facts,
the dynamic axes) travels in the file; every call is checked against it before onnxruntime or
ExecuTorch runs. See :mod:`kestrel.runtime.exported`.
"""

from .runtime.exported import ExportedError, ExportedProgram, load, signature_of
from .runtime.signature import Signature, SignatureError

__all__ = ["ExportedError", "ExportedProgram", "Signature", "SignatureError", "load", "signature_of"]
