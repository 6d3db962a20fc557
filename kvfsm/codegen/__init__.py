"""The generator: spec -> readable, fast Python in generated/."""

from kvfsm.codegen.generator import GenResult, generate, module_name, render

__all__ = ["GenResult", "generate", "module_name", "render"]
