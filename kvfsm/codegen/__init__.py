"""The generator: spec -> readable, fast Python in generated/ (the per-request machine and, codegen/rows.py,
the struct-of-arrays batch machine)."""

from kvfsm.codegen.generator import GenResult, generate, module_name, render, runtime_mismatch
from kvfsm.codegen.rows import RowsUnsupported, render_rows, rows_module_name

__all__ = [
    "GenResult",
    "RowsUnsupported",
    "generate",
    "module_name",
    "render",
    "render_rows",
    "rows_module_name",
    "runtime_mismatch",
]
