"""The generator: spec -> readable, fast Python in generated/."""

from kvfsm.codegen.generator import GenResult, generate, module_name, render, runtime_mismatch

__all__ = ["GenResult", "generate", "module_name", "render", "runtime_mismatch"]
