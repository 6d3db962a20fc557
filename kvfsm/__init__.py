"""kvfsm: a formally specified KV-cache offload lifecycle for LLM serving engines."""

__version__ = "0.1.0"
