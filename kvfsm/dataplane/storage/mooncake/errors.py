"""The failure vocabulary of the Mooncake backend: the client's status codes, their names, MooncakeUnavailable.

A per-page outcome is an `int` (the client's status, or a byte count for reads) or one of the strings the
bounded call runner reports instead (TIMEOUT, WEDGED, ...); `error_name` turns either into the label that
`MooncakeStats.errors` counts and the logs show. Kept apart so every other module can share it.
"""

from __future__ import annotations

# Status codes the client returns (mooncake-store ErrorCode); anything else is logged by number.
OK = 0
NO_AVAILABLE_HANDLE = -200  # no space in any mounted segment: the store is full
INVALID_PARAMS = -600  # e.g. the destination is smaller than the object
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
RPC_FAIL = -900
RPC_TIMEOUT = -901
ERROR_NAMES = {
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE (store full)",
    INVALID_PARAMS: "INVALID_PARAMS",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    RPC_FAIL: "RPC_FAIL (master unreachable?)",
    RPC_TIMEOUT: "RPC_TIMEOUT",
}
TIMEOUT = "TIMEOUT"  # the call did not return within op_timeout_s
WEDGED = "WEDGED"  # every worker is stuck in an earlier call; not attempted


class MooncakeUnavailable(RuntimeError):
    """The Mooncake client cannot be used: not installed, master or metadata server unreachable, setup failed."""


def error_name(code: int | str) -> str:
    return code if isinstance(code, str) else ERROR_NAMES.get(code, f"error {code}")
