"""SAM 2.1 prompt composition: points, labels and a box to the decoder's fixed-count sparse tokens.

This is upstream's prompt encoder written out in plain torch over the seed's prompt tables (the
Gaussian Fourier matrix, the point and box-corner embeddings, not-a-point), so a site or an exported
decoder (``decode_tokens``) can build its tokens outside the graph:

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

import torch

from ..errors import KestrelError

Point = tuple[float, float]
Box = tuple[float, float, float, float]


class PromptError(KestrelError, ValueError):
    """A prompt that cannot be composed: bad labels, nothing given, or more tokens than the count."""


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
