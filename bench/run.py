#!/usr/bin/env python
"""Kestrel beside transformers on this machine: eager, torch.compile and onnxruntime, in one run.

For each model (a row of REGISTRY) the script builds the transformers model from the real config
with random weights (``torch.manual_seed(0)``), saves it with ``save_pretrained`` to a temporary
directory, and times, on that one checkpoint and the same seeded inputs:

    kestrel          Kestrel (``kestrel.load(dir).<entry>``): eager, or onnxruntime on Kestrel's own export
                     where the row's race (``kestrel doctor --onnxruntime``, not timed) found it at least
                     5% faster; KESTREL_ONNXRUNTIME=0 skips the race
    kestrel-compile  ``kestrel.load(dir, compile=True)``: the entry under ``torch.compile`` (static
                     shapes, inductor freezing), raced against eager at the first call, the faster kept
    hf               transformers eager (its default attention, sdpa)
    hf-compile       the transformers model under ``torch.compile(dynamic=False)``
    onnx             onnxruntime on Kestrel's export (``kestrel.export.onnx``, dynamic batch)

Every row runs in its own subprocess, so rows do not share allocator state or compile caches and
the memory figure is the row's own. What is measured:

    median s     median wall time of --repeat calls, after --warmup calls (and after compiling);
                 min s, the fastest of them
    x HF         median / transformers-eager median at the same model, size and batch (< 1: faster)
    GFLOP/s      counted FLOPs / median. FLOPs are counted from the config: 2*M*N*K for every
                 matmul (patch embedding, q/k/v/out projections, q@k^T, attn@v, MLP, head);
                 norms, softmax, GELU and adds are not counted
    % mm         GFLOP/s over this machine's f32 matmul peak as torch.mm reaches it, measured in
                 this run (2048 x 2048 f32, best of 10, at the start and at the end of the run; the
                 larger is used)
    % hw         GFLOP/s over the best f32 GEMM rate measured here by any library: torch.mm (MKL),
                 oneDNN (torch.ops.mkldnn._linear_pointwise) or onnxruntime's MatMul (MLAS), same
                 2048 x 2048 problem. On AMD CPUs MKL may not use AVX-512, so % mm can exceed 100
    peak MB      peak RSS while the timed calls run (VmHWM, reset through /proc/self/clear_refs
                 after warmup) minus RSS before the model was loaded: weights + whatever the
                 compiler or runtime keeps + activations at their peak
    setup s      compile rows: the first call (a cold compile, each row with an empty inductor
                 cache, + one run); onnx: export (once per model and size, not in the row's
                 process) + session creation
    rel diff     max |out - out_hf| / max |out_hf| against transformers eager at the same batch
    others       the share of the machine's CPU time other processes used during the timed calls
                 (/proc/stat minus this row's own time). The machine may be shared: before each row
                 the script waits (--max-wait) for the CPUs to be quiet; a row with a large share
                 here was disturbed (with 2 threads on 2 cores, one busy core can slow a call by
                 far more than half)

Threads: torch.set_num_threads(physical cores) in every row (and onnxruntime's intra-op threads);
override with --threads. A row that fails (a compile error, a timeout) prints an error row and the
run goes on.

Examples:
    python bench/run.py                                    # vit and dinov2, batch 1 and 8, full size
    python bench/run.py --quick                            # fewer repeats; big-image cases at batch 1 only
    python bench/run.py --models vit --batch 1 --variants kestrel,hf --profile
    python bench/run.py --size small --repeat 2            # tiny configs: a smoke test in seconds
To add a model, add a ModelSpec to REGISTRY: builder of the reference, its config, the Kestrel entry,
the input builder and the FLOP counter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# Kestrel's variants: kestrel.load's keywords besides the checkpoint (int8 and bf16 are the opt-in fast paths,
# not exact: their rel diff is their distance from transformers' f32, and their speed-up is against "kestrel")
KESTREL_VARIANTS: dict[str, dict[str, Any]] = {"kestrel": {}, "kestrel-compile": {},
                                               "kestrel-int8": {"quantize": "int8"}, "kestrel-bf16": {"dtype": "bf16"}}
VARIANTS = ("kestrel", "kestrel-compile", "hf", "hf-compile", "onnx", "kestrel-int8", "kestrel-bf16")
DEFAULT_VARIANTS = ("kestrel", "kestrel-compile", "hf", "hf-compile", "onnx")
DEFAULT_MODELS = "vit,dinov2,siglip,siglip-text,sam,sam-decode"
LABELS = {"kestrel": "kestrel eager", "kestrel-compile": "kestrel compile", "kestrel-int8": "kestrel int8",
          "kestrel-bf16": "kestrel bf16", "hf": "transformers eager",
          "hf-compile": "transformers compile", "onnx": "onnxruntime (kestrel)"}
RESULT_MARK = "@@BENCH-RESULT "
# glibc keeps freed memory instead of unmapping it: no page faults on the next call's activations
MALLOC_CACHE = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"
INPUT_SEED = 1234

def bf16_inputs(inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A bf16 model's inputs: its float tensors in bf16 (images), the rest (token ids) as they are."""
    return tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs)



# ------------------------------------------------------------------------------------ FLOPs


def encoder_flops(*, tokens: int, d: int, inner: int, layers: int, patches: int, patch_in: int,
                  head: int = 0, glu: bool = False) -> int:
    """Matmul FLOPs (2*M*N*K) of a pre-norm ViT encoder on one image.

    ``patch_in`` is Channels*Patch*Patch; ``head`` the classifier's outputs (0: none);
    ``glu`` an MLP whose first projection is doubled (SwiGLU, ``inner`` = hidden width).
    """
    n = tokens
    attn = 2 * n * d * (3 * d) + 2 * n * n * d + 2 * n * n * d + 2 * n * d * d
    mlp = 2 * n * d * inner * (2 if glu else 1) + 2 * n * inner * d
    return 2 * patches * d * patch_in + layers * (attn + mlp) + 2 * d * head


