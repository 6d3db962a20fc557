"""The bounded exhaustive explorer (see search.py; this package split follows)."""

from . import search as _search

globals().update({k: v for k, v in vars(_search).items() if not k.startswith("__")})
