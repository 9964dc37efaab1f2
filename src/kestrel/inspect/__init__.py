"""Printing programs: block listings, parameter manifests, JSON."""

from .manifest import format_parameters, parameter_rows, program_json
from .printer import format_block, format_program, format_signature, listed_blocks

__all__ = ["format_block", "format_parameters", "format_program", "format_signature", "listed_blocks",
           "parameter_rows", "program_json"]
