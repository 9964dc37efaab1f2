"""SAM 2.1 promptable segmentation: a photo and points or a box in, masks at the photo's size out.

Pre-processing and prompt tokens are :mod:`kestrel.pipelines.sam2_processing`'s (the edge export uses the
same); prompts are scaled from photo pixels to the model frame per axis, and masks come back by a bilinear
resize of the ``size / 4`` logits to the photo, thresholded at 0. At ``size = 512`` this is the seed's edge
recipe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .images import ImageSource, load_image, to_rgb
from .input_rules import check_prompts_inside
from .prompts import Prompt, PromptError
from .sam2_processing import PromptTables, compose, preprocess_for
from .segmenter import Decoded, ImageEmbedding, model_revision


@dataclass
class Sam2Masks:
    """The answer to one prompt: ``M`` masks (3 with multimask, else 1), best predicted IoU first."""

    logits: torch.Tensor  # [M, 4E, 4E] in the model frame
    iou: torch.Tensor  # [M] predicted IoU
    object_score: float  # the object-score logit (> 0: the prompt hits an object)
    masks: torch.Tensor  # bool [M, H, W] at the photo's size


class Sam2Segmenter:
    """A loaded SAM 2 model (``kestrel.load(..., E=size // 16)``) behind ``kestrel segment``'s
    :class:`~kestrel.pipelines.segment.Segmenter`: encode a photo, decode prompts, post-process."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        loaded = getattr(model, "loaded", None)
        self.name = getattr(loaded, "name", type(model).__name__)
        self.revision = model_revision(model)
        self.size = 16 * int(model.E)
        self.preprocess = preprocess_for(self.size)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    def mask_prompt(self, array: Any, original_size: tuple[int, int]) -> torch.Tensor:
        """SAM 2 here takes no mask prompt."""
        raise PromptError("SAM 2 here takes no mask prompt: drop --mask-input")

    def frame_points(self, points: np.ndarray, original_size: tuple[int, int]) -> np.ndarray:
        """Photo pixels ``[N, 2]`` to the square model frame, each axis scaled on its own (float64)."""
        h, w = original_size
        return points * np.array([self.size / w, self.size / h])[None, :]

    def decode_grid(self, embedding: ImageEmbedding, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The three multimask outputs of ``N`` single foreground points at once, as ``decode_points`` batches them."""
        t = embedding.tensors
        n = points.shape[0]
        with torch.no_grad():
            masks, iou, _ = self.model.decode_points(
                t["image_embeddings"], t["hr0"], t["hr1"], points.reshape(1, n, 1, 2).to(self.device, self.dtype),
                torch.ones(1, n, 1, dtype=torch.int32, device=self.device))
        return masks[0, :, 1:], iou[0, :, 1:]

    def encode(self, image: ImageSource) -> ImageEmbedding:
        img = to_rgb(image if hasattr(image, "getbands") else load_image(image))  # type: ignore[arg-type]
        pixels = self.preprocess(img).to(self.device, self.dtype)
        with torch.no_grad():
            emb, hr0, hr1 = self.model.encode_image(pixels)
        return ImageEmbedding({"image_embeddings": emb, "hr0": hr0, "hr1": hr1}, (img.height, img.width),
                              (self.size, self.size), self.name, self.revision)

    def to_frame(self, xy: Sequence[float], original_size: tuple[int, int]) -> list[float]:
        """Photo pixel coordinates ``(x, y, ...)`` to the model frame (each axis scaled on its own)."""
        h, w = original_size
        return [v * (self.size / (w if i % 2 == 0 else h)) for i, v in enumerate(xy)]

    def decode_one(self, embedding: ImageEmbedding, prompt: Prompt,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """All four masks ``[4, 4E, 4E]``, IoUs ``[4]`` and the object-score logit ``[1]`` of one prompt."""
        prompt.check()
        check_prompts_inside([prompt], embedding.original_size[1], embedding.original_size[0])
        m, t = self.model, embedding.tensors
        emb, hr0, hr1 = t["image_embeddings"], t["hr0"], t["hr1"]
        pts = [self.to_frame(p, embedding.original_size) for p in prompt.points]
        with torch.no_grad():
            if prompt.box is None:
                points = torch.tensor([[pts]], dtype=self.dtype, device=self.device)
                labels = torch.tensor([[list(prompt.labels)]], dtype=torch.int32, device=self.device)
                masks, iou, obj = m.decode_points(emb, hr0, hr1, points, labels)
            else:  # upstream's tokens (points, then the box) through decode_sparse
                if any(lab not in (0, 1) for lab in prompt.labels):
                    raise PromptError(f"SAM 2 with a box takes point labels 1 and 0, got {list(prompt.labels)}")
                box = tuple(self.to_frame(prompt.box, embedding.original_size))
                tokens = compose(PromptTables.from_model(m), [tuple(p) for p in pts], prompt.labels, box,
                                 count=len(pts) + 3)
                masks, iou, obj = m.decode_sparse(emb, hr0, hr1, tokens.to(self.device, self.dtype))
        return masks[0, 0], iou[0, 0], obj[0, 0]

    def decode(self, embedding: ImageEmbedding, prompts: Sequence[Prompt], multimask: bool = False,
               mask_input: torch.Tensor | None = None) -> Decoded:
        """Masks for each prompt: the three multimask outputs, or upstream's single-mask choice."""
        if mask_input is not None:
            raise PromptError("SAM 2 here takes no mask prompt: drop --mask-input")
        low, ious = [], []
        for prompt in prompts:
            masks, iou, _ = self.decode_one(embedding, prompt)
            if multimask:
                masks, iou = masks[1:], iou[1:]
            else:
                with torch.no_grad():
                    one, one_iou = self.model.select_single(masks[None, None], iou[None, None])
                masks, iou = one[0, 0], one_iou[0, 0]
            low.append(masks)
            ious.append(iou)
        return Decoded(torch.stack(low), torch.stack(ious))

    def postprocess(self, low_res: torch.Tensor, embedding: ImageEmbedding,
                    threshold: float | None = 0.0) -> torch.Tensor:
        """Bilinear resize of ``[P, M, h, w]`` logits to the photo, thresholded (Sam2Processor's)."""
        p, m, h, w = low_res.shape
        up = F.interpolate(low_res.reshape(p * m, 1, h, w).float(), size=embedding.original_size, mode="bilinear",
                           align_corners=False).reshape(p, m, *embedding.original_size)
        return up if threshold is None else up > threshold


def segment(model: torch.nn.Module, image: ImageSource, points: Sequence[tuple[float, float]] = (),
            labels: Sequence[int] | None = None, box: tuple[float, float, float, float] | None = None,
            multimask: bool = True) -> Sam2Masks:
    """Segment one photo with one prompt (points default to foreground), masks best predicted IoU first."""
    seg = Sam2Segmenter(model)
    labels = [1] * len(points) if labels is None else labels
    emb = seg.encode(image)
    prompt = Prompt([tuple(p) for p in points], list(labels), box)
    masks, iou, obj = seg.decode_one(emb, prompt)
    if multimask:
        masks, iou = masks[1:], iou[1:]
    else:
        with torch.no_grad():
            one, one_iou = model.select_single(masks[None, None], iou[None, None])
        masks, iou = one[0, 0], one_iou[0, 0]
    order = torch.argsort(iou, descending=True)
    logits, scores = masks[order], iou[order]
    return Sam2Masks(logits, scores, float(obj[0]), seg.postprocess(logits[None], emb)[0])
