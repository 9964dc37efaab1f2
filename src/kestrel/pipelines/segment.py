"""Promptable segmentation, family-neutral: encode an image once, decode prompts, masks at the photo's size.

A :class:`Segmenter` is what ``kestrel segment`` and :func:`~kestrel.pipelines.mask_generation.generate_masks`
use; a family plugs in by implementing it (``SamSegmenter`` here) and registering a factory in
:data:`SEGMENTERS` under its card family name. An :class:`ImageEmbedding` carries the encoder's
tensors with the sizes post-processing needs and can be saved to (and reloaded from) safetensors, so
a further prompt on the same image costs only the decoder.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..errors import KestrelError
from .images import ImageSource
from .sam_processing import Prompt, PromptError, SamImageProcessor, prompt_tensors

EMBEDDING_FORMAT = "kestrel.segment.embedding/1"


class EmbeddingError(KestrelError, ValueError):
    """An embeddings file that belongs to another model, revision or image, or is not one."""


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
    processor: SamImageProcessor  # longest_edge, scale_coords, mask_prompt (SAM 2 shares the conventions)

    def encode(self, image: ImageSource) -> ImageEmbedding: ...

    def decode(self, embedding: ImageEmbedding, prompts: Sequence[Prompt], multimask: bool = False,
               mask_input: torch.Tensor | None = None) -> Decoded: ...

    def decode_tensors(self, embedding: ImageEmbedding, points: torch.Tensor | None, labels: torch.Tensor | None,
                       boxes: torch.Tensor | None, mask_input: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every mask output ``[P, 1 + 3, h, w]`` and IoU ``[P, 1 + 3]`` (single first) for model-frame prompts."""
        ...

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


def _sam2_segmenter(model: torch.nn.Module) -> Segmenter:
    from .sam2_segment import Sam2Segmenter

    return Sam2Segmenter(model)


SEGMENTERS: dict[str, Callable[[torch.nn.Module], Segmenter]] = {"sam": SamSegmenter, "sam2": _sam2_segmenter}


def segmenter_for(model: torch.nn.Module) -> Segmenter:
    """The :class:`Segmenter` of a loaded model, by its card family."""
    loaded = getattr(model, "loaded", None)
    name = loaded.family.name if loaded is not None else None
    if name not in SEGMENTERS:
        known = ", ".join(sorted(SEGMENTERS))
        what = loaded.name if loaded is not None else type(model).__name__
        raise PromptError(f"segmentation needs a promptable segmentation model (family {known}); "
                          f"{what} is of family {name!r}")
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
