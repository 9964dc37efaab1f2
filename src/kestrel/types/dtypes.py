"""Element types and the generic kinds that range over them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "DTYPES", "AnyDType", "Bool", "DType", "DTypeKind", "DTypeVar", "Float", "Int", "bf16", "bool_", "dtype_named",
    "f16", "f32", "f64", "from_torch", "i32", "i64",
]


@dataclass(frozen=True)
class DType:
    """A concrete element type, spelled as in the seeds (``f32``, ``i32``...)."""

    name: str
    kind: str  # "Float", "Int" or "Bool"

    @property
    def torch(self) -> torch.dtype:
        return _TORCH[self.name]

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True)
class DTypeVar:
    """A dtype generic of a block or function, such as ``T: Float``."""

    name: str
    kind: str

    def __str__(self) -> str:
        return self.name


bool_ = DType("bool", "Bool")
i32 = DType("i32", "Int")
i64 = DType("i64", "Int")
f16 = DType("f16", "Float")
bf16 = DType("bf16", "Float")
f32 = DType("f32", "Float")
f64 = DType("f64", "Float")

DTYPES: dict[str, DType] = {d.name: d for d in (bool_, i32, i64, f16, bf16, f32, f64)}
_TORCH = {
    "bool": torch.bool, "i32": torch.int32, "i64": torch.int64, "f16": torch.float16,
    "bf16": torch.bfloat16, "f32": torch.float32, "f64": torch.float64,
}
_FROM_TORCH = {v: DTYPES[k] for k, v in _TORCH.items()}
ALIASES = {"float32": f32, "float": f32, "float16": f16, "half": f16, "bfloat16": bf16, "float64": f64,
           "int32": i32, "int64": i64}


def from_torch(dtype: torch.dtype) -> DType:
    try:
        return _FROM_TORCH[dtype]
    except KeyError:
        raise TypeError(f"kestrel has no element type for torch dtype {dtype}") from None


def dtype_named(name: str) -> DType:
    """``f32``, ``float32``, ``bf16``... -> DType, with a clear error for anything else."""
    found = DTYPES.get(name) or ALIASES.get(name)
    if found is None:
        known = ", ".join(DTYPES)
        raise ValueError(f"unknown dtype {name!r}; expected one of {known}")
    return found


class DTypeKind:
    """A kind of dtype generic: ``Float``, ``Int``, ``Bool`` or ``Any``."""

    def __init__(self, name: str, members: tuple[DType, ...]) -> None:
        self.name = name
        self.members = members

    def admits(self, d: DType) -> bool:
        return d in self.members

    def __repr__(self) -> str:
        return self.name


Float = DTypeKind("Float", (f16, bf16, f32, f64))
Int = DTypeKind("Int", (i32, i64))
Bool = DTypeKind("Bool", (bool_,))
AnyDType = DTypeKind("DType", tuple(DTYPES.values()))
KINDS = {k.name: k for k in (Float, Int, Bool, AnyDType)}
