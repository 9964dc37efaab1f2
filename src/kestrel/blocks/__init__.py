"""Block declarations: generics, params, subs, sub arrays, where facts, typed functions."""

from ..types.dtypes import AnyDType, Bool, Float, Int, bf16, bool_, f16, f32, f64, i32, i64
from .block import BindError, Block, EntryError, parameter_manifest, variant
from .decl import BlockDecl, DeclarationError, FnDecl, GenericDecl, ParamDecl, SubDecl
from .spec import Array, Dim, Layers, Param, Runs, Shape, each, entry, optional, runs

__all__ = [
    "AnyDType", "Array", "BindError", "Block", "BlockDecl", "Bool", "DeclarationError", "Dim", "EntryError",
    "Float", "FnDecl", "GenericDecl", "Int", "Layers", "Param", "ParamDecl", "Runs", "Shape", "SubDecl", "bf16",
    "bool_", "each", "entry", "f16", "f32", "f64", "i32", "i64", "optional", "parameter_manifest", "runs", "variant",
]
