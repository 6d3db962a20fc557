"""The spec interpreted by the `transitions` library: a slow, independent oracle for the generated code."""

from kvfsm.reference.interpreter import ReferenceMachine

__all__ = ["ReferenceMachine"]
