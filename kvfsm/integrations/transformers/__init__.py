"""Hugging Face transformers continuous batching, with its swaps run by kvfsm (see manager.py)."""

from .manager import *  # noqa: F401,F403
from .manager import __all__  # noqa: F401
