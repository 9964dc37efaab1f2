"""Per-shard task functions of dataset jobs: the code every engine runs, in one process or in a Ray actor.

A :class:`JobSpec` says what to compute (``embed``, ``zero-shot`` or ``segment-everything``) with which
model; it is small and picklable, so an engine ships it to its workers. :func:`open_task` loads the
model once and returns a :class:`ShardTask`, whose :meth:`ShardTask.run` turns a shard's image paths
into an Arrow table, one row per readable image, plus the unreadable ones with the reason. Images are
batched within a shard, ``batch_size`` at a time, exactly as ``kestrel embed`` batches a file list, so
the same images at the same batch size give the same features bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..models import capabilities
from .images import ImageError, load_image

TASKS = ("embed", "zero-shot", "segment-everything")


@dataclass(frozen=True)
class JobSpec:
    """What a dataset job computes. ``revision`` is filled in by :func:`resolve_revision` before the run."""

    task: str
    model: str
    weights: str | None = None
    dtype: str = "f32"
    device: str = "cpu"
    batch_size: int = 8
    size: int | None = None  # square input size (DINOv2), None for the checkpoint's
    pool: str = "cls"  # embed: cls | mean | patch
    labels: tuple[str, ...] = ()  # zero-shot
    template: str | None = None  # zero-shot
    options: tuple[tuple[str, Any], ...] = field(default=())  # task-specific settings (segment-everything)
    revision: str | None = None
    compile: bool = False  # kestrel.load(compile=True): same numbers to ~1e-6, faster on large inputs
    quantize: str | None = None  # "int8": not exact, so it is part of the settings a rerun must match

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose one of {', '.join(TASKS)}")
        if self.batch_size < 1:
            raise ValueError(f"batch size must be positive, got {self.batch_size}")
        if self.task == "zero-shot" and not self.labels:
            raise ValueError("zero-shot needs at least one label")

    def settings(self) -> dict[str, Any]:
        """Everything that changes the numbers (a rerun resumes only with the same settings)."""
        d = asdict(self)
        d["labels"], d["options"] = list(self.labels), dict(self.options)
        return d


def resolve_revision(spec: JobSpec) -> JobSpec:
    """The spec with ``revision`` set: the card's pinned revision, or a sha256 of a directory's weights.

    It also checks, without reading weights, that the model suits the task (zero-shot needs a text tower),
    so that a wrong model fails here rather than in every worker.
    """
    from dataclasses import replace

    from ..models.cards import CardError, family_for_config
    from ..runtime.load import read_config, resolve

    directory, card = resolve(spec.model, spec.weights)
    config = read_config(Path(directory))
    family = family_for_config(config, Path(directory))
    if spec.task == "zero-shot" and not family.capabilities.text:
        raise CardError(f"zero-shot needs an image-text model such as siglip-base-patch16-224; {spec.model} "
                        f"({family.name}) has no text tower")
    if spec.task == "segment-everything" and family.capabilities.segmenter is None:
        raise CardError(f"segment --everything needs a promptable segmentation model such as sam-vit-base or "
                        f"sam2.1-hiera-tiny; {spec.model} is of family {family.name!r}")
    if card is not None and spec.weights is None:
        return replace(spec, revision=card.revision)
    return replace(spec, revision="sha256:" + weights_digest(Path(directory))[:16])


def weights_digest(directory: Path) -> str:
    """sha256 over a checkpoint folder's ``config.json`` and ``*.safetensors`` files, in name order."""
    h = hashlib.sha256()
    for f in sorted([directory / "config.json", *directory.glob("*.safetensors")]):
        if f.is_file():
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
    return h.hexdigest()


@dataclass
class ShardResult:
    """A shard's rows (an Arrow table), its unreadable images ``[(path, reason)]`` and timing."""

    table: Any  # pyarrow.Table
    failures: list[tuple[str, str]]
    seconds: float  # wall time of the shard
    worker: str  # host:pid of the process that ran it
    cpu_seconds: float = 0.0  # CPU time of that process during the shard (all its threads)
    max_rss_mb: float = 0.0  # that process's peak resident memory so far


