"""Export: bound models to deployable files, with a manifest each (``export_onnx`` in ``kestrel.export.onnx``).

The exporters import their optional dependencies (onnx, onnxscript) only when called.
"""
