"""Getting a usable Mooncake client, in bounded time: import the wheel, probe the addresses, run setup.

`mooncake` is imported here only when a client is actually built (`import_store_class`, `connect`), so
kvfsm imports without the extra. Construction probes the master and the metadata server with a TCP connect
and raises MooncakeUnavailable with the address when either is unreachable (instead of the client's ~90 s
of setup retries). The client's setup() holds the GIL, so no Python timeout can cut it short: `connect`
bounds it through the client's own settings, which it sets when the environment does not
(`MC_STORE_CLIENT_SETUP_RETRIES` from setup_timeout_s, `MC_RPC_TIMEOUT_MS` from op_timeout_s; both are read
at setup).
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any
from urllib.parse import urlsplit

from .errors import MooncakeUnavailable

_INSTALL_HINT = (
    "pip install 'kvfsm[mooncake]' (CPU wheel mooncake-transfer-engine-non-cuda; on CUDA hosts "
    "pip install mooncake-transfer-engine) and apt-get install libibverbs1"
)


def import_store_class() -> Any:
    """`mooncake.store.MooncakeDistributedStore`, or MooncakeUnavailable saying what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except (ImportError, OSError) as e:
        raise MooncakeUnavailable(f"mooncake is not usable ({e}); {_INSTALL_HINT}") from e
    return MooncakeDistributedStore


def _host_port(addr: str, default_port: int) -> tuple[str, int]:
    if "://" in addr:
        u = urlsplit(addr)
        return u.hostname or "127.0.0.1", u.port or default_port
    host, _, port = addr.rpartition(":")
    if not host:
        return addr, default_port
    return host.strip("[]"), int(port)


def probe(addr: str, what: str, timeout: float, default_port: int) -> None:
    """Raise MooncakeUnavailable unless a TCP connection to `addr` opens within `timeout` seconds."""
    host, port = _host_port(addr, default_port)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        raise MooncakeUnavailable(
            f"Mooncake {what} at {host}:{port} is unreachable ({e}); is mooncake_master running there?"
        ) from e


def connect(
    master_server_addr: str,
    metadata_server: str,
    *,
    local_hostname: str,
    protocol: str,
    device_name: str,
    global_segment_size: int,
    local_buffer_size: int,
    replica_num: int,
    op_timeout_s: float,
    setup_timeout_s: float,
    connect_timeout_s: float,
) -> tuple[Any, Any]:
    """A set-up `MooncakeDistributedStore` and the `ReplicateConfig` for its puts; MooncakeUnavailable otherwise."""
    store_cls = import_store_class()
    from mooncake.store import ReplicateConfig

    put_config = ReplicateConfig()
    put_config.replica_num = int(replica_num)
    probe(master_server_addr, "master", connect_timeout_s, 50051)
    if metadata_server.startswith(("http://", "https://")):
        probe(metadata_server, "metadata server", connect_timeout_s, 8080)
    # The client's setup holds the GIL (no Python-side timeout can fire during it): bound it by its own
    # retry count and RPC timeout, unless the environment already says otherwise.
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(max(1, int(setup_timeout_s // 5))))
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(max(1000, int(op_timeout_s * 1000))))
    client = _setup(
        store_cls,
        master_server_addr,
        metadata_server,
        local_hostname,
        global_segment_size,
        local_buffer_size,
        protocol,
        device_name,
        setup_timeout_s,
    )
    return client, put_config


def _setup(
    store_cls: Any,
    master_server_addr: str,
    metadata_server: str,
    local_hostname: str,
    global_segment_size: int,
    local_buffer_size: int,
    protocol: str,
    device_name: str,
    timeout: float,
) -> Any:
    client = store_cls()
    box: dict[str, Any] = {}

    def go() -> None:
        try:
            box["rc"] = client.setup(
                local_hostname,
                metadata_server,
                int(global_segment_size),
                int(local_buffer_size),
                protocol,
                device_name,
                master_server_addr,
            )
        except BaseException as e:  # reported below
            box["error"] = e

    t = threading.Thread(target=go, name="kvfsm-mooncake-setup", daemon=True)
    t.start()
    t.join(timeout)
    where = f"master {master_server_addr}, metadata {metadata_server}"
    if t.is_alive():
        raise MooncakeUnavailable(f"Mooncake client setup did not finish within {timeout:g}s ({where})")
    if "error" in box:
        raise MooncakeUnavailable(f"Mooncake client setup failed ({where}): {box['error']}") from box["error"]
    if box.get("rc") != 0:
        raise MooncakeUnavailable(f"Mooncake client setup returned {box.get('rc')} ({where})")
    return client