class ShardTask:
    """A loaded model and the task function it runs on a shard's images."""

    def __init__(self, spec: JobSpec, threads: int | None = None) -> None:
        from ..runtime.load import load
        from .tasks import preprocess_for

        if threads:
            torch.set_num_threads(threads)
        self.spec = spec
        generics = {"Height": spec.size, "Width": spec.size} if spec.size else {}
        self.model = load(spec.model, weights=spec.weights, dtype=spec.dtype, device=spec.device,
                          compile=spec.compile, quantize=spec.quantize, **generics)
        if spec.task == "segment-everything":
            from .segment import segmenter_for

            self.segmenter, self.preprocess = segmenter_for(self.model), None
        else:
            self.preprocess = preprocess_for(self.model)
        # the model's input size (segment-everything: each image's own size, the size of its masks)
        self.height = int(self.model.generics.get("Height", 0))
        self.width = int(self.model.generics.get("Width", 0))
        self.name = spec.model  # the card name, or the checkpoint folder as given
        self.text_embeds: torch.Tensor | None = None
        self._schema: Any = None
        if spec.task == "zero-shot":
            self._prepare_texts()

    def _prepare_texts(self) -> None:
        from ..models.cards import CardError
        from ..std import ops
        from .tokenizer import SiglipTextTokenizer
        from .zero_shot import encode_texts

        if not capabilities.of(self.model).text:
            raise CardError(f"zero-shot needs an image-text model such as siglip-base-patch16-224; "
                            f"{self.model.loaded.name} has no text tower")
        tok = SiglipTextTokenizer.from_dir(self.model.loaded.directory, max_length=self.model.generics["MaxPositions"])
        with torch.inference_mode():
            self.text_embeds = ops.l2_normalize(encode_texts(self.model, list(self.spec.labels), tok,
                                                             self.spec.template))

    def run(self, paths: Sequence[str]) -> ShardResult:
        """Rows for the readable images of ``paths``, batch by batch; the others as failures."""
        import pyarrow as pa

        start, cpu = time.perf_counter(), time.process_time()
        schema = self.schema()
        batches: list[pa.RecordBatch] = []
        failures: list[tuple[str, str]] = []
        for i in range(0, len(paths), self.spec.batch_size):
            good, images = [], []
            for p in paths[i: i + self.spec.batch_size]:
                try:
                    images.append(load_image(p))
                    good.append(p)
                except ImageError as e:
                    failures.append((p, e.reason))
            if images:
                batches.append(pa.RecordBatch.from_pydict(self._columns(good, images), schema=schema))
        table = pa.Table.from_batches(batches, schema=schema)
        worker = f"{os.uname().nodename}:{os.getpid()}"
        return ShardResult(table, failures, time.perf_counter() - start, worker, time.process_time() - cpu,
                           _max_rss_mb())

    @torch.inference_mode()
    def _columns(self, paths: list[str], images: list) -> dict[str, Any]:
        """One batch's columns: path, the task's values, then model, revision and the input size."""
        import pyarrow as pa

        from .tasks import image_features

        n = len(paths)
        common = {"model": [self.name] * n, "revision": [self.spec.revision] * n,
                  "height": [self.height] * n, "width": [self.width] * n}
        if self.spec.task == "segment-everything":
            return {"path": paths, "masks": [self._everything(image) for image in images], **common,
                    "height": [im.height for im in images], "width": [im.width for im in images]}
        p = next(self.model.parameters())
        pixels = self.preprocess(images).to(p.device, p.dtype)  # type: ignore[misc]
        if self.spec.task == "embed":
            feats = image_features(self.model, pixels, self.spec.pool).float().cpu().reshape(n, -1)
            return {"path": paths, "features": _fixed_lists(feats), **common}
        from ..std import ops

        image_embeds = ops.l2_normalize(self.model.image_features(pixels))
        logits = ops.matmul(self.text_embeds, image_embeds.transpose(0, 1))
        logits = logits * ops.exp(self.model.logit_scale) + self.model.logit_bias
        scores = ops.sigmoid(logits.transpose(0, 1)).float().cpu()
        best = [self.spec.labels[k] for k in scores.argmax(1).tolist()]
        return {"path": paths, "scores": _fixed_lists(scores), "label": pa.array(best, pa.string()), **common}

    def _everything(self, image: Any) -> list[dict[str, Any]]:
        """Segment-everything masks of one image as COCO annotations (``segmentation`` in COCO RLE)."""
        from .coco import coco_annotations
        from .mask_generation import generate_masks

        result = generate_masks(self.segmenter, image, **dict(self.spec.options))
        return [{k: v for k, v in ann.items() if k != "id"} for ann in coco_annotations(result)["annotations"]]

    def schema(self) -> Any:
        """The Arrow schema of this task's rows, with the job settings in its metadata."""
        if self._schema is None:
            self._schema = self._make_schema()
        return self._schema

    def _make_schema(self) -> Any:
        import pyarrow as pa

        common = [("model", pa.string()), ("revision", pa.string()), ("height", pa.int32()), ("width", pa.int32())]
        if self.spec.task == "embed":
            fields = [("path", pa.string()), ("features", pa.list_(pa.float32(), self.feature_size())), *common]
        elif self.spec.task == "zero-shot":
            fields = [("path", pa.string()), ("scores", pa.list_(pa.float32(), len(self.spec.labels))),
                      ("label", pa.string()), *common]
        else:
            f64 = pa.float64()
            mask = pa.struct([("segmentation", pa.struct([("size", pa.list_(pa.int32(), 2)), ("counts", pa.string())])),
                              ("area", pa.int64()), ("bbox", pa.list_(f64, 4)), ("predicted_iou", f64),
                              ("stability_score", f64), ("point_coords", pa.list_(pa.list_(f64, 2))),
                              ("crop_box", pa.list_(f64, 4))])
            fields = [("path", pa.string()), ("masks", pa.list_(mask)), *common]
        meta = {"kestrel.job": json.dumps(self.spec.settings())}
        if self.spec.task == "embed":
            meta["kestrel.features_shape"] = json.dumps(list(self.feature_shape()))
        return pa.schema(fields, metadata=meta)

    def feature_shape(self) -> tuple[int, ...]:
        """The shape of one image's features (``(D,)``, or ``(N, D)`` for ``pool="patch"``)."""
        if not hasattr(self, "_feature_shape"):
            from .tasks import image_features

            p = next(self.model.parameters())
            with torch.inference_mode():
                x = torch.zeros(1, 3, self.height, self.width, device=p.device, dtype=p.dtype)
                self._feature_shape = tuple(image_features(self.model, x, self.spec.pool).shape[1:])
        return self._feature_shape

    def feature_size(self) -> int:
        n = 1
        for d in self.feature_shape():
            n *= d
        return n


def _fixed_lists(x: torch.Tensor) -> Any:
    """A ``[N, K]`` float32 tensor as an Arrow ``fixed_size_list<float32>[K]`` array, values copied exactly."""
    import pyarrow as pa

    flat = pa.array(x.contiguous().numpy().reshape(-1), type=pa.float32())
    return pa.FixedSizeListArray.from_arrays(flat, x.shape[1])


def _max_rss_mb() -> float:
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


def open_task(spec: JobSpec, threads: int | None = None) -> ShardTask:
    """Load the spec's model once; the result runs shards (see :class:`ShardTask`)."""
    return ShardTask(spec, threads)
