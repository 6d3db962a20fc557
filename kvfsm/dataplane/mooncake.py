"""Moved to kvfsm.dataplane.storage.mooncake; this path stays for users of the `kvfsm[mooncake]` extra."""

from .storage.mooncake import *  # noqa: F401,F403
from .storage.mooncake import __all__  # noqa: F401
