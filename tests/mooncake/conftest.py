"""A real Mooncake Store for the tests: `mooncake_master` started on free loopback ports, stopped by its pid.

Everything stays on 127.0.0.1: the master binds RPC and metrics there and serves transfer-engine metadata
over HTTP; clients advertise 127.0.0.1 and (MC_TE_FILTERS=lo, MC_TCP_BIND_ADDRESS) use the loopback
interface only. Master RPCs time out after 3 s inside the client (MC_RPC_TIMEOUT_MS), so no call hangs.

Without the mooncake wheel or libibverbs the tests skip with the reason; with KVFSM_REQUIRE_MOONCAKE=1
(set by .ci/run) they fail instead, so CI cannot pass by skipping them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from mooncake_helpers import free_port

from kvfsm.dataplane.mooncake import LOOPBACK_ENV, MooncakeUnavailable, import_store_class, master_binary, master_command

# Before any client exists in this process (or in a child it starts).
os.environ.update(LOOPBACK_ENV)
os.environ.setdefault("MC_RPC_TIMEOUT_MS", "3000")
os.environ.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", "1000")
os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "2")

REQUIRED = os.environ.get("KVFSM_REQUIRE_MOONCAKE") == "1"


def unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"{reason} (KVFSM_REQUIRE_MOONCAKE=1)")
    pytest.skip(reason)


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the test process dies (a crash must not leak a master)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class Master:
    proc: subprocess.Popen
    rpc_port: int
    http_port: int
    metrics_port: int
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL by pid (the 'master dies' fault)."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(10)


def start_master(log_dir: Path, extra: tuple[str, ...] = (), attempts: int = 3) -> Master:
    binary = master_binary()
    if binary is None:
        unavailable("mooncake_master binary not found in the mooncake wheel")
    last = ""
    for _ in range(attempts):  # a picked port can be taken before the master binds it: retry with new ones
        rpc, http, metrics = free_port(), free_port(), free_port()
        log = log_dir / f"mooncake_master-{rpc}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(master_command(binary, rpc, http, metrics, extra=extra), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(os.environ),
                                    start_new_session=True, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None:
            if _accepts(rpc) and _accepts(http):
                return Master(proc, rpc, http, metrics, log)
            time.sleep(0.05)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        last = log.read_text(errors="replace")[-2000:]
        if "error while loading shared libraries" in last:
            unavailable(f"mooncake_master cannot start: {last.strip().splitlines()[-1]} (apt-get install libibverbs1)")
    raise RuntimeError(f"mooncake_master did not come up on loopback; last log:\n{last}")


@pytest.fixture(scope="session")
def mooncake_available() -> None:
    try:
        import_store_class()
    except MooncakeUnavailable as e:
        unavailable(str(e))


@pytest.fixture(scope="session")
def mooncake_master(mooncake_available: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    """One master for the session (tests isolate their pages by model name)."""
    master = start_master(tmp_path_factory.mktemp("mooncake"))
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def master_factory(mooncake_available: None, tmp_path: Path) -> Iterator[Callable[..., Master]]:
    """Private masters for tests that fill or kill theirs; all stopped (by pid) at teardown."""
    started: list[Master] = []

    def make(*extra: str) -> Master:
        m = start_master(tmp_path, tuple(extra))
        started.append(m)
        return m

    try:
        yield make
    finally:
        for m in started:
            m.stop()


@pytest.fixture
def make_storage(mooncake_master: Master) -> Iterator[Callable[..., Any]]:
    """MooncakeStorage factory with small, bounded settings and a model name unique to the test."""
    from kvfsm.dataplane.mooncake import MooncakeStorage

    made: list[MooncakeStorage] = []
    model = f"test/{uuid.uuid4().hex[:8]}"

    def make(master: Master | None = None, **kw: Any) -> MooncakeStorage:
        m = master or mooncake_master
        kw.setdefault("model_name", model)
        kw.setdefault("global_segment_size", 64 << 20)
        kw.setdefault("local_buffer_size", 16 << 20)
        kw.setdefault("op_timeout_s", 5.0)
        kw.setdefault("setup_timeout_s", 15.0)
        kw.setdefault("close_timeout_s", 3.0)
        kw.setdefault("read_pool_bytes", 16 << 20)
        s = MooncakeStorage(m.addr, m.metadata, **kw)
        made.append(s)
        return s

    try:
        yield make
    finally:
        for s in reversed(made):
            s.close()
