"""Seed 002: SAM 2.1 split into an encoder program and a decoder program for the edge.

>>> model = kestrel.load("sam2-dir/", E=32)                 # 512 px: the embedding side E = 512 / 16
>>> export_edge(model, "out/", target="executorch-webgpu")

- ``sam2_encoder``: ``encode_image``: normalised pixels ``[1, 3, 16E, 16E]`` to the image embedding
  (no-memory embedding added) and the two high-resolution features before ``conv_s0`` / ``conv_s1``;
- ``sam2_decoder``: ``decode_tokens`` with a fixed number of prompt tokens (3): image embedding,
  image positional embedding, sparse tokens, dense embedding, the two features; the three multimask
  logits ``[1, 3, 4E, 4E]``, their IoU scores and the object-score logit.

Pre-processing happens outside the graph and is ``kestrel segment``'s own
(:func:`kestrel.pipelines.sam2_processing.pixels`: PIL's antialiased bilinear resize, ImageNet
statistics); validation pre-processes its photo-like sample, which is not square and larger than the
input, with it, so ``validation.json`` checks what users run.

The page composes the sparse tokens from the prompt tables (``prompt_*.bin``, little-endian f32):
the Gaussian Fourier table, the point/box-corner embeddings and the not-a-point embedding; the image
positional embedding and the dense (no-mask) embedding are tables too. :func:`compose_tokens` is that
composition (``kestrel.pipelines.sam2_processing``), and validation composes from the written ``.bin``
files, as a page would.

Validation (``validation.json``) runs the CPU programs end to end on a photo-like image and several
prompts and compares them with Kestrel eager and with transformers ``Sam2Model`` at the same size
(``image_size`` overridden), on the unpadded prompt.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..pipelines.prompts import Prompt
from ..pipelines.sam2_processing import PromptTables, compose, pixels
from . import manifest as mf
from . import validation as val
from .executorch import SDPA_REWRITE
from .recipe import Recipe, read_table, upstream_of

TOKENS = 3
NOT_A_POINT, PADDING = -1, -10


class Sam2Encoder(nn.Module):
    """``encode_image`` as a program: pixels -> (image_embeddings, hr0, hr1)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(self.model.encode_image(pixels))  # type: ignore[return-value]