def _grid(image: int, patch: int) -> int:
    return (image // patch) ** 2


def vit_flops(cfg: Any, image: int) -> int:
    p = _grid(image, cfg.patch_size)
    return encoder_flops(tokens=p + 1, d=cfg.hidden_size, inner=cfg.intermediate_size,
                         layers=cfg.num_hidden_layers, patches=p, patch_in=cfg.num_channels * cfg.patch_size ** 2,
                         head=cfg.num_labels)


def dinov2_flops(cfg: Any, image: int) -> int:
    p = _grid(image, cfg.patch_size)
    inner = int(cfg.hidden_size * cfg.mlp_ratio)
    if cfg.use_swiglu_ffn:
        inner = (int(inner * 2 / 3) + 7) // 8 * 8
    return encoder_flops(tokens=p + 1, d=cfg.hidden_size, inner=inner, layers=cfg.num_hidden_layers,
                         patches=p, patch_in=cfg.num_channels * cfg.patch_size ** 2, glu=cfg.use_swiglu_ffn)


# ---------------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ModelSpec:
    """One benchmarked model. Everything that names transformers is a callable run in a row's process."""

    title: str
    config: Callable[[str], Any]                      # "full" | "small" -> a transformers config
    reference: Callable[[Any], torch.nn.Module]       # config -> random-init transformers model
    reference_class: Callable[[], Any]                # the class whose from_pretrained reads the directory
    reference_output: Callable[[Any, tuple], torch.Tensor]  # (hf model, inputs) -> the compared tensor
    entry: str                                        # the Kestrel entry timed
    images: Callable[[str], list[int]]                # the image sizes timed, the first is the config's
    inputs: Callable[[Any, int, int], tuple[torch.Tensor, ...]]  # (config, image, batch) -> inputs
    flops: Callable[[Any, int], int]                  # (config, image) -> FLOPs per item
    load_kwargs: Callable[[Any, int], dict[str, Any]] = lambda cfg, image: {}  # kestrel.load generics
    output: Callable[[Any], torch.Tensor] = lambda out: out  # Kestrel's (and onnx's) result -> the compared tensor
    max_batch: int = 64                               # larger batches are skipped for this model
    model_init: Callable[[torch.nn.Module], None] | None = None  # re-draws the reference's random weights
    export_dims: dict[str, int] | None = None         # free dimensions of the entry's inputs, for the export


def _transformers() -> Any:
    import transformers

    return transformers


def _pixels(cfg: Any, image: int, batch: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(INPUT_SEED + batch * 7919 + image)
    return (torch.randn(batch, cfg.num_channels, image, image, generator=g),)


def _vit_config(size: str) -> Any:
    t = _transformers()
    if size == "small":
        return t.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                           image_size=32, patch_size=8, num_labels=10)
    # google/vit-base-patch16-224
    return t.ViTConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                       image_size=224, patch_size=16, num_labels=1000, layer_norm_eps=1e-12, qkv_bias=True)


def _dinov2_config(size: str) -> Any:
    t = _transformers()
    if size == "small":
        return t.Dinov2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, mlp_ratio=4,
                              image_size=56, patch_size=14)
    # facebook/dinov2-base
    return t.Dinov2Config(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, mlp_ratio=4,
                          image_size=518, patch_size=14, layer_norm_eps=1e-6, layerscale_value=1.0)


def _siglip_config(size: str) -> Any:
    t = _transformers()
    if size == "small":
        return t.SiglipConfig(
            vision_config=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                               image_size=32, patch_size=8),
            text_config=dict(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, max_position_embeddings=16))
    # google/siglip-base-patch16-224
    return t.SiglipConfig(
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                           image_size=224, patch_size=16),
        text_config=dict(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                         num_attention_heads=12, max_position_embeddings=64))


def _siglip_pixels(cfg: Any, image: int, batch: int) -> tuple[torch.Tensor, ...]:
    return _pixels(cfg.vision_config, image, batch)


