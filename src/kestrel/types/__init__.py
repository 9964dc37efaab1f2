"""Tensor types, dtypes and the type notation parser."""

from .dtypes import (
    DTYPES,
    AnyDType,
    Bool,
    DType,
    DTypeKind,
    DTypeVar,
    Float,
    Int,
    bf16,
    bool_,
    dtype_named,
    f16,
    f32,
    f64,
    from_torch,
    i32,
    i64,
)
from .tensor import Scope, TensorType, TupleType, Type, Variadic, parse_param, parse_type

__all__ = [
    "DTYPES", "AnyDType", "Bool", "DType", "DTypeKind", "DTypeVar", "Float", "Int", "Scope", "TensorType",
    "TupleType", "Type", "Variadic", "bf16", "bool_", "dtype_named", "f16", "f32", "f64", "from_torch",
    "i32", "i64", "parse_param", "parse_type",
]
