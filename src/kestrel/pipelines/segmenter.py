"""The family-neutral promptable segmentation interface: what ``kestrel segment``, ``serve``, dataset jobs and
:func:`~kestrel.pipelines.mask_generation.generate_masks` use, whatever the family.

A :class:`Segmenter` encodes an image once into an :class:`ImageEmbedding` (the encoder's tensors with the
sizes post-processing needs), decodes prompts into :class:`Decoded` masks, decodes a grid of single points
for segment-everything and post-processes masks to the photo's size. ``SamSegmenter``
(:mod:`~kestrel.pipelines.segment`) and ``Sam2Segmenter`` (:mod:`~kestrel.pipelines.sam2_segment`) implement it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from .images import ImageSource
from .prompts import Prompt


@dataclass
class ImageEmbedding:
    """The encoder's output for one image, with the sizes post-processing needs."""

    tensors: dict[str, torch.Tensor]  # SAM: {"image_embeddings": [1, Hd, 64, 64]}
    original_size: tuple[int, int]  # (height, width) of the photo
    input_size: tuple[int, int]  # (height, width) of the resized photo inside the model frame
    model: str  # the model's name (card or directory) and revision, to refuse a foreign file
    revision: str
    image_digest: str = ""  # sha256 of the image's pixels, to refuse a stale file


@dataclass
class Decoded:
    """Masks for ``P`` prompts, ``M`` masks each (1, or 3 with multimask), best first within a prompt."""

    low_res: torch.Tensor  # float logits [P, M, h, w] in the model frame
    iou: torch.Tensor  # predicted IoU [P, M]
    masks: torch.Tensor | None = None  # bool [P, M, H, W] at the photo's size, once post-processed


class Segmenter(Protocol):
    """What a promptable segmentation family provides."""

    name: str
    revision: str

    def encode(self, image: ImageSource) -> ImageEmbedding: ...

    def mask_prompt(self, array: Any, original_size: tuple[int, int]) -> torch.Tensor:
        """A previous low-resolution mask (``--mask-input``) as the decoder's mask prompt; PromptError where the
        family takes none."""
        ...

    def frame_points(self, points: np.ndarray, original_size: tuple[int, int]) -> np.ndarray:
        """Photo pixel coordinates ``[N, 2]`` (x, y) to the model frame (float64)."""
        ...

    def decode_grid(self, embedding: ImageEmbedding, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The three multimask outputs ``[N, 3, h, w]`` and IoUs ``[N, 3]`` of ``N`` single foreground points
        ``[N, 2]`` in the model frame (segment-everything's grid)."""
        ...

    def decode(self, embedding: ImageEmbedding, prompts: Sequence[Prompt], multimask: bool = False,
               mask_input: torch.Tensor | None = None) -> Decoded: ...

    def postprocess(self, low_res: torch.Tensor, embedding: ImageEmbedding,
                    threshold: float | None = 0.0) -> torch.Tensor: ...


def model_revision(model: torch.nn.Module) -> str:
    """The card's pinned revision, or for a local directory a digest of its config and weight files."""
    loaded = getattr(model, "loaded", None)
    if loaded is None:
        return "unknown"
    if loaded.card is not None:
        return loaded.card.revision
    h = hashlib.sha256(json.dumps(loaded.config, sort_keys=True, default=str).encode())
    for f in sorted(Path(loaded.directory).glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return "local-" + h.hexdigest()[:16]


def image_digest(image: Any) -> str:
    """sha256 of an image's RGB pixels and size (what the embedding depends on)."""
    from PIL import Image

    from .images import load_image, to_rgb

    img = image if isinstance(image, Image.Image) else load_image(image)
    img = to_rgb(img)
    h = hashlib.sha256(f"{img.width}x{img.height}".encode())
    h.update(img.tobytes())
    return h.hexdigest()
