"""A real Mooncake Store for the tests: `mooncake_master` started on free loopback ports, stopped by its pid.

Everything stays on 127.0.0.1: the master binds RPC and metrics there and serves transfer-engine metadata
over HTTP; clients advertise 127.0.0.1 and (MC_TE_FILTERS=lo, MC_TCP_BIND_ADDRESS) use the loopback
interface only. Master RPCs time out after 3 s inside the client (MC_RPC_TIMEOUT_MS), so no call hangs.

Without the mooncake wheel or libibverbs the tests skip with the reason; with KVFSM_REQUIRE_MOONCAKE=1
(set by .ci/run) they fail instead, so CI cannot pass by skipping them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mooncake_helpers import free_port
from timing import TimedOut, tree_cpu, wait_for

from kvfsm.dataplane.storage.mooncake import (
    LOOPBACK_ENV,
    MooncakeUnavailable,
    import_store_class,
    master_binary,
    master_command,
)

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


_SETPRIV = shutil.which("setpriv")
MASTER_UP_S = 20.0  # a master that neither listens nor uses CPU for this long (scaled) is stuck
MASTER_CEILING_S = 300.0  # and one that has not listened after this long, however busy, too


def _command(rpc: int, http: int, metrics: int, extra: tuple[str, ...]) -> list[str]:
    """The master's command line, under `setpriv --pdeathsig KILL` where util-linux has it, so the master dies
    with the test process even if that crashes (no preexec_fn: not safe once client threads exist)."""
    cmd = master_command(master_binary(), rpc, http, metrics, extra=extra)
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *cmd] if _SETPRIV else cmd


@dataclass
class Master:
    proc: subprocess.Popen
    rpc_port: int
    http_port: int
    metrics_port: int
    log: Path
    extra: tuple[str, ...] = ()

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

    def restart(self) -> None:
        """A fresh master on the same ports (empty index): clients reconnect and remount their segments."""
        self.kill()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                _command(self.rpc_port, self.http_port, self.metrics_port, self.extra),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        wait_for(
            lambda: not self.alive() or (_accepts(self.rpc_port) and _accepts(self.http_port)),
            f"the restarted mooncake_master (pid {self.pid}) to listen on {self.rpc_port} and {self.http_port}",
            MASTER_UP_S,
            progress=lambda: tree_cpu(self.pid),
            ceiling_s=MASTER_CEILING_S,
        )
        assert self.alive(), f"the restarted master exited: {self.log.read_text(errors='replace')[-2000:]}"

    def stop(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(10)


def start_master(log_dir: Path, extra: tuple[str, ...] = (), attempts: int = 3) -> Master:
    if master_binary() is None:
        unavailable("mooncake_master binary not found in the mooncake wheel")
    last = ""
    for _ in range(attempts):  # a picked port can be taken before the master binds it: retry with new ones
        rpc, http, metrics = free_port(), free_port(), free_port()
        log = log_dir / f"mooncake_master-{rpc}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                _command(rpc, http, metrics, extra),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            wait_for(
                lambda: proc.poll() is not None or (_accepts(rpc) and _accepts(http)),
                f"mooncake_master (pid {proc.pid}) to listen on {rpc} and {http}",
                MASTER_UP_S,
                progress=lambda: tree_cpu(proc.pid),
                ceiling_s=MASTER_CEILING_S,
            )
            if proc.poll() is None:
                return Master(proc, rpc, http, metrics, log, extra)
            last = ""
        except TimedOut as exc:  # stuck (on a port taken meanwhile, say): killed, and new ports tried
            last = f"{exc}\n"
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        last += log.read_text(errors="replace")[-2000:]
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


def _defaults(kw: dict[str, Any]) -> dict[str, Any]:
    kw.setdefault("global_segment_size", 32 << 20)
    kw.setdefault("local_buffer_size", 16 << 20)
    kw.setdefault("op_timeout_s", 5.0)
    kw.setdefault("setup_timeout_s", 15.0)
    kw.setdefault("close_timeout_s", 3.0)
    kw.setdefault("read_pool_bytes", 16 << 20)
    return kw


@pytest.fixture(scope="session")
def shared_storage(mooncake_master: Master) -> Iterator[Any]:
    """One client for the tests that need no special settings (a client's close takes 1-2 s: share it).

    TP rank 1 of 2 of model "shared/model"; tests keep their pages apart by key.
    """
    from kvfsm.dataplane.storage.mooncake import MooncakeStorage

    s = MooncakeStorage(
        mooncake_master.addr,
        mooncake_master.metadata,
        **_defaults({"model_name": "shared/model", "tp_rank": 1, "tp_size": 2}),
    )
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def make_storage(mooncake_master: Master) -> Iterator[Callable[..., Any]]:
    """MooncakeStorage factory with small, bounded settings and a model name unique to the test."""
    from kvfsm.dataplane.storage.mooncake import MooncakeStorage

    made: list[MooncakeStorage] = []
    model = f"test/{uuid.uuid4().hex[:8]}"

    def make(master: Master | None = None, **kw: Any) -> MooncakeStorage:
        m = master or mooncake_master
        kw.setdefault("model_name", model)
        s = MooncakeStorage(m.addr, m.metadata, **_defaults(kw))
        made.append(s)
        return s

    try:
        yield make
    finally:
        for s in reversed(made):
            s.close()