def _siglip_tokens(cfg: Any, image: int, batch: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(INPUT_SEED + batch)
    text = cfg.text_config
    return (torch.randint(0, text.vocab_size, (batch, text.max_position_embeddings), generator=g,
                          dtype=torch.int32),)


def siglip_image_flops(cfg: Any, image: int) -> int:
    v = cfg.vision_config
    p = _grid(image, v.patch_size)
    d, inner = v.hidden_size, v.intermediate_size
    body = encoder_flops(tokens=p, d=d, inner=inner, layers=v.num_hidden_layers, patches=p,
                         patch_in=v.num_channels * v.patch_size ** 2)
    # attention-pool head: one probe query against every token, its output projection and MLP
    head = 2 * d * d + 2 * p * d * 2 * d + 2 * 2 * p * d + 2 * d * d + 2 * 2 * d * inner
    return body + head


def siglip_text_flops(cfg: Any, image: int) -> int:
    t = cfg.text_config
    n = t.max_position_embeddings
    body = encoder_flops(tokens=n, d=t.hidden_size, inner=t.intermediate_size, layers=t.num_hidden_layers,
                         patches=0, patch_in=0)
    return body + 2 * t.hidden_size * t.hidden_size  # the head on the last token


def _sam_config(size: str) -> Any:
    t = _transformers()
    if size == "small":
        return t.SamConfig(
            vision_config=dict(hidden_size=32, num_attention_heads=2, mlp_dim=64, output_channels=32,
                               num_pos_feats=16),
            prompt_encoder_config=dict(hidden_size=32),
            mask_decoder_config=dict(hidden_size=32, num_attention_heads=2, mlp_dim=64, iou_head_hidden_dim=32))
    return t.SamConfig()  # facebook/sam-vit-base: ViT-B encoder, 1024 x 1024, windows of 14, global at 2, 5, 8, 11


def _sam_pixels(cfg: Any, image: int, batch: int) -> tuple[torch.Tensor, ...]:
    return _pixels(cfg.vision_config, image, batch)


def _sam_prompt(cfg: Any, image: int, batch: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(INPUT_SEED + batch)
    v = cfg.vision_config
    grid = v.image_size // v.patch_size
    emb = torch.randn(batch, v.output_channels, grid, grid, generator=g)
    points = torch.rand(batch, 1, 1, 2, generator=g) * v.image_size
    return emb, points, torch.ones(batch, 1, 1, dtype=torch.int32)


def sam_weights(model: torch.nn.Module) -> None:
    """Upstream draws SAM's encoder weights with std 1e-10 and zero positions: activations would be denormal
    (slow on x86 unless flushed, which only one side does). Draw them as trained models have them instead."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("rel_pos_h", "rel_pos_w", "pos_embed")):
                p.normal_(0, 0.5)
            elif name.endswith("positional_embedding"):
                p.normal_(0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0, p[0].numel() ** -0.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.02)


def sam_encoder_flops(cfg: Any, image: int) -> int:
    """The ViT-B encoder on one image: projections and MLP on every token, windowed attention on
    padded windows, global attention (and its decomposed relative positions) on 4096 tokens, the neck."""
    v = cfg.vision_config
    g = image // v.patch_size
    n, d, w = g * g, v.hidden_size, v.window_size
    inner = int(d * v.mlp_ratio)
    per_layer = 2 * n * d * 3 * d + 2 * n * d * d + 2 * 2 * n * d * inner
    windows = -(-g // w) ** 2
    local = windows * 2 * 2 * (w * w) ** 2 * d
    glob = 2 * 2 * n * n * d + 2 * 2 * n * g * d  # scores, attn @ v; q @ rel_h, q @ rel_w
    n_global = len(v.global_attn_indexes)
    layers = v.num_hidden_layers * per_layer + n_global * glob + (v.num_hidden_layers - n_global) * local
    neck = 2 * n * d * v.output_channels + 2 * n * v.output_channels ** 2 * 9
    return 2 * n * d * v.num_channels * v.patch_size ** 2 + layers + neck


def sam_decode_flops(cfg: Any, image: int) -> int:
    """Counted by torch.utils.flop_counter on the reference is more exact; this is the two-way transformer's
    cross attention against 4096 image tokens and the upscaling, about 1 GFLOP: shown, not a target."""
    m = cfg.mask_decoder_config
    n = (cfg.vision_config.image_size // cfg.vision_config.patch_size) ** 2
    d = m.hidden_size
    return 2 * 2 * (2 * n * d * d // 2 * 2 + 2 * n * 8 * d) + 2 * 4 * n * d * d


REGISTRY: dict[str, ModelSpec] = {
    "vit": ModelSpec(
        title="ViT-B/16 classifier (google/vit-base-patch16-224 config)",
        config=_vit_config,
        reference=lambda cfg: _transformers().ViTForImageClassification(cfg),
        reference_class=lambda: _transformers().ViTForImageClassification,
        reference_output=lambda m, xs: m(pixel_values=xs[0]).logits,
        entry="forward",
        images=lambda size: [32] if size == "small" else [224],
        inputs=_pixels,
        flops=vit_flops,
    ),
    "dinov2": ModelSpec(
        title="DINOv2-base backbone (facebook/dinov2-base config)",
        config=_dinov2_config,
        reference=lambda cfg: _transformers().Dinov2Model(cfg),
        reference_class=lambda: _transformers().Dinov2Model,
        reference_output=lambda m, xs: m(pixel_values=xs[0]).last_hidden_state,
        entry="forward",
        images=lambda size: [56, 28] if size == "small" else [518, 224],
        inputs=_pixels,
        flops=dinov2_flops,
        load_kwargs=lambda cfg, image: {} if image == cfg.image_size else {"Height": image, "Width": image},
    ),
    "siglip": ModelSpec(
        title="SigLIP B/16 image features (google/siglip-base-patch16-224 config)",
        config=_siglip_config,
        reference=lambda cfg: _transformers().SiglipModel(cfg),
        reference_class=lambda: _transformers().SiglipModel,
        reference_output=lambda m, xs: m.vision_model(pixel_values=xs[0]).pooler_output,
        entry="image_features",
        images=lambda size: [32] if size == "small" else [224],
        inputs=_siglip_pixels,
        flops=siglip_image_flops,
    ),
    "siglip-text": ModelSpec(
        title="SigLIP B/16 text features, 64 tokens (google/siglip-base-patch16-224 config)",
        config=_siglip_config,
        reference=lambda cfg: _transformers().SiglipModel(cfg),
        reference_class=lambda: _transformers().SiglipModel,
        reference_output=lambda m, xs: m.text_model(input_ids=xs[0].long()).pooler_output,
        entry="text_features",
        images=lambda size: [0],
        inputs=_siglip_tokens,
        flops=siglip_text_flops,
    ),
    "sam": ModelSpec(
        title="SAM ViT-B image encoder, 1024 x 1024 (facebook/sam-vit-base config)",
        config=_sam_config,
        reference=lambda cfg: _transformers().SamModel(cfg),
        reference_class=lambda: _transformers().SamModel,
        reference_output=lambda m, xs: m.get_image_embeddings(xs[0]),
        entry="encode_image",
        images=lambda size: [1024],
        inputs=_sam_pixels,
        flops=sam_encoder_flops,
        max_batch=1,
        model_init=sam_weights,
    ),
    "sam-decode": ModelSpec(
        title="SAM mask decoder, one point prompt, multimask (facebook/sam-vit-base config)",
        config=_sam_config,
        reference=lambda cfg: _transformers().SamModel(cfg),
        reference_class=lambda: _transformers().SamModel,
        reference_output=lambda m, xs: m(image_embeddings=xs[0], input_points=xs[1], input_labels=xs[2],
                                         multimask_output=True).pred_masks,
        entry="decode_points",
        images=lambda size: [1024],
        inputs=_sam_prompt,
        flops=sam_decode_flops,
        model_init=sam_weights,
        output=lambda out: out[0][:, :, 1:],  # Kestrel gives the single mask first, then the three
        export_dims={"Pts": 1, "N": 1},  # one prompt of one point, as _sam_prompt draws
    ),
}


# ---------------------------------------------------------------------------------- machine


def physical_cores() -> int:
    """Cores, not hardware threads: distinct (package, core) pairs among the CPUs this process may use."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    seen = set()
    for c in cpus:
        base = Path(f"/sys/devices/system/cpu/cpu{c}/topology")
        try:
            seen.add((base.joinpath("physical_package_id").read_text().strip(),
                      base.joinpath("core_id").read_text().strip()))
        except OSError:
            seen.add(("?", str(c)))
    return max(1, len(seen))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _best_rate(fn: Callable[[], Any], flops: float, tries: int) -> float:
    for _ in range(2):
        fn()
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return flops / best / 1e9


def matmul_peak(n: int = 2048, tries: int = 10) -> float:
    """Best GFLOP/s of torch.mm on n x n f32 matrices."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    c = torch.empty(n, n)
    return _best_rate(lambda: torch.mm(a, b, out=c), 2 * n ** 3, tries)


def gemm_peaks(n: int = 2048, tries: int = 10) -> dict[str, float]:
    """Best f32 GEMM GFLOP/s per library on this machine: torch.mm, oneDNN, onnxruntime (when available)."""
    out = {"torch.mm": matmul_peak(n, tries)}
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    try:
        out["onednn"] = _best_rate(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""),
                                   2 * n ** 3, tries)
    except Exception:  # not an x86 build with mkldnn
        pass
    try:
        import onnx.helper as oh
        import onnxruntime as ort

        graph = oh.make_graph([oh.make_node("MatMul", ["A", "B"], ["C"])], "mm",
                              [oh.make_tensor_value_info("A", 1, [n, n]), oh.make_tensor_value_info("B", 1, [n, n])],
                              [oh.make_tensor_value_info("C", 1, [n, n])])
        model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
        model.ir_version = 9
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = torch.get_num_threads()
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        feeds = {"A": a.numpy(), "B": b.numpy()}
        out["onnxruntime"] = _best_rate(lambda: sess.run(None, feeds), 2 * n ** 3, tries)
    except Exception:
        pass
    return out


def _status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of the whole machine, from /proc/stat."""
    try:
        f = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return 0, 0
    user, nice, system, idle, iowait, irq, softirq, steal = f
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def _own_jiffies() -> int:
    """utime + stime of this process, all threads."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return 0


class OtherLoad:
    """The share of the machine's CPU time that other processes used while this one was measured."""

    def __enter__(self) -> OtherLoad:
        self.busy0, self.total0 = _cpu_jiffies()
        self.own0 = _own_jiffies()
        self.share: float | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        busy, total = _cpu_jiffies()
        if total - self.total0 >= 20:  # under ~0.1 s of ticks the share is noise
            others = (busy - self.busy0) - (_own_jiffies() - self.own0)
            self.share = max(0.0, others / (total - self.total0))


def wait_quiet(max_wait: float, threshold: float = 0.15, sample: float = 1.0) -> float:
    """Wait (up to max_wait s) until other processes use under `threshold` of the CPUs; return their share."""
    deadline = time.monotonic() + max_wait
    while True:
        with OtherLoad() as load:
            time.sleep(sample)
        share = load.share or 0.0
        if share < threshold or time.monotonic() >= deadline:
            return share
        time.sleep(2.0)


# ------------------------------------------------------------------------------------ a row


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """Run one row in this process: load, (compile), warm up, time, save the output."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(job["threads"])
    spec = REGISTRY[job["model"]]
    cfg = spec.config(job["size"])
    variant, batch, image = job["variant"], job["batch"], job["image"]
    inputs = spec.inputs(cfg, image, batch)
    rss0 = _status_kb("VmRSS")
    res: dict[str, Any] = {}

    setup = 0.0
    t0 = time.perf_counter()
    if variant in KESTREL_VARIANTS:
        import kestrel

        compiled = variant == "kestrel-compile"  # what a user gets: compiled, raced against eager per shape
        model = kestrel.load(job["checkpoint"], compile=compiled, **KESTREL_VARIANTS[variant],
                             **spec.load_kwargs(cfg, image))
        entry = getattr(model, spec.entry)
        if variant == "kestrel-bf16":  # the model takes bf16 images; the output is compared in f32
            inputs = bf16_inputs(inputs)

        def fn(*xs: torch.Tensor) -> Any:
            return spec.output(entry(*xs)).float()

        if variant != "kestrel-compile":  # measure every GEMM shape now (or read the cached choices): not timed
            from kestrel.kernels import calibration as calibrate

            t = time.perf_counter()
            with torch.no_grad():
                res["calibration"] = calibrate.calibrate_model(lambda: entry(*inputs))
            res["calibrate_s"] = time.perf_counter() - t
            res["calibration_file"] = str(calibrate.table().path)
            from kestrel.runtime.onnxruntime_entries import runs_on

            res["backend"] = runs_on(model, spec.entry, *inputs)  # onnxruntime where this machine's race chose it
    elif variant in ("hf", "hf-compile"):
        model = spec.reference_class().from_pretrained(job["checkpoint"]).eval()
        res["attn_implementation"] = getattr(model.config, "_attn_implementation", None)

        def fn(*xs: torch.Tensor) -> torch.Tensor:
            return spec.reference_output(model, xs)
    elif variant == "onnx":
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = job["threads"]
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        sess = ort.InferenceSession(job["onnx"], opts, providers=["CPUExecutionProvider"])
        names = [i.name for i in sess.get_inputs()]
        setup = time.perf_counter() - t0

        def fn(*xs: torch.Tensor) -> Any:
            outs = [torch.from_numpy(o) for o in sess.run(None, dict(zip(names, (x.numpy() for x in xs))))]
            return spec.output(outs[0] if len(outs) == 1 else tuple(outs))
    else:
        raise ValueError(f"unknown variant {variant}")
    res["load_s"] = time.perf_counter() - t0
    rss_loaded = _status_kb("VmRSS")

    with torch.no_grad():
        if variant == "kestrel-compile":  # the first call compiles and races the graph against eager
            t = time.perf_counter()
            fn(*inputs)
            setup = time.perf_counter() - t
            res["compile_choices"] = getattr(model, "compile_choices", {})
        elif variant == "hf-compile":
            if job.get("freezing"):
                import torch._inductor.config as inductor_config

                inductor_config.freezing = True
            fn = torch.compile(fn, dynamic=False)
            t = time.perf_counter()
            fn(*inputs)
            setup = time.perf_counter() - t
        for _ in range(job["warmup"]):
            fn(*inputs)
        can_reset = _reset_peak()
        rss_before = _status_kb("VmRSS")
        times = []
        out = None
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with OtherLoad() as load:
            for _ in range(job["repeat"]):
                t = time.perf_counter()
                out = fn(*inputs)
                times.append(time.perf_counter() - t)
        res["minor_faults_per_call"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / job["repeat"]
        hwm = _status_kb("VmHWM")
        res["other_load"] = load.share
        if job.get("profile") and variant in ("kestrel", "hf"):
            res["profile"] = _profile(fn, inputs)

    assert out is not None
    torch.save(out.detach().contiguous(), job["output"])
    res.update(times=times, median=statistics.median(times), min=min(times), setup_s=setup, hwm_reset=can_reset)
    if rss0 and hwm:
        res["peak_mb"] = (hwm - rss0) / 1024
        res["load_mb"] = ((rss_loaded or rss0) - rss0) / 1024
        res["calls_mb"] = (hwm - (rss_before or hwm)) / 1024
    return res


def _profile(fn: Callable[..., Any], inputs: tuple[torch.Tensor, ...]) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn(*inputs)
    by_op = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40)
    by_shape = prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=32, max_shapes_column_width=70)
    return by_op + "\n" + by_shape


def run_worker_from_argv(arg: str) -> int:
    job = json.loads(arg)
    try:
        res = worker(job)
    except Exception as e:
        tb = traceback.format_exc(limit=6)
        res = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
               "traceback": tb}
    print(RESULT_MARK + json.dumps(res), flush=True)
    return 0


def run_subprocess(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]), TOKENIZERS_PARALLELISM="false",
               TRANSFORMERS_VERBOSITY="error")
    if job.get("malloc_cache"):
        env["GLIBC_TUNABLES"] = MALLOC_CACHE
    if job.get("inductor_cache"):  # a fresh cache per row: setup s is a cold compile
        env["TORCHINDUCTOR_CACHE_DIR"] = job["inductor_cache"]
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "wall_s": time.perf_counter() - t}
    wall = time.perf_counter() - t
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            res = json.loads(line[len(RESULT_MARK):])
            res["wall_s"] = wall
            return res
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {p.returncode}: " + " | ".join(tail), "wall_s": wall}


# -------------------------------------------------------------------------------- orchestration


@dataclass
class Case:
    model: str
    image: int
    flops: int  # per item
    onnx: str | None = None
    onnx_error: str | None = None
    export_s: float | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.model}@{self.image}"


def export_job(job: dict[str, Any]) -> dict[str, Any]:
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(job["threads"])
    import kestrel
    from kestrel.export.onnx import export_onnx

    spec = REGISTRY[job["model"]]
    cfg = spec.config(job["size"])
    model = kestrel.load(job["checkpoint"], **spec.load_kwargs(cfg, job["image"]))
    t = time.perf_counter()
    (path,) = export_onnx(model, job["out"], entries=[spec.entry], dims=spec.export_dims,
                          batch=1 if spec.max_batch == 1 else None)  # SAM's encoder runs at batch 1 only
    return {"onnx": str(path), "export_s": time.perf_counter() - t}


def race_job(job: dict[str, Any]) -> dict[str, Any]:
    """Race the entry against its onnxruntime export at the job's batch, as ``kestrel doctor --model DIR
    --onnxruntime`` does, in a process of its own: the Kestrel rows after it follow the recorded choice, and
    the losing session's memory is not in their peak."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(job["threads"])
    import kestrel
    from kestrel.export.onnxruntime_race import race_entry
    from kestrel.kernels import calibration as calibrate
    from kestrel.runtime.race import call_signature

    spec = REGISTRY[job["model"]]
    cfg = spec.config(job["size"])
    model = kestrel.load(job["checkpoint"], **spec.load_kwargs(cfg, job["image"]))
    inputs = spec.inputs(cfg, job["image"], job["batch"])
    with torch.no_grad():
        calibrate.calibrate_model(lambda: getattr(model, spec.entry)(*inputs))
    t = time.perf_counter()
    result = race_entry(model, spec.entry, inputs)
    return {"onnxruntime_race": result, "onnxruntime_signature": call_signature(inputs, {}),
            "onnxruntime_race_s": time.perf_counter() - t}


def run_export_from_argv(arg: str) -> int:
    job = json.loads(arg)
    try:
        res = race_job(job) if job.get("race") else export_job(job)
    except Exception as e:
        res = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
    print(RESULT_MARK + json.dumps(res), flush=True)
    return 0


def save_checkpoint(spec: ModelSpec, size: str, directory: Path) -> tuple[Any, int]:
    cfg = spec.config(size)
    torch.manual_seed(0)
    model = spec.reference(cfg).eval()
    if spec.model_init is not None:
        spec.model_init(model)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory)
    del model
    return cfg, n_params


def fmt_row(variant: str, batch: int, row: dict[str, Any], hf_median: float | None, flops: int, peak: float,
            hw_peak: float) -> str:
    label = f"{LABELS[variant]:<22} {batch:>5}"
    if "error" in row:
        return f"{label}  ERROR: {row['error'][:150]}"
    med = row["median"]
    ratio = f"{med / hf_median:6.2f}x" if hf_median else "     - "
    gflops = flops * batch / med / 1e9
    setup = f"{row['setup_s']:8.1f}" if row.get("setup_s") else "       -"
    diff = row.get("rel_diff")
    diff_s = f"{diff:9.1e}" if diff is not None else "        -"
    mem = f"{row['peak_mb']:8.0f}" if "peak_mb" in row else "       ?"
    other = f"{100 * row['other_load']:5.0f}%" if row.get("other_load") is not None else "     ?"
    pct = f"{100 * gflops / peak:5.0f}% {100 * gflops / hw_peak:5.0f}%"
    return f"{label} {med:9.4g} {row['min']:8.4g}  {ratio} {gflops:8.1f} {pct} {mem} {setup} {diff_s} {other}"


HEADER = (f"{'variant':<22} {'batch':>5} {'median s':>9} {'min s':>8}  {'x HF':>7} {'GFLOP/s':>8} {'% mm':>6} "
          f"{'% hw':>6} {'peak MB':>8} {'setup s':>8} {'rel diff':>9} {'others':>6}")


def format_choices(rows: list[Any]) -> list[str]:
    from kestrel.kernels import calibration as calibrate

    return calibrate.format_choices([(shape, entry) for shape, entry in rows])


def targets(case: Case, hw_peak: float) -> list[str]:
    """The issue's targets for this case, each as met / missed with its numbers."""
    out = []
    for b in sorted({r["batch"] for r in case.rows}):
        rows = {r["variant"]: r for r in case.rows if r["batch"] == b and "error" not in r}
        k = rows.get("kestrel")
        if k is None:
            continue
        checks = []
        for other in ("hf", "onnx"):
            if other in rows:
                ratio = k["median"] / rows[other]["median"]
                checks.append(f"vs {other} {ratio:.2f}x {'met' if ratio < 1 else 'MISSED'}")
        if "hf" in rows and "peak_mb" in k and "peak_mb" in rows["hf"]:
            ok = k["peak_mb"] <= rows["hf"]["peak_mb"]
            checks.append(f"peak MB {k['peak_mb']:.0f} vs {rows['hf']['peak_mb']:.0f} {'met' if ok else 'MISSED'}")
        for fast, goal in (("kestrel-int8", 1.5), ("kestrel-bf16", 1.8)):
            if fast in rows:
                speedup = k["median"] / rows[fast]["median"]
                checks.append(f"{fast[8:]} {speedup:.2f}x f32 (goal {goal}x) {'met' if speedup >= goal else 'MISSED'}")
        if b >= 8 or case.model == "sam":
            pct = case.flops * b / k["median"] / 1e9 / hw_peak
            goal = 0.75 if case.model == "sam" else 0.85
            verdict = "met" if pct >= goal else "MISSED"
            checks.append(f"{100 * pct:.0f}% of GEMM peak (goal {100 * goal:.0f}%) {verdict}")
        out.append(f"targets, batch {b}: " + "; ".join(checks))
    return out


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    if a.shape != ref.shape:
        return float("inf")
    scale = ref.abs().max().item() or 1.0
    return (a.float() - ref.float()).abs().max().item() / scale


def print_case(case: Case, args: argparse.Namespace, peak: float, hw_peak: float) -> None:
    """One case's table, targets and kernel choices."""
    spec = REGISTRY[case.model]
    title = spec.title if args.size == "full" else f"{spec.title.split(' (')[0]}, small test config"
    print(f"\n== {case.name}: {title}; {case.flops / 1e9:.1f} GFLOP per image "
          f"(matmuls counted from the config) ==")
    print(HEADER)
    for b in sorted({r["batch"] for r in case.rows}):
        rows = [r for r in case.rows if r["batch"] == b]
        hf = next((r for r in rows if r["variant"] == "hf" and "error" not in r), None)
        for r in rows:
            print(fmt_row(r["variant"], b, r, hf["median"] if hf else None, case.flops, peak, hw_peak))
    for b in sorted({r["batch"] for r in case.rows}):
        k = next((r for r in case.rows if r["batch"] == b and r["variant"] == "kestrel"), None)
        if k and k.get("rel_diff") is not None:
            print(f"Kestrel vs transformers (eager, batch {b}): max |diff| / max |ref| = {k['rel_diff']:.2e}")
    if case.export_s is not None:
        print(f"ONNX export (dynamic batch): {case.export_s:.1f} s")
    for line in targets(case, hw_peak):
        print(line)
    for r in case.rows:
        if r["variant"] in KESTREL_VARIANTS and r.get("calibration"):
            print(f"kernels chosen for {LABELS[r['variant']]}, batch {r['batch']} ({r.get('calibrate_s', 0):.1f} s to "
                  f"calibrate or read {r.get('calibration_file')}):")
            print("\n".join(format_choices(r["calibration"])))
    for r in case.rows:
        if r.get("onnxruntime_race"):
            from kestrel.export.onnxruntime_race import format_result

            print(f"kestrel, batch {r['batch']}, raced against onnxruntime "
                  f"({r.get('onnxruntime_race_s', 0):.1f} s, export included); the row ran {r.get('backend', '?')}:")
            print(format_result(REGISTRY[case.model].entry, r.get("onnxruntime_signature", ""), r["onnxruntime_race"]))
    for r in case.rows:
        for entry, chosen in (r.get("compile_choices") or {}).items():
            for signature, c in chosen.items():
                times = f" (compiled {c['compiled_s']:.4g} s, eager {c['eager_s']:.4g} s)" if "eager_s" in c else ""
                print(f"kestrel compile, batch {r['batch']}: {entry}({signature}) runs {c['path']}{times}")
    if args.profile:
        for r in case.rows:
            if r.get("profile"):
                print(f"\n-- profile: {case.name} {LABELS[r['variant']]} batch {r['batch']} --\n{r['profile']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=DEFAULT_MODELS, help=f"comma list from {', '.join(REGISTRY)}")
    ap.add_argument("--batch", default="1,8", help="comma list of batch sizes (default 1,8)")
    ap.add_argument("--repeat", type=int, default=3, help="timed calls per row (default 3; the median is shown)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every variant's row this many times, alternating the order, and pool the calls "
                         "(default 1; on a machine whose speed drifts between minutes, 2-3 keep the ratios fair)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls before timing (default 1)")
    ap.add_argument("--size", choices=("full", "small"), default="full",
                    help="full: the real configs; small: tiny configs for a smoke test")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"comma list from {', '.join(VARIANTS)} (default {','.join(DEFAULT_VARIANTS)})")
    ap.add_argument("--quick", action="store_true",
                    help="repeat 2, warmup 1, and each model's larger image sizes at batch 1 only")
    ap.add_argument("--threads", type=int, default=None, help="threads per row (default: physical cores)")
    ap.add_argument("--freezing", action="store_true",
                    help="inductor freezing for the transformers compile row (Kestrel's always freezes)")
    ap.add_argument("--malloc-cache", action="store_true",
                    help=f"every row (both sides) with GLIBC_TUNABLES={MALLOC_CACHE}: freed activations stay "
                         "mapped, so calls stop page-faulting (minor_faults_per_call in the JSON)")
    ap.add_argument("--profile", action="store_true",
                    help="print torch.profiler tables (by op and by shape) for the eager rows")
    ap.add_argument("--row-timeout", type=float, default=1800, help="seconds before a row is abandoned")
    ap.add_argument("--max-wait", type=float, default=120,
                    help="before each row, wait up to this many seconds for other processes to leave the CPUs "
                         "(under 15%% busy); 0: do not wait (default 120)")
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--export-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return run_worker_from_argv(args.worker)
    if args.export_worker:
        return run_export_from_argv(args.export_worker)

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in REGISTRY]
    if unknown:
        ap.error(f"unknown model {', '.join(unknown)}; known: {', '.join(REGISTRY)}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if [v for v in variants if v not in VARIANTS]:
        ap.error(f"--variants takes {', '.join(VARIANTS)}")
    batches = [int(b) for b in args.batch.split(",")]
    if args.quick:
        args.repeat, args.warmup = min(args.repeat, 2), min(args.warmup, 1)
    threads = args.threads or physical_cores()
    torch.set_num_threads(threads)

    print(f"machine: {cpu_name()}, {os.cpu_count()} logical CPUs, {physical_cores()} physical cores; "
          f"threads per row: {threads} (torch.set_num_threads, onnxruntime intra-op)")
    import onnxruntime
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, onnxruntime {onnxruntime.__version__}, "
          f"python {platform.python_version()}; f32; repeat {args.repeat}, warmup {args.warmup}"
          f"{', inductor freezing' if args.freezing else ''}{', malloc cache' if args.malloc_cache else ''}")
    peaks = gemm_peaks()
    peak_start = peaks["torch.mm"]
    print("f32 GEMM 2048x2048, best of 10, GFLOP/s: " + ", ".join(f"{k} {v:.1f}" for k, v in peaks.items()),
          flush=True)

    results: dict[str, Any] = {"machine": {"cpu": cpu_name(), "logical": os.cpu_count(),
                                           "physical": physical_cores(), "threads": threads},
                               "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                            "onnxruntime": onnxruntime.__version__},
                               "settings": vars(args) | {"worker": None, "export_worker": None},
                               "cases": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kestrel-bench-") as tmp:
        tmpdir = Path(tmp)
        cases: list[Case] = []
        for m in models:
            spec = REGISTRY[m]
            ckpt = tmpdir / m
            cfg, n_params = save_checkpoint(spec, args.size, ckpt)
            images = spec.images(args.size)
            title = spec.title if args.size == "full" else f"{spec.title.split(' (')[0]}, small test config"
            print(f"\n{m}: {title}, {n_params / 1e6:.1f} M params, random weights (seed 0), "
                  f"images {images}", flush=True)
            for image in images:
                case = Case(m, image, spec.flops(cfg, image))
                # quick: a model's largest image size (when it has several) runs at the smallest batch only
                big = len(images) > 1 and image == max(images)
                case_batches = [min(batches)] if args.quick and big else batches
                case_batches = [b for b in case_batches if b <= spec.max_batch] or [min(batches)]
                common = {"model": m, "size": args.size, "image": image, "checkpoint": str(ckpt), "threads": threads}
                if "onnx" in variants:
                    exp = run_subprocess_export(common | {"out": str(tmpdir / f"onnx-{case.name}")}, args.row_timeout)
                    case.onnx, case.onnx_error, case.export_s = exp.get("onnx"), exp.get("error"), exp.get("export_s")
                for b in case_batches:
                    race: dict[str, Any] = {}
                    if "kestrel" in variants:  # eager or onnxruntime, chosen here before the rows (not timed)
                        race = run_subprocess_export(common | {"race": True, "batch": b}, args.row_timeout)
                        print(f"  {case.name} kestrel race      batch {b}: "
                              f"{race.get('error') or race['onnxruntime_race']['kernel']}", flush=True)
                    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
                    for r in range(args.rounds):  # rounds alternate the order: no variant always goes first
                        for v in (variants if r % 2 == 0 else variants[::-1]):
                            job = common | {"variant": v, "batch": b, "repeat": args.repeat, "warmup": args.warmup,
                                            "freezing": args.freezing, "profile": args.profile,
                                            "malloc_cache": args.malloc_cache,
                                            "inductor_cache": str(tmpdir / f"inductor-{case.name}-{v}-{b}"),
                                            "output": str(tmpdir / f"out-{case.name}-{v}-{b}.pt"), "onnx": case.onnx}
                            if v == "onnx" and case.onnx is None:
                                row = {"error": f"export failed: {case.onnx_error}"}
                            else:
                                before = wait_quiet(args.max_wait) if args.max_wait > 0 else None
                                row = run_subprocess(job, args.row_timeout)
                                row["other_load_before"] = before
                            if v == "onnx" and "error" not in row and case.export_s is not None:
                                row["setup_s"] = case.export_s + row.get("setup_s", 0.0)
                            runs[v].append(row)
                            status = row.get("error") or f"{row['median']:.3f} s"
                            print(f"  {case.name} {v:<16} batch {b}: {status}", flush=True)
                    for v in variants:
                        case.rows.append(merge_rounds(runs[v]) | {"variant": v, "batch": b}
                                         | (race if v == "kestrel" and "error" not in race else {}))
                _compare(case, tmpdir)
                cases.append(case)
                print("\n(interim, % against the GEMM peaks measured at the start)", flush=True)
                print_case(case, args, peak_start, max(peaks.values()))
                sys.stdout.flush()
    peak_end = matmul_peak()
    peak = max(peak_start, peak_end)
    hw_peak = max([peak, *peaks.values()])
    print(f"\nf32 torch.mm peak at the end: {peak_end:.1f} GFLOP/s; % mm uses {peak:.1f}, % hw {hw_peak:.1f} GFLOP/s "
          f"(whole run {time.perf_counter() - started:.0f} s)")

    for case in cases:
        print_case(case, args, peak, hw_peak)
        results["cases"].append({"case": case.name, "model": case.model, "image": case.image,
                                 "gflop_per_item": case.flops / 1e9, "export_s": case.export_s,
                                 "rows": [{k: v for k, v in r.items() if k not in ("profile", "traceback")}
                                          for r in case.rows]})
    results["peak_gflops"] = {"start": peaks, "torch.mm end": peak_end, "mm": peak, "hw": hw_peak}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0


def merge_rounds(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's rounds as one row: every timed call pooled (median, min), the worst memory and load;
    ``round_medians`` keeps each round's own median, so drift between rounds shows."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return rows[-1]
    row = dict(ok[-1])
    if len(ok) > 1:
        times = [t for r in ok for t in r["times"]]
        row.update(times=times, median=statistics.median(times), min=min(times),
                   round_medians=[r["median"] for r in ok])
        for key in ("peak_mb", "other_load"):
            values = [r[key] for r in ok if isinstance(r.get(key), int | float)]
            if values:
                row[key] = max(values)
    return row


def run_subprocess_export(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--export-worker", json.dumps(job)]
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"export timed out after {timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    tail = (p.stderr or p.stdout).strip().splitlines()[-2:]
    return {"error": f"export exit {p.returncode}: " + " | ".join(tail)}


def _compare(case: Case, tmpdir: Path) -> None:
    """Every row's output against transformers eager at the same batch (rel diff)."""
    for r in case.rows:
        if "error" in r:
            continue
        ref_path = tmpdir / f"out-{case.name}-hf-{r['batch']}.pt"
        mine = tmpdir / f"out-{case.name}-{r['variant']}-{r['batch']}.pt"
        if r["variant"] == "hf" or not ref_path.exists() or not mine.exists():
            continue
        r["rel_diff"] = rel_diff(torch.load(mine), torch.load(ref_path))


if __name__ == "__main__":
    sys.exit(main())
