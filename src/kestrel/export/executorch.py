"""ExecuTorch export: one ``.pte`` program per entry, lowered for WebGPU, XNNPACK or the portable kernels.

>>> vit = kestrel.load("vit-base-patch16-224")
>>> export_executorch(vit, "out/", target="executorch-webgpu")   # forward.pte, forward_portable.pte, ...

Each program is ``torch.export.export(strict=False)`` of one entry of a bound model (every axis
fixed), then ``to_edge_transform_and_lower(partitioner=[...])`` and ``to_executorch()``:

- ``webgpu``: ``WebGPUPartitioner()`` (the Vulkan partitioner and serializer behind a WebGPU front);
  attention is rewritten to the delegate's fused ``et_vk.sdpa`` op first, because torch's own SDPA
  decomposes into a masked softmax whose ``any``/``mul`` nodes the delegate does not take;
- ``xnnpack``: ``XnnpackPartitioner()``, for CPUs;
- ``portable``: no partitioner: ExecuTorch's portable kernels, which ``executorch.runtime`` runs
  here, so it is the validation artifact for the WebGPU program (no WebGPU runtime on this machine).

:func:`graph_summary` reads the op counts back from the written program: the kernels the runtime
calls outside any delegate, and per delegate the ops it runs (for the Vulkan/WebGPU delegate the
operator chain of its serialized graph, ``et_vk.prepack`` included).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import operator
import re
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import KestrelError, import_extra
from .manifest import quiet

BACKENDS = ("webgpu", "xnnpack", "portable")

# one line per backend: what ``manifest.export.partitioner`` says
PARTITIONERS = {
    "webgpu": "executorch.backends.webgpu.partitioner.WebGPUPartitioner() (default compile options; wraps "
              "VulkanPartitioner)",
    "xnnpack": "executorch.backends.xnnpack.partition.xnnpack_partitioner.XnnpackPartitioner() (default options)",
    "portable": "none (portable kernels, no delegate)",
}
API = ("torch.export.export(strict=False) -> to_edge_transform_and_lower(partitioner=[{p}]) -> to_executorch(), "
       "one program per module")
SDPA_REWRITE = "attention via torch.ops.et_vk.sdpa (same math as torch SDPA; checked in validation.json)"
POOL_REWRITE = ("q-pooling of windowed tensors [nW,C,h,w] done as one batch-1 max_pool2d over the windows stacked "
                "along H (exact: h is a multiple of the stride); keeps all pools in the delegate")


class ExecuTorchError(KestrelError, RuntimeError):
    """A program that could not be exported or lowered, naming the program and the cause."""


def require_executorch() -> str:
    """The installed executorch version; a clear error naming the extra when it is missing."""
    from importlib.metadata import version

    import_extra("executorch", error=ExecuTorchError,
                 message="the ExecuTorch targets need executorch: pip install 'kestrel[edge]' "
                         "(executorch==1.5.1 beside torch==2.13.0)")
    return version("executorch")


@dataclass
class Lowered:
    """One lowered program: the ``.pte`` bytes, what :func:`graph_summary` reads from them, and the
    graph rewrites actually applied while lowering (with how many nodes each touched)."""

    name: str
    backend: str
    buffer: bytes
    graph: dict[str, Any]
    rewrites: dict[str, int] = field(default_factory=dict)
    # the rewritten graph run in torch eager (et_vk.sdpa's reference kernel) on the example inputs,
    # beside the module's own outputs: what checks the rewrites, since no WebGPU runtime runs here
    rewritten_outputs: list[torch.Tensor] | None = None
    module_outputs: list[torch.Tensor] | None = None


def lower(module: nn.Module, inputs: Sequence[torch.Tensor], backend: str, name: str = "forward") -> Lowered:
    """Export ``module(*inputs)`` and lower it for ``backend`` (``webgpu``, ``xnnpack``, ``portable``)."""
    if backend not in BACKENDS:
        raise ExecuTorchError(f"{name}: unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    require_executorch()
    root_level = logging.getLogger().level
    from executorch.exir import to_edge_transform_and_lower

    partitioners = _partitioners(backend)
    logging.getLogger().setLevel(root_level)  # the Vulkan partitioner's import sets the root logger to INFO
    module = module.eval()
    # ExecuTorch's lowering logs every op it cannot take at INFO level and warns a lot: keep it quiet
    with torch.no_grad(), quiet(("",), logging.WARNING):
        try:
            # contiguous examples: the program's inputs keep the examples' dim order
            ep = torch.export.export(module, tuple(t.contiguous() for t in inputs), strict=False)
        except Exception as e:
            raise ExecuTorchError(f"{name}: torch.export failed: {type(e).__name__}: {_first_line(e)}") from e
        rewrites: dict[str, int] = {}
        checked: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
        if backend == "webgpu":
            for text, rewrite in ((POOL_REWRITE, rewrite_window_pools), (SDPA_REWRITE, rewrite_sdpa)):
                n = rewrite(ep)
                if n:
                    rewrites[text] = n
            if rewrites:
                examples = [t.contiguous() for t in inputs]
                checked = (_as_list(ep.module()(*examples)), _as_list(module(*examples)))
        try:
            edge = to_edge_transform_and_lower(ep, partitioner=partitioners)
            delegate_ops = _edge_delegate_ops(edge)
            buffer = edge.to_executorch().buffer
        except Exception as e:
            raise ExecuTorchError(f"{name}: lowering for {backend} failed: {type(e).__name__}: "
                                  f"{_first_line(e)}") from e
    return Lowered(name, backend, bytes(buffer), graph_summary(bytes(buffer), delegate_ops), rewrites,
                   *(checked or (None, None)))


def _as_list(out: Any) -> list[torch.Tensor]:
    return [t.detach() for t in out] if isinstance(out, (tuple, list)) else [out.detach()]


def _partitioners(backend: str) -> list[Any]:
    if backend == "webgpu":
        from executorch.backends.webgpu.partitioner import WebGPUPartitioner

        return [WebGPUPartitioner()]
    if backend == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return [XnnpackPartitioner()]
    return []


# ------------------------------------------------------------------------------------ rewrites


def rewrite_sdpa(ep: torch.export.ExportedProgram) -> int:
    """Replace plain ``aten.scaled_dot_product_attention`` nodes by ``et_vk.sdpa`` in place; return how many.

    Only non-causal, dropout-free, non-GQA calls with no mask or an additive float mask qualify
    (``et_vk.sdpa`` computes ``softmax(q k^T * scale + mask) v``, the same math); others are left.
    """
    import executorch.backends.vulkan.custom_ops_lib  # noqa: F401  (registers torch.ops.et_vk.sdpa)

    target = torch.ops.aten.scaled_dot_product_attention.default
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    defaults: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
                                "enable_gqa": False}
    count = 0
    graph = ep.graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not target:
            continue
        args = {**defaults, **dict(zip(names, node.args)), **node.kwargs}
        mask = args["attn_mask"]
        if args["dropout_p"] or args["is_causal"] or args["enable_gqa"]:
            continue
        if mask is not None and not (hasattr(mask, "meta") and mask.meta["val"].dtype.is_floating_point):
            continue
        q, k, v = (args[n].meta.get("val") for n in ("query", "key", "value"))
        if q is None or k is None or v is None or not (q.dim() == k.dim() == v.dim() >= 3):
            continue
        lead = tuple(int(d) for d in q.shape[:-3])
        if len(lead) > 1 and (tuple(k.shape[:-3]) != lead or tuple(v.shape[:-3]) != lead):
            continue  # broadcast batch axes: left as they are
        tail = [int(d) for d in mask.meta["val"].shape[-3:]] if mask is not None else []
        if len(lead) > 1 and mask is not None and len(tail) < 3:
            continue
        add = _adder(graph, node)
        with graph.inserting_before(node):
            if len(lead) <= 1:
                new = add(torch.ops.et_vk.sdpa.default, args["query"], args["key"], args["value"], mask,
                          args["scale"])
            else:  # the delegate's sdpa is 4-D: fold the leading batch axes into one
                nb = math.prod(lead)
                folded = [add(torch.ops.aten.reshape.default, args[a], [nb, *(int(d) for d in t.shape[-3:])])
                          for a, t in (("query", q), ("key", k), ("value", v))]
                if mask is not None:
                    mask = add(torch.ops.aten.reshape.default,
                               add(torch.ops.aten.expand.default, mask, [*lead, *tail]), [nb, *tail])
                out = add(torch.ops.et_vk.sdpa.default, *folded, mask, args["scale"])
                new = add(torch.ops.aten.reshape.default, out, [*lead, *(int(d) for d in node.meta["val"].shape[-3:])])
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        count += 1
    if count:
        graph.lint()
        ep.graph_module.recompile()
    return count


def _adder(graph: Any, like: Any) -> Any:
    """``add(target, *args)``: a new node before the insertion point, ``like``'s meta, its own value
    computed on the fake tensors of its arguments (what the lowering passes read)."""
    from torch._guards import detect_fake_mode

    vals = [a.meta["val"] for a in like.all_input_nodes if "val" in a.meta]
    mode = detect_fake_mode(vals)

    def add(target: Any, *args: Any) -> Any:
        node = graph.call_function(target, args)
        node.meta = {k: v for k, v in like.meta.items() if k != "val"}
        with mode if mode is not None else contextlib.nullcontext():
            node.meta["val"] = target(*[a.meta["val"] if hasattr(a, "meta") else a for a in args])
        return node

    return add


def rewrite_window_pools(ep: torch.export.ExportedProgram) -> int:
    """Replace batched ``max_pool2d`` (kernel = stride, no padding) over ``[N, C, h, w]`` windows by
    one batch-1 pool over the windows stacked along H; return how many.

    The Vulkan delegate keeps a batch-N tensor as N * C/4 texture layers, which for Hiera's windows
    (hundreds of them) passes the texture limit; ``[1, C, N * h, w]`` does not. Exact when ``h`` is a
    multiple of the stride (no pooling window straddles two windows).
    """
    aten = torch.ops.aten
    graph = ep.graph_module.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.max_pool2d.default,
                                                             aten.max_pool2d_with_indices.default):
            continue
        x = node.args[0]
        names = ["input", "kernel_size", "stride", "padding", "dilation", "ceil_mode"]
        args = {"stride": [], "padding": 0, "dilation": 1, "ceil_mode": False,
                **dict(zip(names, node.args)), **node.kwargs}
        k = _pair(args["kernel_size"])
        st = _pair(args["stride"]) if args["stride"] else k
        val = x.meta.get("val") if hasattr(x, "meta") else None
        if (val is None or val.dim() != 4 or val.shape[0] == 1 or k != st or _pair(args["padding"]) != (0, 0)
                or _pair(args["dilation"]) != (1, 1) or args["ceil_mode"] or val.shape[2] % st[0]
                or val.shape[3] % st[1]):
            continue
        n, c, h, w = (int(d) for d in val.shape)
        add = _adder(graph, node)

        with graph.inserting_before(node):
            stacked = add(aten.reshape.default, add(aten.permute.default, x, [1, 0, 2, 3]), [1, c, n * h, w])
            pooled = add(aten.max_pool2d.default, stacked, list(k), list(st))
            back = add(aten.permute.default, add(aten.reshape.default, pooled, [c, n, h // st[0], w // st[1]]),
                       [1, 0, 2, 3])
        if node.target is aten.max_pool2d.default:
            node.replace_all_uses_with(back)
        else:  # (values, indices): only the values may be used
            users = list(node.users)
            if any(u.target is not operator.getitem or u.args[1] != 0 for u in users):
                graph.erase_node(back)
                continue
            for u in users:
                u.replace_all_uses_with(back)
                graph.erase_node(u)
        graph.erase_node(node)
        count += 1
    if count:
        graph.eliminate_dead_code()
        graph.lint()
        ep.graph_module.recompile()
    return count


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    v = list(v)
    return (int(v[0]), int(v[-1])) if v else (0, 0)


# ------------------------------------------------------------------------------- graph summary


def op_name(target: Any) -> str:
    """``aten.linear.default`` for an aten/edge op overload (the name the Vulkan serializer writes)."""
    target = getattr(target, "_op", target)
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


@dataclass
class DelegateOps:
    """One lowered subgraph of the edge program: its ops and its user inputs and outputs."""

    ops: Counter[str]
    inputs: int
    outputs: int


def _edge_delegate_ops(edge: Any) -> list[DelegateOps]:
    """Per lowered submodule of the edge program, in call order: the ops of its original graph."""
    gm = edge.exported_program().graph_module
    out: list[DelegateOps] = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "executorch_call_delegate":
            original = getattr(gm, node.args[0].target).original_module
            ops = Counter(op_name(n.target) for n in original.graph.nodes
                          if n.op == "call_function" and op_name(n.target) != "getitem")
            sig = original.graph_signature
            out.append(DelegateOps(ops, len(sig.user_inputs), len(sig.user_outputs)))
    return out


def graph_summary(buffer: bytes, delegate_ops: Sequence[DelegateOps] | None = None) -> dict[str, Any]:
    """The seed's ``graph`` row of one program, read from its ``.pte`` bytes.

    ``non_delegated_kernels``: kernel calls outside any delegate, by operator (``aten::mul.Scalar_out``);
    ``delegates``: per delegate call its backend id, its ops (the serialized graph's operator chain
    for the Vulkan delegate, otherwise the lowered subgraph's ops from ``delegate_ops``), and its
    number of inputs and outputs; ``io``: the methods and the first method's tensors as stored.
    """
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(buffer).program
    plan = program.execution_plan[0]
    kernels: Counter[str] = Counter()
    delegate_calls: list[Any] = []
    for chain in plan.chains:
        for ins in chain.instructions:
            args = ins.instr_args
            kind = type(args).__name__
            if kind == "KernelCall":
                o = plan.operators[args.op_index]
                kernels[f"{o.name}.{o.overload}" if o.overload else o.name] += 1
            elif kind == "DelegateCall":
                delegate_calls.append(args)
    delegates = []
    for i, call in enumerate(delegate_calls):
        d = plan.delegates[call.delegate_index]
        row: dict[str, Any] = {"id": d.id}
        vk = _vulkan_graph(program, d) if d.id == "VulkanBackend" else None
        if vk is not None:
            row["ops"] = dict(Counter(c["name"] for c in vk.get("chain", [])))
            row["inputs"] = len(vk.get("input_ids", []))
            row["outputs"] = len(vk.get("output_ids", []))
        else:
            known = delegate_ops[i] if delegate_ops is not None and i < len(delegate_ops) else None
            row["ops"] = dict(known.ops) if known else None
            row["inputs"] = known.inputs if known else None
            row["outputs"] = known.outputs if known else None
        delegates.append(row)
    return {
        "non_delegated_kernels": dict(kernels),
        "delegates": delegates,
        "io": {
            "methods": [p.name for p in program.execution_plan],
            "inputs": [_tensor_io(plan, i) for i in plan.inputs],
            "outputs": [_tensor_io(plan, i) for i in plan.outputs],
        },
    }


def _tensor_io(plan: Any, index: int) -> dict[str, Any]:
    t = plan.values[index].val
    if type(t).__name__ != "Tensor":
        return {"kind": type(t).__name__}
    return {"shape": list(t.sizes), "dtype": getattr(t.scalar_type, "name", str(t.scalar_type)),
            "dim_order": list(t.dim_order)}


def _vulkan_graph(program: Any, delegate: Any) -> dict[str, Any] | None:
    """The Vulkan delegate's serialized graph (``VkGraph``) as a dict, decompiled with flatc."""
    from executorch.backends.vulkan.serialization.vulkan_graph_serialize import extract_vk_flatbuffer

    if int(delegate.processed.location) != 0:  # DataLocation.INLINE: the bytes live in the program
        return None
    data = program.backend_delegate_data[delegate.processed.index].data
    return decompile_vk_graph(extract_vk_flatbuffer(bytes(data)))


def decompile_vk_graph(flatbuffer: bytes) -> dict[str, Any]:
    import importlib.resources

    import executorch.backends.vulkan.serialization as vk_serialization
    from executorch.exir._serialize._flatbuffer import _flatc_decompile

    with tempfile.TemporaryDirectory() as d:
        schema = importlib.resources.files(vk_serialization).joinpath("schema.fbs").read_bytes()
        with open(f"{d}/schema.fbs", "wb") as f:
            f.write(schema)
        with open(f"{d}/schema.bin", "wb") as f:
            f.write(flatbuffer)
        _flatc_decompile(d, f"{d}/schema.fbs", f"{d}/schema.bin", ["--raw-binary"])
        with open(f"{d}/schema.json") as f:
            text = f.read()
    # flatc writes non-finite doubles (a -inf fill value) as bare words, which JSON has no spelling for
    text = re.sub(r"(?<=[:\[,]\s)(-?)(inf|nan)\b", r'"\1\2"', text)
    return json.loads(text)


# ---------------------------------------------------------------------------------------- util


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


