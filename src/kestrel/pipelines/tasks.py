"""Task functions behind the CLI: classification and feature extraction from image files."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..blocks import Block
from ..models import capabilities
from .images import ImageError, ImagePreprocess


def preprocess_for(model: Block) -> ImagePreprocess:
    """The checkpoint's image preprocessing, sized to the model's bound ``Height`` x ``Width``."""
    loaded = model.loaded  # type: ignore[attr-defined]
    path = Path(loaded.directory) / "preprocessor_config.json"
    pre = ImagePreprocess.from_file(path) if os.path.lexists(path) else ImagePreprocess.from_config(
        loaded.family.preprocess)
    size = (model.generics["Height"], model.generics["Width"])
    try:
        native = pre.output_size
    except ValueError:
        native = None
    return pre if native == size else pre.with_size(*size)


def _device_dtype(model: Block) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, p.dtype


Skipped = list[tuple[str, str]]  # (path, reason) of each input that could not be read


def _batch_pixels(pre: ImagePreprocess, items: Sequence[Any], skipped: Skipped | None) -> tuple[list[Any], Any]:
    """Pixels of the readable items of one batch, as ``(items kept, uint8 [B, 3, H, W] or None)``.

    With ``skipped=None`` an unreadable image raises :class:`ImageError`; otherwise it is recorded there as
    ``(path, reason)`` and left out.
    """
    kept, pixels = [], []
    for item in items:
        try:
            pixels.append(pre.pixels(item))
        except ImageError as e:
            if skipped is None:
                raise
            skipped.append((e.path, e.reason))
            continue
        kept.append(item)
    return kept, (pre.finish(torch.stack(pixels)) if pixels else None)


@torch.inference_mode()
def classify(model: Block, images: Sequence[Any], top: int = 5, batch_size: int = 8,
             skipped: Skipped | None = None) -> list[tuple[Any, list[tuple[str, float]]]]:
    """``(image, top-k (label, probability))`` for each image, labels from the checkpoint's ``id2label``.

    An unreadable image raises :class:`ImageError`, or with a ``skipped`` list is appended there as
    ``(path, reason)`` and left out of the result.
    """
    pre = preprocess_for(model)
    device, dtype = _device_dtype(model)
    labels = model.loaded.labels  # type: ignore[attr-defined]
    out: list[tuple[Any, list[tuple[str, float]]]] = []
    for i in range(0, len(images), batch_size):
        kept, pixels = _batch_pixels(pre, images[i: i + batch_size], skipped)
        if pixels is None:
            continue
        probs = model.forward(pixels.to(device, dtype)).float().softmax(-1)
        values, indices = probs.topk(min(top, probs.shape[-1]), dim=-1)
        for item, v_row, i_row in zip(kept, values.tolist(), indices.tolist()):
            out.append((item, [(labels.get(k, f"class {k}"), v) for v, k in zip(v_row, i_row)]))
    return out


POOLS = ("cls", "mean", "patch")


def image_features(model: Block, pixels: torch.Tensor, pool: str = "cls") -> torch.Tensor:
    """Features of a batch: the class token, the mean of patch tokens, or all patch tokens.

    The entry is the one the family's capabilities name (``features``): ``image_features`` (SigLIP) is
    already a pooled embedding, whatever ``pool``; the others give tokens, pooled here.
    """
    entry = capabilities.of(model).features or "forward"
    if entry == "image_features":
        return model.image_features(pixels)
    tokens = getattr(model, entry)(pixels)
    if pool == "cls":
        return tokens[:, 0]
    if pool == "mean":
        return tokens[:, 1:].mean(1)
    if pool == "patch":
        return tokens[:, 1:]
    raise ValueError(f"unknown pool {pool!r}; choose one of {', '.join(POOLS)}")


@torch.inference_mode()
def embed_images(model: Block, paths: Sequence[Path], pool: str = "cls", batch_size: int = 8,
                 progress: bool = True, skipped: Skipped | None = None) -> Iterator[tuple[list[Path], torch.Tensor]]:
    """Yield (paths, features) batch by batch, with a progress bar over images.

    An unreadable image raises :class:`ImageError`, or with a ``skipped`` list is appended there as
    ``(path, reason)`` and left out (its batch yields the other paths).
    """
    from tqdm import tqdm

    pre = preprocess_for(model)
    device, dtype = _device_dtype(model)
    bar = tqdm(total=len(paths), unit="img", disable=not progress or len(paths) < 2, desc="embedding")
    for i in range(0, len(paths), batch_size):
        batch = list(paths[i: i + batch_size])
        kept, pixels = _batch_pixels(pre, batch, skipped)
        if pixels is not None:
            yield kept, image_features(model, pixels.to(device, dtype), pool).float().cpu()
        bar.update(len(batch))
    bar.close()
