"""Standard blocks, declared as the seeds print them."""

from .conv import Conv1d, Conv2d, Conv2dRect
from .embedding import Embedding
from .linear import Linear
from .norm import RmsNorm

__all__ = ["Conv1d", "Conv2d", "Conv2dRect", "Embedding", "Linear", "RmsNorm"]
