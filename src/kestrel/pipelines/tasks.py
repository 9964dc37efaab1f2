"""Task functions behind the CLI: classification and feature extraction from image files."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ..blocks import Block
from .images import ImagePreprocess, load_image


def preprocess_for(model: Block) -> ImagePreprocess:
    """The checkpoint's image preprocessing, sized to the model's bound ``Height`` x ``Width``."""
    loaded = model.loaded  # type: ignore[attr-defined]
    path = Path(loaded.directory) / "preprocessor_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else loaded.family.preprocess
    pre = ImagePreprocess.from_config(cfg)
    size = (model.generics["Height"], model.generics["Width"])
    try:
        native = pre.output_size
    except ValueError:
        native = None
    return pre if native == size else pre.with_size(*size)


def _device_dtype(model: Block) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, p.dtype


@torch.inference_mode()
def classify(model: Block, images: Sequence[Any], top: int = 5, batch_size: int = 8) -> list[list[tuple[str, float]]]:
    """Top-``top`` (label, probability) for each image, labels from the checkpoint's ``id2label``."""
    pre = preprocess_for(model)
    device, dtype = _device_dtype(model)
    labels = model.loaded.labels  # type: ignore[attr-defined]
    out: list[list[tuple[str, float]]] = []
    for i in range(0, len(images), batch_size):
        pixels = pre([load_image(x) if isinstance(x, str | Path) else x for x in images[i: i + batch_size]])
        probs = model.forward(pixels.to(device, dtype)).float().softmax(-1)
        values, indices = probs.topk(min(top, probs.shape[-1]), dim=-1)
        for v_row, i_row in zip(values.tolist(), indices.tolist()):
            out.append([(labels.get(k, f"class {k}"), v) for v, k in zip(v_row, i_row)])
    return out


POOLS = ("cls", "mean", "patch")


def image_features(model: Block, pixels: torch.Tensor, pool: str = "cls") -> torch.Tensor:
    """Features of a batch: the class token, the mean of patch tokens, or all patch tokens.

    A model with an ``image_features`` entry (SigLIP) gives its pooled embedding whatever ``pool``.
    """
    if hasattr(model, "image_features"):
        return model.image_features(pixels)
    tokens = model.features(pixels) if hasattr(model, "features") else model.forward(pixels)
    if pool == "cls":
        return tokens[:, 0]
    if pool == "mean":
        return tokens[:, 1:].mean(1)
    if pool == "patch":
        return tokens[:, 1:]
    raise ValueError(f"unknown pool {pool!r}; choose one of {', '.join(POOLS)}")


@torch.inference_mode()
def embed_images(model: Block, paths: Sequence[Path], pool: str = "cls", batch_size: int = 8,
                 progress: bool = True) -> Iterator[tuple[list[Path], torch.Tensor]]:
    """Yield (paths, features) batch by batch, with a progress bar over images."""
    from tqdm import tqdm

    pre = preprocess_for(model)
    device, dtype = _device_dtype(model)
    bar = tqdm(total=len(paths), unit="img", disable=not progress or len(paths) < 2, desc="embedding")
    for i in range(0, len(paths), batch_size):
        batch = list(paths[i: i + batch_size])
        pixels = pre([load_image(p) for p in batch]).to(device, dtype)
        yield batch, image_features(model, pixels, pool).float().cpu()
        bar.update(len(batch))
    bar.close()
