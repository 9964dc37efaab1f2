"""What a fast path costs in accuracy: a model loaded with ``dtype="bf16"`` or ``quantize="int8"`` against the
same checkpoint in f32, on the same seeded inputs, measured the way each family's users see its output.

The metrics follow the family's capabilities (:mod:`kestrel.models.capabilities`), never its name:

    cosine        mean cosine similarity of the features entry's vectors (per token, per item)
    text cosine   the same for the text tower's embeddings (families with one)
    top-1, top-5  share of images whose top class agrees with f32; mean overlap of the top-5 sets (classifiers)
    ranking       zero-shot ranking agreement: per image, the Spearman correlation of its scores over the texts,
                  averaged, and the share of images whose best text agrees (families with a text tower)
    mask IoU      IoU of the post-processed masks (thresholded at the photo's size) against f32, averaged over
                  single-point prompts (promptable segmenters)
    rel diff      max |out - f32| / max |f32| over every output compared

``kestrel bench MODEL --dtype bf16 --accuracy`` prints these for any model; ``bench/accuracy.py`` builds the
README's table from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from ..models import capabilities
from ..runtime.examples import example_inputs
from .prompts import Prompt


@dataclass
class Accuracy:
    """One fast path's agreement with f32: metric name to value (see the module's table), and what was run."""

    metrics: dict[str, float] = field(default_factory=dict)
    inputs: str = ""

    def rel_diff(self, out: torch.Tensor, ref: torch.Tensor) -> None:
        """Keep the largest relative difference seen over the outputs compared."""
        rel = float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
        self.metrics["rel diff"] = max(self.metrics.get("rel diff", 0.0), rel)


# the metrics in the order tables print them
COLUMNS = ("cosine", "text cosine", "top-1", "top-5", "ranking", "ranking top-1", "mask IoU", "rel diff")


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean cosine similarity of the vectors along the last axis (one per token, per item)."""
    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.float().reshape(-1, t.shape[-1]) if t.dim() else t.float().reshape(1, 1)

    return float(F.cosine_similarity(rows(a), rows(b), dim=-1).mean())


def top_k_agreement(logits: torch.Tensor, ref: torch.Tensor, k: int) -> float:
    """Mean share of the f32 top-``k`` classes that the fast path's top-``k`` also holds (k = 1: top-1 agreement)."""
    k = min(k, ref.shape[-1])
    a, b = logits.float().topk(k, dim=-1).indices, ref.float().topk(k, dim=-1).indices
    hits = (a[:, :, None] == b[:, None, :]).any(-1).float().sum(-1) / k
    return float(hits.mean())


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean Spearman rank correlation of the rows of ``a`` and ``b`` (ties broken by position)."""
    ra = a.float().argsort(-1).argsort(-1).double()
    rb = b.float().argsort(-1).argsort(-1).double()
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    corr = (ra * rb).sum(-1) / (ra.norm(dim=-1) * rb.norm(dim=-1)).clamp_min(1e-30)
    return float(corr.mean())


def mask_iou(a: torch.Tensor, b: torch.Tensor) -> float:
    """IoU of two boolean masks (1.0 where both are empty)."""
    union = (a | b).sum()
    return 1.0 if int(union) == 0 else float((a & b).sum() / union)


def test_image(size: int, seed: int) -> Image.Image:
    """A seeded photo-like image: smooth colour fields with edges (noise upsampled from 8 x 8), so that
    segmenters find regions and encoders see structure rather than white noise."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, 8, 8, generator=g)
    smooth = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)[0]
    blocks = F.interpolate(torch.rand(1, 3, 4, 4, generator=g), size=(size, size), mode="nearest")[0]
    pixels = (0.6 * smooth + 0.4 * blocks).clamp(0, 1).mul(255).byte().permute(1, 2, 0).numpy()
    return Image.fromarray(np.ascontiguousarray(pixels))


def measure(reference: torch.nn.Module, fast: torch.nn.Module, batch: int = 16, seed: int = 0,
            prompts: int = 8) -> Accuracy:
    """Compare ``fast`` with ``reference`` (the same checkpoint in f32) on ``batch`` seeded items; see the module."""
    caps = capabilities.of(reference)
    acc = Accuracy()
    with torch.inference_mode():
        if caps.segmenter is not None:
            _segmentation(acc, reference, fast, max(1, min(batch, 4)), seed, prompts)
        if caps.features is not None:
            _vectors(acc, reference, fast, caps.features, batch, seed, "images")
        if caps.serves("classify"):
            _classes(acc, reference, fast, batch, seed)
        if caps.text:
            _ranking(acc, reference, fast, batch, seed)
        if not acc.metrics:  # a family with no declared task: its first entry's outputs
            entry = type(reference).decl().entries[0].name
            _vectors(acc, reference, fast, entry, batch, seed, f"{entry} inputs")
    return acc


