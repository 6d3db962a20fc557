"""`storage_extra` checked against the selected backend's constructor, so a typo or a wrong type is a
ConfigError naming the key when the config is made, not a TypeError after the host pool was allocated.

The accepted keys are read from the constructors' signatures (FileStorage, MooncakeStorage), so they
cannot drift from what the backends take; the keys the manager fills in itself are refused.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Union

from kvfsm.errors import ConfigError

STORAGE_BACKENDS = ("file", "mooncake", "none")
# Filled in by the manager from its own arguments and the config's other fields.
_SET_BY_MANAGER = {
    "directory": "storage_dir",
    "model_name": "model_name",
    "tp_rank": "tp_rank=",
    "tp_size": "tp_size=",
    "is_mla": "the device pool's KV config",
    "client": "storage=",
}
# Counts and timeouts that must be positive (every other number only non-negative).
_POSITIVE = {"writers", "workers", "replica_num"}


def _constructor(backend: str) -> Callable[..., Any]:
    if backend == "file":
        from kvfsm.dataplane.storage import FileStorage

        return FileStorage.__init__
    from kvfsm.dataplane.storage.mooncake.client import MooncakeStorage  # never imports mooncake itself

    return MooncakeStorage.__init__


@functools.cache
def backend_options(backend: str) -> dict[str, tuple[Any, bool]]:
    """Keyword options `storage_extra` may give the backend: name -> (type hint, required)."""
    if backend == "none":
        return {}
    init = _constructor(backend)
    hints = typing.get_type_hints(init)
    return {
        name: (hints.get(name, Any), p.default is inspect.Parameter.empty)
        for name, p in inspect.signature(init).parameters.items()
        if name != "self" and name not in _SET_BY_MANAGER
    }


def _accepts(hint: Any, value: Any) -> bool:
    """Whether `value` fits `hint` (plain types, optionals and unions; anything richer is left to the
    constructor). bool is not an int here, and an int is a float."""
    if hint is Any:
        return True
    if typing.get_origin(hint) in (Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    # a parameterized generic (tuple[int, int, int]) is left to the constructor: isinstance() refuses it as its
    # second argument (and Python 3.10 calls it a type, so it is named here, the same on every version)
    return isinstance(value, hint) if isinstance(hint, type) and not isinstance(hint, types.GenericAlias) else True


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def check_storage_extra(backend: str, extra: Mapping[str, Any]) -> None:
    """Raise ConfigError naming `storage_extra.<key>` unless every key is an option of `backend` with a
    value of its type, and every required option is given. `none` takes anything: the manager builds no
    store then, and the mapping is for whoever builds the `storage=` object (MooncakeStorage.from_config)."""
    if backend == "none":
        return
    options = backend_options(backend)
    for key, value in extra.items():
        field = f"storage_extra.{key}"
        if key in _SET_BY_MANAGER:
            raise ConfigError(
                field,
                f"set by the manager for storage_backend={backend!r} (from {_SET_BY_MANAGER[key]}); remove it here",
            )
        if key not in options:
            near = difflib.get_close_matches(str(key), options, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f" (options: {', '.join(sorted(options))})"
            raise ConfigError(field, f"not an option of storage_backend={backend!r}{hint}")
        hint_type, _ = options[key]
        if not _accepts(hint_type, value):
            raise ConfigError(field, f"expected {_name(hint_type)}, got {type(value).__name__} {value!r}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if key in _POSITIVE or key.endswith("_s"):
                if value <= 0:
                    raise ConfigError(field, f"must be positive, got {value!r}")
            elif value < 0:
                raise ConfigError(field, f"must not be negative, got {value!r}")
    for key, (_, required) in options.items():
        if required and key not in extra:
            what = " (mooncake_master's RPC address, host:port)" if key == "master_server_addr" else ""
            raise ConfigError(f"storage_extra.{key}", f"required for storage_backend={backend!r}{what}")
    if backend == "mooncake":
        _check_address(extra["master_server_addr"])


def _check_address(addr: str) -> None:
    """mooncake_master's RPC address: host:port (port a number), or a bare host (port 50051)."""
    field = "storage_extra.master_server_addr"
    if not addr.strip():
        raise ConfigError(field, "must be mooncake_master's RPC address, host:port")
    if "://" not in addr and ":" in addr:
        port = addr.rpartition(":")[2]
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(field, f"port {port!r} of {addr!r} is not a port number")
