"""MooncakeStorage: a shared, distributed L3 (see client.py; this package split follows)."""

from . import client as _client

globals().update({k: v for k, v in vars(_client).items() if not k.startswith("__")})
__all__ = _client.__all__
