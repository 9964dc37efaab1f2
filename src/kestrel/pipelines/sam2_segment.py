"""SAM 2.1 promptable segmentation: a photo and points or a box in, masks at the photo's size out.

Pre-processing is ``Sam2Processor``'s: RGB, resize to ``size x size`` without keeping the aspect
ratio (bilinear), ``/ 255``, ImageNet mean and std; prompts are scaled from photo pixels to the
model frame per axis, and masks come back by a bilinear resize of the ``size / 4`` logits to the
photo, thresholded at 0. At ``size = 512`` this is the seed's edge recipe. (Upstream's processor
resizes with torchvision, which does not run here; Kestrel resizes the 8-bit image with PIL, whose
bilinear filter also antialiases when it shrinks.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .images import ImagePreprocess, ImageSource, load_image, to_rgb

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def preprocess_for(size: int) -> ImagePreprocess:
    """The SAM 2 image pre-processing at ``size`` px (1024 upstream, 512 the seed's edge size)."""
    return ImagePreprocess(resize=(size, size), shortest_edge=None, crop=None, resample="bilinear",
                           rescale=1 / 255, mean=IMAGENET_MEAN, std=IMAGENET_STD)


@dataclass
class Sam2Embedding:
    """``encode_image``'s three tensors for one photo, and the photo's (height, width)."""

    embedding: torch.Tensor  # [1, Hd, E, E]
    hr0: torch.Tensor  # [1, Hd, 4E, 4E]
    hr1: torch.Tensor  # [1, Hd, 2E, 2E]
    original_size: tuple[int, int]


@dataclass
class Sam2Masks:
    """The answer to one prompt: ``M`` masks (3 with multimask, else 1), best predicted IoU first."""

    logits: torch.Tensor  # [M, 4E, 4E] in the model frame
    iou: torch.Tensor  # [M] predicted IoU
    object_score: float  # the object-score logit (> 0: the prompt hits an object)
    masks: torch.Tensor  # bool [M, H, W] at the photo's size


class Sam2Segmenter:
    """A loaded SAM 2 model (``kestrel.load(..., E=size // 16)``) with its pre- and post-processing."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.size = 16 * int(model.E)
        self.preprocess = preprocess_for(self.size)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    def encode(self, image: ImageSource) -> Sam2Embedding:
        img = to_rgb(image if not isinstance(image, str) and hasattr(image, "size") else load_image(image))
        pixels = self.preprocess(img).to(self.device, self.dtype)
        with torch.no_grad():
            emb, hr0, hr1 = self.model.encode_image(pixels)
        return Sam2Embedding(emb, hr0, hr1, (img.height, img.width))

    def to_frame(self, xy: Sequence[float], original_size: tuple[int, int]) -> list[float]:
        """Photo pixel coordinates ``(x, y, ...)`` to the model frame (each axis scaled on its own)."""
        h, w = original_size
        return [v * (self.size / (w if i % 2 == 0 else h)) for i, v in enumerate(xy)]

    def decode(self, emb: Sam2Embedding, points: Sequence[tuple[float, float]] = (), labels: Sequence[int] = (),
               box: tuple[float, float, float, float] | None = None, multimask: bool = True) -> Sam2Masks:
        """Masks for one prompt: ``points`` (photo pixels) labelled 1/0 and/or one ``box`` (x1, y1, x2, y2)."""
        if len(points) != len(labels):
            raise ValueError(f"{len(points)} points but {len(labels)} labels")
        if not points and box is None:
            raise ValueError("give at least one point or a box")
        if any(lab not in (0, 1) for lab in labels):
            raise ValueError(f"point labels must be 1 (foreground) or 0 (background), got {list(labels)}")
        m = self.model
        with torch.no_grad():
            if box is None:
                pts = torch.tensor([[[self.to_frame(p, emb.original_size) for p in points]]], dtype=self.dtype)
                lab = torch.tensor([[list(labels)]], dtype=torch.int32)
                masks, iou, obj = m.decode_points(emb.embedding, emb.hr0, emb.hr1, pts.to(self.device),
                                                  lab.to(self.device))
            else:
                masks, iou, obj = self._decode_box(emb, points, labels, box)
            if multimask:
                masks, iou = masks[:, :, 1:], iou[:, :, 1:]
            else:
                masks, iou = m.select_single(masks, iou)
        order = torch.argsort(iou[0, 0], descending=True)
        logits, scores = masks[0, 0][order], iou[0, 0][order]
        return Sam2Masks(logits, scores, float(obj[0, 0, 0]), self.postprocess(logits, emb.original_size))

    def _decode_box(self, emb, points, labels, box):
        """A box (with optional points): upstream's tokens (points, then the box) through ``decode_sparse``."""
        from .sam2_prompts import PromptTables, compose

        pts = [tuple(self.to_frame(p, emb.original_size)) for p in points]
        frame_box = tuple(self.to_frame(box, emb.original_size))
        tokens = compose(PromptTables.from_model(self.model), pts, labels, frame_box, count=len(pts) + 3)
        return self.model.decode_sparse(emb.embedding, emb.hr0, emb.hr1, tokens.to(self.device, self.dtype))

    def postprocess(self, logits: torch.Tensor, original_size: tuple[int, int]) -> torch.Tensor:
        """Bilinear resize of ``[M, h, w]`` logits to the photo, thresholded at 0 (Sam2Processor's)."""
        up = F.interpolate(logits[None].float(), size=original_size, mode="bilinear", align_corners=False)
        return up[0] > 0.0


def segment(model: torch.nn.Module, image: ImageSource, points: Sequence[tuple[float, float]] = (),
            labels: Sequence[int] | None = None, box: tuple[float, float, float, float] | None = None,
            multimask: bool = True) -> Sam2Masks:
    """Segment one photo with one prompt (points default to foreground)."""
    seg = Sam2Segmenter(model)
    labels = [1] * len(points) if labels is None else labels
    return seg.decode(seg.encode(image), points, labels, box, multimask)
