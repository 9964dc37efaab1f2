"""Zero-shot image classification with a SigLIP model: images and free-text labels to probabilities.

SigLIP scores every (image, text) pair independently with a sigmoid, so the probabilities of one
image over its candidate texts do not sum to one: each says how likely that text describes the
image. The model is any bound ``siglip.Model`` (``kestrel.load("siglip-base-patch16-224")``), the
tokenizer a :class:`~kestrel.pipelines.tokenizer.SiglipTextTokenizer` and the preprocessing an
:class:`~kestrel.pipelines.images.ImagePreprocess` of the same checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from PIL import Image

from .images import ImagePreprocess, ImageSource
from .tokenizer import SiglipTextTokenizer

DEFAULT_TEMPLATE = "This is a photo of {}."  # the prompt the SigLIP model card uses


def apply_template(texts: Sequence[str], template: str | None) -> list[str]:
    """``template.format(text)`` for each text (``"a photo of {}."``); the texts unchanged without one."""
    if isinstance(texts, str):
        raise TypeError("texts must be a list of strings, not one string")
    if template is None:
        return list(texts)
    if "{}" not in template:
        raise ValueError(f"the template {template!r} has no '{{}}' where the text goes")
    return [template.format(t) for t in texts]


def _placement(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    p = next(model.parameters())
    return p.device, p.dtype


def tokenize(model: torch.nn.Module, texts: Sequence[str], tokenizer: SiglipTextTokenizer,
             template: str | None = None) -> torch.Tensor:
    """Token ids ``[Bt, MaxPositions]`` (i32) on the model's device, after the template."""
    want = getattr(model, "generics", {}).get("MaxPositions")
    if want is not None and tokenizer.max_length != want:
        raise ValueError(f"the tokenizer pads to {tokenizer.max_length} tokens but the model reads {want}: "
                         f"build it with max_length={want}")
    device, _ = _placement(model)
    return tokenizer(apply_template(texts, template)).to(device)


def pixels(model: torch.nn.Module, images: Sequence[ImageSource], preprocess: ImagePreprocess) -> torch.Tensor:
    """Pixels ``[Bi, C, H, W]`` in the model's dtype and on its device."""
    if isinstance(images, str | os.PathLike | Image.Image):  # one image
        images = [images]
    device, dtype = _placement(model)
    return preprocess(list(images)).to(device=device, dtype=dtype)


@torch.inference_mode()
def encode_images(model: torch.nn.Module, images: Sequence[ImageSource], preprocess: ImagePreprocess,
                  normalize: bool = False) -> torch.Tensor:
    """Image features ``[Bi, VisionD]`` (the pooled embeddings; unit length with ``normalize``)."""
    out = model.image_features(pixels(model, images, preprocess))
    return torch.nn.functional.normalize(out, dim=-1) if normalize else out


@torch.inference_mode()
def encode_texts(model: torch.nn.Module, texts: Sequence[str], tokenizer: SiglipTextTokenizer,
                 template: str | None = None, normalize: bool = False) -> torch.Tensor:
    """Text features ``[Bt, TextD]`` (the last token's projection; unit length with ``normalize``)."""
    out = model.text_features(tokenize(model, texts, tokenizer, template))
    return torch.nn.functional.normalize(out, dim=-1) if normalize else out


@torch.inference_mode()
def similarity_table(model: torch.nn.Module, images: Sequence[ImageSource], texts: Sequence[str],
                     tokenizer: SiglipTextTokenizer, preprocess: ImagePreprocess,
                     template: str | None = None) -> torch.Tensor:
    """Logits ``[Bi, Bt]``: row i, column j scores text j against image i (``logits_per_image``)."""
    return model.logits_per_image(pixels(model, images, preprocess), tokenize(model, texts, tokenizer, template))


@torch.inference_mode()
def zero_shot(model: torch.nn.Module, images: Sequence[ImageSource], texts: Sequence[str],
              tokenizer: SiglipTextTokenizer, preprocess: ImagePreprocess,
              template: str | None = None) -> torch.Tensor:
    """Sigmoid probabilities ``[Bi, Bt]`` that text j describes image i (rows need not sum to one)."""
    return model.probabilities(pixels(model, images, preprocess), tokenize(model, texts, tokenizer, template))


__all__ = ["DEFAULT_TEMPLATE", "apply_template", "encode_images", "encode_texts", "pixels", "similarity_table",
           "tokenize", "zero_shot"]
