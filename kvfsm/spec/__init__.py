"""The spec format: pydantic models, a line-aware loader, a guard language and semantic checks."""

from kvfsm.spec.checks import load_spec
from kvfsm.spec.compiled import CompiledSpec, Outcome, Transition
from kvfsm.spec.errors import SpecError, SpecInvalid

__all__ = ["CompiledSpec", "Outcome", "SpecError", "SpecInvalid", "Transition", "load_spec"]