def _inputs(model: torch.nn.Module, entry: str, batch: int, seed: int) -> tuple[torch.Tensor, ...]:
    return example_inputs(model, entry, batch, seed)


def cast_inputs(inputs: tuple[torch.Tensor, ...], like: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """Float inputs in the model's own float dtype (a bf16 model takes bf16 images); others unchanged."""
    dtype = next((p.dtype for p in like.parameters() if p.is_floating_point()), torch.float32)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)


def _run(model: torch.nn.Module, entry: str, inputs: tuple[torch.Tensor, ...]) -> Any:
    return getattr(model, entry)(*cast_inputs(inputs, model))


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _vectors(acc: Accuracy, ref: torch.nn.Module, fast: torch.nn.Module, entry: str, batch: int, seed: int,
             what: str) -> None:
    """Cosine and rel diff of ``entry``'s (first) output on ``batch`` seeded inputs."""
    inputs = _inputs(ref, entry, batch, seed)
    a, b = _first(_run(fast, entry, inputs)), _first(_run(ref, entry, inputs))
    acc.metrics["cosine"] = cosine(a, b)
    acc.rel_diff(a, b)
    acc.inputs = f"{batch} seeded {what}"


def _classes(acc: Accuracy, ref: torch.nn.Module, fast: torch.nn.Module, batch: int, seed: int) -> None:
    inputs = _inputs(ref, "forward", batch, seed)
    a, b = _run(fast, "forward", inputs), _run(ref, "forward", inputs)
    acc.metrics["top-1"] = top_k_agreement(a, b, 1)
    acc.metrics["top-5"] = top_k_agreement(a, b, 5)
    acc.rel_diff(a, b)


def _tokens(model: torch.nn.Module, batch: int, seed: int) -> torch.Tensor:
    """Seeded token ids over the whole vocabulary, shaped as ``text_features`` declares."""
    (shape,) = [t.shape for t in example_inputs(model, "text_features", batch, seed)]
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, int(model.generics["Vocab"]), shape, generator=g, dtype=torch.int32)


def _ranking(acc: Accuracy, ref: torch.nn.Module, fast: torch.nn.Module, batch: int, seed: int) -> None:
    images = _inputs(ref, "image_features", batch, seed)
    tokens = _tokens(ref, batch, seed)
    texts: list[torch.Tensor] = []
    scores: list[torch.Tensor] = []
    for model in (fast, ref):
        image = F.normalize(_run(model, "image_features", images).float(), dim=-1)
        text = F.normalize(_run(model, "text_features", (tokens,)).float(), dim=-1)
        texts.append(text)
        scores.append(image @ text.T)
    acc.metrics["text cosine"] = cosine(texts[0], texts[1])
    acc.metrics["ranking"] = spearman(scores[0], scores[1])
    acc.metrics["ranking top-1"] = top_k_agreement(scores[0], scores[1], 1)
    acc.rel_diff(texts[0], texts[1])
    acc.inputs = f"{batch} seeded images x {batch} seeded texts"


def _segmentation(acc: Accuracy, ref: torch.nn.Module, fast: torch.nn.Module, images: int, seed: int,
                  prompts: int) -> None:
    from .segment import segmenter_for

    segmenters = (segmenter_for(fast), segmenter_for(ref))
    ious: list[float] = []
    embeddings: list[float] = []
    rng = np.random.default_rng(seed)
    for i in range(images):
        photo = test_image(320, seed + i)
        points = rng.uniform(16, 304, size=(prompts, 2))
        masks: list[torch.Tensor] = []
        encoded: list[torch.Tensor] = []
        for seg in segmenters:
            emb = seg.encode(photo)
            encoded.append(next(iter(emb.tensors.values())))
            decoded = seg.decode(emb, [Prompt(points=[(float(x), float(y))], labels=[1]) for x, y in points])
            masks.append(seg.postprocess(decoded.low_res, emb))
        embeddings.append(cosine(encoded[0].flatten(2).transpose(1, 2), encoded[1].flatten(2).transpose(1, 2)))
        acc.rel_diff(encoded[0], encoded[1])
        ious += [mask_iou(a, b) for a, b in zip(masks[0].flatten(0, 1), masks[1].flatten(0, 1))]
    acc.metrics["cosine"] = float(np.mean(embeddings))
    acc.metrics["mask IoU"] = float(np.mean(ious))
    acc.inputs = f"{images} seeded 320 x 320 images, {prompts} single-point prompts each"


def cell(metric: str, value: float | None) -> str:
    """A metric as tables print it ("-" where it was not measured)."""
    if value is None:
        return "-"
    return f"{value:.1e}" if metric == "rel diff" else f"{value:.5f}" if "cosine" in metric else f"{value:.3f}"


def row(name: str, option: str, acc: Accuracy) -> list[str]:
    """A table row: the model, the option, then every column of :data:`COLUMNS`."""
    return [name, option, *[cell(k, acc.metrics.get(k)) for k in COLUMNS]]
