"""Promptable segmentation: SAM's :class:`Segmenter`, the segmenter of a loaded model, embeddings on disk.

A family plugs in by implementing :class:`~kestrel.pipelines.segmenter.Segmenter` and registering it in
:data:`SEGMENTERS` under the name its card's capabilities give (``segmenter="sam2"``). An
:class:`ImageEmbedding` can be saved to (and reloaded from) safetensors, so a further prompt on the same
image costs only the decoder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import KestrelError
from ..models import capabilities
from .images import ImageSource
from .prompts import Prompt, PromptError
from .sam2_segment import Sam2Segmenter
from .sam_processing import SamImageProcessor, preprocess_shape, prompt_tensors
from .segmenter import Decoded, ImageEmbedding, Segmenter, model_revision

EMBEDDING_FORMAT = "kestrel.segment.embedding/1"


class EmbeddingError(KestrelError, ValueError):
    """An embeddings file that belongs to another model, revision or image, or is not one."""


# ------------------------------------------------------------------------------------------- SAM


class SamSegmenter:
    """SAM (``sam-vit-base/large/huge`` and any ``save_pretrained`` SamModel) behind :class:`Segmenter`."""

    def __init__(self, model: torch.nn.Module, processor: SamImageProcessor | None = None) -> None:
        self.model = model
        loaded = getattr(model, "loaded", None)
        self.name = getattr(loaded, "name", type(model).__name__)
        self.revision = model_revision(model)
        self.processor = processor or SamImageProcessor.from_dir(getattr(loaded, "directory", None))
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    def encode(self, image: ImageSource) -> ImageEmbedding:
        item = self.processor(image)
        with torch.no_grad():
            emb = self.model.encode_image(item.pixel_values.to(self.device, self.dtype))
        return ImageEmbedding({"image_embeddings": emb}, item.original_size, item.reshaped_input_size,
                              self.name, self.revision)

    def mask_prompt(self, array: Any, original_size: tuple[int, int]) -> torch.Tensor:
        return self.processor.mask_prompt(array, original_size)

    def frame_points(self, points: np.ndarray, original_size: tuple[int, int]) -> np.ndarray:
        """Photo pixels to the frame of the longest-edge resize (float64, as upstream)."""
        ch, cw = original_size
        nh, nw = preprocess_shape(ch, cw, self.processor.longest_edge)
        return points * np.array([nw / cw, nh / ch])[None, :]

    def decode_grid(self, embedding: ImageEmbedding, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = points.shape[0]
        masks, iou = self.decode_tensors(embedding, points.reshape(1, n, 1, 2),
                                         torch.ones(1, n, 1, dtype=torch.int32), None)
        return masks[:, 1:], iou[:, 1:]

    def decode(self, embedding: ImageEmbedding, prompts: Sequence[Prompt], multimask: bool = False,
               mask_input: torch.Tensor | None = None) -> Decoded:
        """Decode the prompts of one image; ``mask_input`` is ``[1, 1, 256, 256]`` logits (one per image)."""
        t = prompt_tensors(prompts, embedding.original_size, self.processor)
        masks, iou = self.decode_tensors(embedding, t.points, t.labels, t.boxes, mask_input)
        return _select(masks, iou, multimask)

    def decode_tensors(self, embedding: ImageEmbedding, points: torch.Tensor | None, labels: torch.Tensor | None,
                       boxes: torch.Tensor | None, mask_input: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """All four masks and IoUs ``[P, 4, 256, 256]``, ``[P, 4]`` for prompts in the model frame."""
        m = self.model
        emb = embedding.tensors["image_embeddings"]
        cast = dict(device=self.device, dtype=self.dtype)
        with torch.no_grad():
            sparse = []
            if points is not None:
                assert labels is not None
                if boxes is None:  # as upstream: a "not a point" closes a prompt that has no box
                    points = torch.cat([points, points.new_zeros(*points.shape[:2], 1, 2)], dim=2)
                    labels = torch.cat([labels, labels.new_full((*labels.shape[:2], 1), -1)], dim=2)
                sparse.append(m.embed_points(points.to(**cast), labels.to(self.device, torch.int32)))
            if boxes is not None:
                sparse.append(m.embed_boxes(boxes.to(**cast)))
            if mask_input is not None:
                if tuple(mask_input.shape) != (1, 1, 256, 256):
                    raise PromptError(f"mask prompt: expected logits [1, 1, 256, 256], got {tuple(mask_input.shape)}")
                dense = m.embed_masks(mask_input.to(**cast))
            else:
                dense = m.no_mask_embeddings(emb)
            masks, iou = m.decode(emb, torch.cat(sparse, dim=2), dense)
        return masks[0], iou[0]

    def postprocess(self, low_res: torch.Tensor, embedding: ImageEmbedding,
                    threshold: float | None = 0.0) -> torch.Tensor:
        return self.processor.post_process_masks(low_res, embedding.original_size, embedding.input_size, threshold)


def _select(masks: torch.Tensor, iou: torch.Tensor, multimask: bool) -> Decoded:
    """Upstream's ``multimask_output``: the three multimask outputs, or the single-mask one."""
    sl = slice(1, None) if multimask else slice(0, 1)
    return Decoded(masks[:, sl], iou[:, sl])


