"""Kestrel: vision foundation models as typed, shape-checked programs.

>>> import kestrel
>>> vit = kestrel.load("vit-base-patch16-224")          # hub at a pinned revision, or weights="dir/"
>>> logits = vit.forward(pixels)                        # Tensor[B, Classes; T], checked at the call
"""

from . import exported  # kestrel.exported.load(path): exported programs, calls checked
from .runtime.load import from_config, load

__version__ = "0.1.0"
__all__ = ["exported", "from_config", "load"]
