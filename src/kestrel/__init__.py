"""Kestrel: vision foundation models as typed, shape-checked programs.

>>> import kestrel
>>> vit = kestrel.load("vit-base-patch16-224")          # hub at a pinned revision, or weights="dir/"
>>> logits = vit.forward(pixels)                        # Tensor[B, Classes; T], checked at the call
>>> for frame, masks in kestrel.track("clip.mp4", "sam2.1-hiera-tiny", prompts):   # SAM 2.1 video
...     ...
"""

from . import exported  # kestrel.exported.load(path): exported programs, calls checked
from .pipelines.video_track import track
from .runtime.load import from_config, load

__version__ = "0.1.0"
__all__ = ["exported", "from_config", "load", "track"]