# capabilities.segmenter -> the pipeline that implements it
SEGMENTERS: dict[str, Callable[[torch.nn.Module], Segmenter]] = {"sam": SamSegmenter, "sam2": Sam2Segmenter}


def segmenter_for(model: torch.nn.Module) -> Segmenter:
    """The :class:`Segmenter` of a loaded model, as its card's capabilities name it."""
    name = capabilities.of(model).segmenter
    if name is None:
        loaded = getattr(model, "loaded", None)
        what = loaded.name if loaded is not None else type(model).__name__
        family = loaded.family.name if loaded is not None else None
        raise PromptError(f"segmentation needs a promptable segmentation model such as sam-vit-base or "
                          f"sam2.1-hiera-tiny; {what} is of family {family!r}")
    return SEGMENTERS[name](model)


# ------------------------------------------------------------------------------------ embeddings


def save_embedding(embedding: ImageEmbedding, path: str | os.PathLike[str]) -> None:
    """Write the embedding as safetensors (model, revision, sizes, image digest in the metadata), atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    meta = {"format": EMBEDDING_FORMAT, "model": embedding.model, "revision": embedding.revision,
            "original_size": json.dumps(list(embedding.original_size)),
            "input_size": json.dumps(list(embedding.input_size)), "image_sha256": embedding.image_digest}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        save_file({k: v.detach().float().cpu().contiguous() for k, v in embedding.tensors.items()}, str(tmp),
                  metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_embedding(path: str | os.PathLike[str], segmenter: Segmenter, digest: str) -> ImageEmbedding:
    """Read an embedding written by :func:`save_embedding`; refuse one of another model, revision or image."""
    from safetensors import safe_open

    from .readers import ReadError, check_safetensors

    path = Path(path)
    try:
        check_safetensors(path)  # a FIFO, a folder, a cut or foreign file: named before safetensors reads it
    except ReadError as e:
        raise EmbeddingError(f"{e.path}: not a readable safetensors embeddings file ({e.reason})") from None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise EmbeddingError(f"{path}: not a readable safetensors embeddings file ({e})") from None
    if meta.get("format") != EMBEDDING_FORMAT:
        raise EmbeddingError(f"{path}: not a kestrel segment embeddings file (format {meta.get('format')!r})")
    for key, want in (("model", segmenter.name), ("revision", segmenter.revision)):
        if meta.get(key) != want:
            raise EmbeddingError(f"{path}: embeddings of {key} {meta.get(key)!r}, this run uses {want!r}; "
                                 "delete the file or give another --embeddings path")
    if meta.get("image_sha256") != digest:
        raise EmbeddingError(f"{path}: embeddings of another image (or the image changed since); delete the file "
                             "or give another --embeddings path")
    p = next(segmenter.model.parameters())  # type: ignore[attr-defined]
    return ImageEmbedding({k: v.to(p.device, p.dtype) for k, v in tensors.items()},
                          tuple(json.loads(meta["original_size"])), tuple(json.loads(meta["input_size"])),
                          meta["model"], meta["revision"], digest)
