"""Running a mooncake_master for kvfsm's tests and benchmark: its command line, its binary, loopback settings.

Nothing here talks to the store: the helpers build a master's command line, find the binary the `mooncake`
wheel ships (without importing the wheel) and name the transfer-engine settings that keep a client on loopback.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence


def master_command(
    binary: str, rpc_port: int, http_port: int, metrics_port: int, host: str = "127.0.0.1", extra: Sequence[str] = ()
) -> list[str]:
    """The mooncake_master command line kvfsm's tests and benchmark use: RPC, HTTP metadata and metrics on `host`."""
    return [
        binary,
        f"--rpc_address={host}",
        f"--rpc_port={rpc_port}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={host}",
        f"--http_metadata_server_port={http_port}",
        f"--metrics_host={host}",
        f"--metrics_port={metrics_port}",
        "--enable_metric_reporting=false",
        "--logtostderr",
        *extra,
    ]


def master_binary() -> str | None:
    """Path of the mooncake_master binary shipped in the mooncake wheel (None when not installed)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return None
    for d in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(d, "mooncake_master")
        if os.path.isfile(path):
            if not os.access(path, os.X_OK):
                os.chmod(path, os.stat(path).st_mode | 0o111)
            return path
    return None


LOOPBACK_ENV: Mapping[str, str] = {
    "MC_TE_FILTERS": "lo",  # the transfer engine picks the loopback interface
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",  # and binds its TCP transport there
}
