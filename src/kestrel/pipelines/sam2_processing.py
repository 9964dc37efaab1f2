"""SAM 2.1's processing, one module for ``segment``, ``serve``, dataset jobs and the edge export alike.

**Image.** :func:`preprocess_for` / :func:`pixels`: RGB, resize to ``size x size`` without keeping the
aspect ratio with PIL's bilinear filter (which antialiases when it shrinks), ``/ 255``, ImageNet mean
and std. Upstream's ``Sam2Processor`` resizes with torchvision, which does not run here; this is the
resize Kestrel's users run, and the edge export pre-processes its validation images with this very
function (``preprocessing_outside_graph`` in its manifest), so ``validation.json`` validates it.

**Prompts.** Points, labels and a box to the decoder's fixed-count sparse tokens (:class:`PromptTables`,
:func:`compose`). This is upstream's prompt encoder written out in plain torch over the seed's prompt
tables (the Gaussian Fourier matrix, the point and box-corner embeddings, not-a-point), so a site or an
exported decoder (``decode_tokens``) can build its tokens outside the graph:

* each point: ``[sin, cos](2 pi (2 c - 1) G)`` of its pixel centre ``(p + 0.5) / image``, plus the
  background (label 0) or foreground (label 1) embedding;
* without a box, one not-a-point token after the points (as upstream pads);
* a box: its two corners, each with its corner embedding, then a not-a-point token;
* then not-a-point padding up to ``count``: ``decode_tokens`` masks a not-a-point that directly
  follows another, so the padded prompt decodes exactly as the unpadded one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from ..models.cards.base import IMAGENET_MEAN, IMAGENET_STD
from .images import ImagePreprocess, ImageSource, load_image, to_rgb
from .prompts import PromptError

Point = tuple[float, float]
Box = tuple[float, float, float, float]


def preprocess_for(size: int) -> ImagePreprocess:
    """The SAM 2 image pre-processing at ``size`` px (1024 upstream, 512 the seed's edge size)."""
    return ImagePreprocess(resize=(size, size), shortest_edge=None, crop=None, resample="bilinear",
                           rescale=1 / 255, mean=IMAGENET_MEAN, std=IMAGENET_STD)


def pixels(image: ImageSource | np.ndarray | torch.Tensor, size: int) -> torch.Tensor:
    """The model's input ``[1, 3, size, size]`` f32 from a photo: a path, a PIL image, or RGB uint8 ``[H, W, 3]``."""
    if isinstance(image, torch.Tensor | np.ndarray):
        img = Image.fromarray(np.asarray(image, dtype=np.uint8), mode="RGB")
    elif isinstance(image, Image.Image):
        img = to_rgb(image)
    else:
        img = to_rgb(load_image(image))
    return preprocess_for(size)(img)


@dataclass(frozen=True)
class PromptTables:
    """The seed's ``prompt_*`` tables (float32): what prompt composition needs from the weights."""

    gaussian: torch.Tensor  # [2, Hd / 2]
    point_embed_bg: torch.Tensor  # [Hd]
    point_embed_fg: torch.Tensor  # [Hd]
    box_tl: torch.Tensor  # [Hd]
    box_br: torch.Tensor  # [Hd]
    not_a_point: torch.Tensor  # [Hd]
    image_size: int  # the model input side in pixels (16 E)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> PromptTables:
        """The tables of a loaded SAM 2 model (``prompt_encoder``'s own Fourier matrix and embeddings)."""
        pe = model.point_embed.detach().float()
        return cls(gaussian=model.prompt_positional_embedding.detach().float(), point_embed_bg=pe[0],
                   point_embed_fg=pe[1], box_tl=pe[2], box_br=pe[3],
                   not_a_point=model.not_a_point_embed.detach().float()[0], image_size=16 * model.E)

    @classmethod
    def from_files(cls, tables: dict[str, torch.Tensor], image_size: int) -> PromptTables:
        """The tables as read back from the export's ``prompt_*.bin`` files (keys with or without ``.bin``)."""
        t = {k.removesuffix(".bin"): v for k, v in tables.items()}
        return cls(gaussian=t["prompt_gaussian"], point_embed_bg=t["prompt_point_embed_bg"],
                   point_embed_fg=t["prompt_point_embed_fg"], box_tl=t["prompt_box_tl"], box_br=t["prompt_box_br"],
                   not_a_point=t["prompt_not_a_point"], image_size=image_size)

    def as_files(self) -> dict[str, torch.Tensor]:
        """The tables under the seed's file names (``prompt_gaussian.bin`` ...), without the ``.bin``."""
        return {"prompt_gaussian": self.gaussian, "prompt_point_embed_bg": self.point_embed_bg,
                "prompt_point_embed_fg": self.point_embed_fg, "prompt_box_tl": self.box_tl,
                "prompt_box_br": self.box_br, "prompt_not_a_point": self.not_a_point}


def fourier(tables: PromptTables, pixels: torch.Tensor) -> torch.Tensor:
    """Fourier features ``[..., Hd]`` of pixel coordinates ``[..., 2]`` (x, y) in the model input.

    Computed in float64, term by term, and rounded to float32 once: the page's composer
    (``web/static/composer.js``) does the same arithmetic in JavaScript, so the two agree bit for bit
    (and both stay within float32 rounding of upstream's float32 computation).
    """
    c = 2 * ((pixels.double() + 0.5) / tables.image_size) - 1
    g = tables.gaussian.double()
    angle = 2 * math.pi * (c[..., 0:1] * g[0] + c[..., 1:2] * g[1])
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=-1).float()


def compose(tables: PromptTables, points: Sequence[Point] = (), labels: Sequence[int] = (),
            box: Box | None = None, count: int = 3) -> torch.Tensor:
    """The sparse tokens ``[1, 1, count, Hd]`` of one prompt: ``points`` labelled 1 (foreground) or
    0 (background) and/or one ``box`` ``(x1, y1, x2, y2)``, in pixels of the model input.

    Raises :class:`PromptError` when the prompt needs more than ``count`` tokens (``n + 1`` for
    ``n`` points, 3 for a box, ``n + 3`` for both).
    """
    if len(points) != len(labels):
        raise PromptError(f"{len(points)} points but {len(labels)} labels")
    bad = [lab for lab in labels if lab not in (0, 1)]
    if bad:
        raise PromptError(f"point labels must be 1 (foreground) or 0 (background), got {bad}")
    if not points and box is None:
        raise PromptError("a prompt needs at least one point or a box")
    nap = tables.not_a_point
    tokens: list[torch.Tensor] = []
    if points:
        emb = fourier(tables, torch.tensor(points, dtype=torch.float64))
        kinds = [tables.point_embed_fg if lab == 1 else tables.point_embed_bg for lab in labels]
        tokens += [e + k for e, k in zip(emb, kinds)]
        if box is None:
            tokens.append(nap)
    if box is not None:
        x1, y1, x2, y2 = box
        corners = fourier(tables, torch.tensor([[x1, y1], [x2, y2]], dtype=torch.float64))
        tokens += [corners[0] + tables.box_tl, corners[1] + tables.box_br, nap]
    if len(tokens) > count:
        raise PromptError(f"this prompt needs {len(tokens)} tokens ({len(points)} points"
                          f"{' and a box' if box is not None else ''}), more than the decoder's {count}")
    tokens += [nap] * (count - len(tokens))
    return torch.stack(tokens).reshape(1, 1, count, -1)
