"""Example inputs for a bound model's entry, built from the entry's declared types.

Used to calibrate and to time a model (``kestrel doctor --model``, ``kestrel bench``) without a
dataset: every dimension comes from the model's bound generics; ``B`` is the batch asked for and any
other free dimension (a prompt count, points per prompt) is 1. Floats are seeded normal noise,
integers zeros (a valid token id and a valid point label).
"""

from __future__ import annotations

from typing import Any

import torch

from ..blocks import Block
from ..shapes.poly import Poly
from ..types.dtypes import DType
from ..types.tensor import TensorType, Variadic


def entry_names(model: Block) -> list[str]:
    return [fn.name for fn in type(model).decl().entries]


def example_inputs(model: Block, entry: str, batch: int = 1, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """One tensor per declared input of ``entry``, shaped as the bound model declares it."""
    fn = type(model).decl().function(entry)
    if fn is None or entry not in entry_names(model):
        raise ValueError(f"{type(model).decl().qualname} has no entry {entry!r}; entries: "
                         f"{', '.join(entry_names(model))}")
    dims: dict[str, Any] = {k: v for k, v in model.generics.items() if isinstance(v, int)}
    dtypes = {k: v for k, v in model.generics.items() if isinstance(v, DType)}
    dims.setdefault("B", batch)
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, declared in fn.params:
        if not isinstance(declared, TensorType):
            raise ValueError(f"{entry}: input {name} is not a tensor")
        t = declared.substitute(dims, dtypes)
        shape = []
        for d in t.dims:
            if isinstance(d, Variadic):
                raise ValueError(f"{entry}: input {name} has a variadic shape; give inputs yourself")
            p = d if isinstance(d, Poly) else Poly.of(d)
            if not p.is_const:
                p = _substitute_free(p)
            shape.append(p.value)
        dtype = t.dtype.torch if isinstance(t.dtype, DType) else torch.float32
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=g).to(dtype))
        else:
            out.append(torch.zeros(shape, dtype=dtype))
    return tuple(out)


def _substitute_free(p: Poly) -> Poly:
    from ..shapes.poly import substitute

    return substitute(p, {s.name: 1 for s in p.symbols()})