class Sam2Decoder(nn.Module):
    """``decode_tokens`` for one prompt as a program: masks come out as ``[B, 3, 4E, 4E]``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, image_embeddings: torch.Tensor, image_pe: torch.Tensor, sparse: torch.Tensor,
                dense: torch.Tensor, hr0: torch.Tensor, hr1: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        masks, iou, obj = self.model.decode_tokens(image_embeddings, image_pe, sparse, dense, hr0, hr1)
        b, pts, k, h, w = masks.shape
        return masks.reshape(b, pts * k, h, w), iou, obj


def split_signatures(model: Any, tokens: int = TOKENS) -> tuple[dict[str, Any], dict[str, Any]]:
    """The signatures the two programs carry (``kestrel.exported.load``, the page's checks): the
    entries ``encode_image`` and ``decode_tokens`` at ``B = 1``, ``Pts = 1``, ``N = tokens``, the
    decoder's masks merged as :class:`Sam2Decoder` returns them."""
    from ..runtime.signature import entry_signature
    from ..types.tensor import TensorType

    decl = type(model).decl()
    encode, decode = decl.function("encode_image"), decl.function("decode_tokens")
    masks, *rest = decode.result.items
    b, pts, k, h, w = masks.dims
    merged = TensorType((b, pts * k, h, w), masks.dtype)
    enc = entry_signature(model, encode, (), {"B": 1}, name="sam2_encoder", input_names=["pixels"],
                          output_names=["image_embeddings", "hr0", "hr1"])
    dec = entry_signature(model, decode, (), {"B": 1, "Pts": 1, "N": tokens}, name="sam2_decoder",
                          output_names=["masks", "iou_scores", "object_score_logits"], results=[merged, *rest])
    return enc.to_json(), dec.to_json()


@dataclass(frozen=True)
class NamedPrompt:
    """A validation prompt: its name, and the prompt in model-input pixels."""

    name: str
    prompt: Prompt


def prompts_for(size: int) -> list[NamedPrompt]:
    """The validation prompts at a ``size`` px input: every kind that fits in three tokens."""
    s = size / 512
    return [
        NamedPrompt("one foreground point", Prompt([(250 * s, 180 * s)], [1])),
        NamedPrompt("foreground and background points", Prompt([(250 * s, 180 * s), (400 * s, 420 * s)], [1, 0])),
        NamedPrompt("one background point", Prompt([(100 * s, 60 * s)], [0])),
        NamedPrompt("box", Prompt(box=(120 * s, 90 * s, 380 * s, 330 * s))),
    ]


def photo_like(size: int, seed: int = 0) -> torch.Tensor:
    """A ``[size, size, 3]`` uint8 RGB image with what photos have: smooth sky and ground gradients,
    a few solid objects with soft edges, texture and sensor noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.linspace(0, 1, size).reshape(size, 1, 1)
    x = torch.linspace(0, 1, size).reshape(1, size, 1)
    sky = torch.tensor([0.45, 0.65, 0.95]) * (1 - 0.5 * y) + torch.tensor([0.9, 0.9, 0.95]) * 0.5 * y
    ground = torch.tensor([0.35, 0.45, 0.2]) * (0.7 + 0.3 * x)
    img = torch.where(y < 0.55 + 0.05 * torch.sin(x * 9), sky, ground)
    for cx, cy, r, colour in ((0.45, 0.4, 0.18, (0.8, 0.2, 0.15)), (0.75, 0.75, 0.12, (0.95, 0.85, 0.3)),
                              (0.2, 0.7, 0.1, (0.25, 0.25, 0.6))):
        d = ((x - cx) ** 2 + (y - cy) ** 2).sqrt()
        alpha = torch.sigmoid((r - d) * size / 3)
        img = img * (1 - alpha) + torch.tensor(colour) * alpha * (0.8 + 0.2 * torch.cos(y * 20 + x * 13))
    img = img + 0.02 * torch.randn(size, size, 3, generator=g)
    return (img.clamp(0, 1) * 255).round().to(torch.uint8)


def preprocess(image: Any, size: int) -> torch.Tensor:
    """The pre-processing outside the graph, ``kestrel segment``'s own (one function for both): RGB uint8
    ``[H, W, 3]``, a PIL image or a path, resized to ``size x size`` without keeping the aspect ratio
    (PIL bilinear, antialiased), /255, ImageNet mean/std -> ``[1, 3, size, size]``."""
    return pixels(image, size)


def sample_photo(size: int) -> torch.Tensor:
    """Validation's photo: photo-like, ``size x 3 size / 2`` (not square, wider than the input), so the
    pre-processing resizes and antialiases as it does for users' photos."""
    return photo_like(3 * size // 2)[:size]


# --------------------------------------------------------------------------------- prompt tables


TABLE_SHAPES = {  # file -> shape in units of (Hd, E); filled per model
    "prompt_gaussian.bin": "2, Hd / 2",
    "prompt_point_embed_bg.bin": "Hd",
    "prompt_point_embed_fg.bin": "Hd",
    "prompt_box_tl.bin": "Hd",
    "prompt_box_br.bin": "Hd",
    "prompt_not_a_point.bin": "Hd",
    "prompt_img_pos.bin": "1, Hd, E, E",
    "prompt_dense.bin": "1, Hd, E, E",
}


def prompt_tables(model: Any) -> dict[str, tuple[torch.Tensor, str]]:
    """The tables a page composes prompts from, with where each comes from upstream."""
    hd, e = model.generics["Hd"], model.generics["E"]
    size = 16 * e
    t = PromptTables.from_model(model).as_files()  # the tables prompts are composed from: one builder
    gauss = t["prompt_gaussian"]
    shared = bool(torch.equal(gauss, model.positional_embedding.detach().float()))
    gauss_source = "prompt_encoder.shared_embedding.positional_embedding (the table Sam2PromptEncoder embeds points "
    gauss_source += ("with; equal to shared_image_embedding.positional_embedding in this checkpoint)" if shared else
                     "with; this checkpoint's shared_image_embedding.positional_embedding differs and is only used "
                     "for prompt_img_pos.bin)")
    with torch.no_grad():
        img_pos = model.image_positions().detach()
    dense = model.no_mask_embed.detach().reshape(1, hd, 1, 1).expand(1, hd, e, e)
    return {
        "prompt_gaussian.bin": (gauss, gauss_source),
        "prompt_point_embed_bg.bin": (t["prompt_point_embed_bg"], "prompt_encoder.point_embed.weight[0]"),
        "prompt_point_embed_fg.bin": (t["prompt_point_embed_fg"], "prompt_encoder.point_embed.weight[1]"),
        "prompt_box_tl.bin": (t["prompt_box_tl"], "prompt_encoder.point_embed.weight[2]"),
        "prompt_box_br.bin": (t["prompt_box_br"], "prompt_encoder.point_embed.weight[3]"),
        "prompt_not_a_point.bin": (t["prompt_not_a_point"], "prompt_encoder.not_a_point_embed.weight[0]"),
        "prompt_img_pos.bin": (img_pos, f"Sam2Model.get_image_wide_positional_embeddings() with image_size={size}"),
        "prompt_dense.bin": (dense, f"prompt_encoder.no_mask_embed.weight broadcast to [1,{hd},{e},{e}]"),
    }


def load_tables(directory: Path, hd: int, e: int) -> dict[str, torch.Tensor]:
    """The ``.bin`` tables read back as a page reads them (raw little-endian f32)."""
    shapes = {"prompt_gaussian.bin": (2, hd // 2), "prompt_img_pos.bin": (1, hd, e, e),
              "prompt_dense.bin": (1, hd, e, e)}
    return {n: read_table(directory / n, shapes.get(n, (hd,))) for n in TABLE_SHAPES}


def compose_tokens(tables: dict[str, torch.Tensor], prompt: Prompt, size: int, tokens: int = TOKENS) -> torch.Tensor:
    """The sparse tokens ``[1, 1, tokens, Hd]`` of one prompt composed from the tables by file name
    (as a page reads them), with :func:`kestrel.pipelines.sam2_processing.compose`."""
    return compose(PromptTables.from_files(tables, size), [tuple(p) for p in prompt.points], prompt.labels,
                   prompt.box, count=tokens)


# -------------------------------------------------------------------------------------- recipe


class Sam2Recipe(Recipe):
    """The encoder/decoder split of seed 002 for a bound SAM 2.1 model (any size, any ``E``)."""

    def __init__(self, model: Any, tokens: int = TOKENS) -> None:
        self.bound = model
        self.tokens = tokens
        self.E, self.Hd = model.generics["E"], model.generics["Hd"]
        self.size = 16 * self.E
        loaded = getattr(model, "loaded", None)
        card = getattr(loaded, "card", None)
        name = card.name if card is not None else "sam2.1"
        self.model = f"{name} ({self.size} encoder/decoder split)"
        self.model_code = (f"Kestrel sam2::Model (kestrel.models.sam2), entries encode_image and decode_tokens; "
                           f"bound at E = {self.E} (image_size {self.size})")
        self.differences = [
            f"input {self.size}x{self.size} (masks {4 * self.E}x{4 * self.E})"
            + (" instead of 1024x1024 (masks 256x256)" if self.size != 1024 else ""),
            f"fixed {tokens} prompt tokens per decode: points, box corners, one not-a-point pad, then padding pads "
            "that the decoder masks out (exactly upstream's prompt for any prompt that fits; larger prompts are "
            "composed by the site)",
            "no mask prompt input (dense = no_mask_embed)",
        ]
        self.preprocessing = (f"RGB, resize to {self.size}x{self.size} without keeping aspect (PIL bilinear, "
                              "antialiased: kestrel.pipelines.sam2_processing.pixels, as kestrel segment), /255, "
                              "ImageNet mean/std")
        self._programs: list[mf.Program] | None = None
        self._rewrites: list[str] = []

    # --- programs

    def programs(self) -> list[mf.Program]:
        if self._programs is not None:
            return self._programs
        m, e, hd = self.bound, self.E, self.Hd
        pixels = preprocess(sample_photo(self.size), self.size)
        enc = Sam2Encoder(m).eval()
        enc_out = mf.program_outputs(enc, [pixels], ["image_embeddings", "hr0", "hr1"],
                                     {"image_embeddings": "no_memory_embedding added",
                                      "hr0": "before mask_decoder.conv_s0", "hr1": "before mask_decoder.conv_s1"})
        with torch.no_grad():
            emb, hr0, hr1 = enc(pixels)
        tables = {n: t for n, (t, _) in prompt_tables(m).items()}
        sparse = compose_tokens(tables, prompts_for(self.size)[0].prompt, self.size, self.tokens)
        dec_inputs = [emb, tables["prompt_img_pos.bin"], sparse, tables["prompt_dense.bin"].contiguous(), hr0, hr1]
        dec = Sam2Decoder(m).eval()
        dec_out = mf.program_outputs(dec, dec_inputs, ["masks", "iou_scores", "object_score_logits"],
                                     {"masks": "logits, mask tokens 1..3"})
        names = ["image_embeddings", "image_pe", "sparse", "dense", "hr0", "hr1"]
        enc_sig, dec_sig = split_signatures(m, self.tokens)
        self._programs = [
            mf.Program("sam2_encoder", enc, [mf.Port("pixels", tuple(pixels.shape))], enc_out, [pixels],
                       signature=enc_sig),
            mf.Program("sam2_decoder", dec, [mf.Port(n, tuple(t.shape)) for n, t in zip(names, dec_inputs)],
                       dec_out, dec_inputs, {"prompt_tokens": self.tokens}, dec_sig),
        ]
        del e, hd
        return self._programs

    def upstream(self) -> dict[str, Any]:
        row = upstream_of(self.bound)
        if row.get("official"):
            row["license"] = "Apache-2.0"
            row["note"] = "transformers Sam2Model port published by the SAM 2 authors on the Hub; " + row["note"]
        return row

    def prompt_tables(self) -> dict[str, tuple[torch.Tensor, str]]:
        return prompt_tables(self.bound)

    def model_rewrites(self) -> list[str]:
        return list(self._rewrites)

    @contextlib.contextmanager
    def exporting(self) -> Iterator[None]:
        """Trace with the Hiera position embedding as a constant: it depends on the weights only
        (a bicubic resize of the background table plus the tiled window table)."""
        backbone = getattr(self.bound, "backbone", None)
        if backbone is None or not hasattr(backbone, "positions"):
            yield
            return
        with torch.no_grad():
            table = backbone.positions().detach().clone()
        backbone.register_buffer("_export_positions", table)
        backbone.positions = lambda: backbone._export_positions  # instance attribute shadows the method
        note = ("Hiera position embedding (bicubic pos_embed resize + tiled window embedding) for the fixed input "
                "size computed in eager and stored as a constant")
        if note not in self._rewrites:
            self._rewrites.append(note)
        try:
            yield
        finally:
            del backbone.positions
            del backbone._export_positions

    # --- validation

    def samples(self) -> list[str]:
        return [f"photo-like synthetic image {3 * self.size // 2}x{self.size} (kestrel.export.edge_sam2.sample_photo, "
                "seed 0), preprocessed as preprocessing_outside_graph says (kestrel segment's own function)",
                *(f"prompt: {p.name}" for p in prompts_for(self.size))]

    def validate(self, runners: dict[str, val.Runner], runtime: str, files: dict[str, str],
                 out_dir: Path) -> list[dict[str, Any]]:
        """End to end: the encoder program, then the decoder program on tokens composed from the
        written tables; against Kestrel eager (same tokens) and transformers ``Sam2Model`` (the
        unpadded prompt through upstream's own prompt encoder)."""
        tables = load_tables(out_dir, self.Hd, self.E)
        pixels = preprocess(sample_photo(self.size), self.size)
        enc_prog, dec_prog = self.programs()
        emb, hr0, hr1 = runners["sam2_encoder"]([pixels])
        with torch.no_grad():
            ref_enc = list(enc_prog.module(pixels))
        rows = [val.case(files["sam2_encoder"], runtime, self.samples()[0], "kestrel eager",
                         [o.name for o in enc_prog.outputs], [emb, hr0, hr1], ref_enc)]
        upstream = transformers_reference(self.bound, self.size)
        if upstream is not None:
            ref_emb, ref_hr0, ref_hr1 = upstream.encode(pixels)
            rows.append(val.case(files["sam2_encoder"], runtime, self.samples()[0], upstream.label,
                                 ["image_embeddings", "hr0", "hr1"], [emb, hr0, hr1], [ref_emb, ref_hr0, ref_hr1]))
        for named in prompts_for(self.size):
            prompt = named.prompt
            sparse = compose_tokens(tables, prompt, self.size, self.tokens)
            inputs = [emb, tables["prompt_img_pos.bin"], sparse, tables["prompt_dense.bin"], hr0, hr1]
            got = runners["sam2_decoder"](inputs)
            names = [o.name for o in dec_prog.outputs]
            with torch.no_grad():
                eager = list(dec_prog.module(*inputs))
            rows.append(val.case(files["sam2_decoder"], runtime, f"prompt: {named.name} (after the encoder program)",
                                 "kestrel eager", names, got, eager, masks=("masks",)))
            if upstream is not None:
                rows.append(val.case(files["sam2_decoder"], runtime,
                                     f"prompt: {named.name} (end to end from pixels)", upstream.label,
                                     names, got, upstream.decode(pixels, prompt), masks=("masks",)))
        return rows


# --------------------------------------------------------------------------- transformers reference


class Upstream:
    """transformers ``Sam2Model`` loaded from the same directory with ``image_size`` overridden."""

    def __init__(self, ref: Any, size: int, version: str) -> None:
        self.ref, self.size = ref, size
        self.label = f"transformers {version} Sam2Model (image_size {size})"

    def encode(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        with torch.no_grad():
            fpn = self.ref.vision_encoder(pixels).fpn_hidden_states
            emb = self.ref.get_image_embeddings(pixels)[-1]
        return [emb, fpn[0], fpn[1]]

    def decode(self, pixels: torch.Tensor, prompt: Prompt) -> list[torch.Tensor]:
        kw: dict[str, Any] = {}
        if prompt.box is not None:
            kw["input_boxes"] = torch.tensor([[list(prompt.box)]], dtype=torch.float32)
        else:
            kw["input_points"] = torch.tensor([[list(map(list, prompt.points))]], dtype=torch.float32)
            kw["input_labels"] = torch.tensor([[list(prompt.labels)]], dtype=torch.int64)
        with torch.no_grad():
            out = self.ref(pixel_values=pixels, multimask_output=True, **kw)
        masks = out.pred_masks  # [1, 1, 3, 4E, 4E]
        return [masks.reshape(1, -1, *masks.shape[-2:]), out.iou_scores, out.object_score_logits]


def transformers_reference(model: Any, size: int) -> Upstream | None:
    """The reference for ``model``'s checkpoint directory, or None when transformers is missing."""
    try:
        import transformers
        from transformers import Sam2Config, Sam2Model
    except ImportError:
        return None
    loaded = getattr(model, "loaded", None)
    if loaded is None:
        return None
    import copy

    cfg = copy.deepcopy(loaded.config)
    s = size // 4
    cfg.setdefault("vision_config", {}).setdefault("backbone_config", {})["image_size"] = [size, size]
    cfg["vision_config"]["backbone_feature_sizes"] = [[s, s], [s // 2, s // 2], [s // 4, s // 4]]
    cfg.setdefault("prompt_encoder_config", {})["image_size"] = size
    for key in ("architectures", "transformers_version", "model_type"):
        cfg.pop(key, None)
    ref = Sam2Model.from_pretrained(str(loaded.directory), config=Sam2Config(**cfg)).eval()
    return Upstream(ref, size, transformers.__version__)


__all__ = [
    "SDPA_REWRITE",
    "Sam2Recipe",
    "compose_tokens",
    "photo_like",
    "preprocess",
    "prompt_tables",
    "prompts_for",
    "sample_photo",
]
