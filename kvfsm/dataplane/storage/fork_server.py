"""The store processes' fork server: one fresh interpreter per parent process imports the store's code once and
forks every store process of that parent from itself.

A store process started as its own interpreter (`python -c`) first imports torch and kvfsm's data plane: about
2.2 s of CPU on the 2-core development machine, paid again at every restart of a dead or hung store, once per
shard of a sharded store and once per test that starts one. Forked from a server that has imported them, a store
process answers in about 10 ms of wall time where its own interpreter took 1.6 s (2.1 s of CPU), median of six
starts each way (bench/probes/fork_server_probe.py on that machine). The server is itself a fresh
interpreter, not a fork of the caller: the caller (an engine) holds threads, CUDA state and locks that a fork
would copy half-way; the server holds none, it only imports and forks.

What a directly started store process guaranteed still holds:
- a store process ends when its parent does: it reads end-of-file on its connection, whose other end only the
  parent holds (the server closes its copy once it has forked);
- the server ends when its parent does: it reads end-of-file on its control socket;
- the parent sees each store process through a pidfd, so a kill or a wait never reaches another process that
  took a dead one's pid; the server's children are reaped by the kernel (the server ignores SIGCHLD).

Where pidfds are missing (not Linux, or Linux before 5.3) `start_store_process` answers None and ProcessStorage
starts the store process as its own interpreter. So it does, with a warning, if the server cannot be started or
stops answering. A store process inherits the server's environment, taken when the server started (the first
store process of the parent).
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Optional

logger = logging.getLogger(__name__)

SUPPORTED = sys.platform == "linux" and hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")
AVAILABLE = SUPPORTED  # False: every store process is its own interpreter (bench/probes/fork_server_probe.py compares)


def child_env() -> dict[str, str]:
    """The environment of a fresh interpreter that must import what this one does: its sys.path as PYTHONPATH."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if isinstance(p, str) and p))


class ForkedProcess:
    """A store process forked by the server, through its pidfd: what ProcessStorage uses of a `Popen`
    (`pid`, `poll`, `kill`, `wait`). Its exit status goes to the server, which the kernel reaps it for, so
    `returncode` only says that it ended (-1), not how."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid, self._pidfd = pid, pidfd
        self.returncode: Optional[int] = None
        self._close = weakref.finalize(self, os.close, pidfd)

    def _exited(self, timeout: Optional[float]) -> bool:
        """Whether the process has exited, waiting at most `timeout` seconds (None: until it has). poll(), not
        select(): an engine may hold more than select's 1024 file descriptors."""
        waiter = select.poll()
        waiter.register(self._pidfd, select.POLLIN)
        return bool(waiter.poll(None if timeout is None else max(0, int(timeout * 1000))))

    def poll(self) -> Optional[int]:
        if self.returncode is None and self._exited(0):
            self._ended()
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            if not self._exited(timeout):
                raise subprocess.TimeoutExpired(f"store process {self.pid}", timeout or 0.0)
            self._ended()
        assert self.returncode is not None
        return self.returncode

    def _ended(self) -> None:
        # the pidfd turns readable as the process exits, a moment before the kernel has reaped it: wait for that
        # (at most a second), so that the pid names no process once wait() returns, as after Popen.wait()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.001)
        self.returncode = -1
        self._close()


class _Server:
    """The parent's side of one fork server: its process and control socket (one request at a time)."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        code = f"from {__name__} import _serve_forks; _serve_forks({theirs.fileno()})"
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code], pass_fds=(theirs.fileno(),), env=child_env(), stdin=subprocess.DEVNULL
            )
        finally:
            theirs.close()
        self.sock = mine

    def fork(self, fd: int, timeout_s: float) -> ForkedProcess:
        """A store process serving connection `fd`; OSError (socket.timeout included) when the server fails."""
        socket.send_fds(self.sock, [b"F"], [fd])
        self.sock.settimeout(timeout_s)  # the first request waits for the server's imports
        msg, fds, _, _ = socket.recv_fds(self.sock, 256, 1)
        if not fds:
            raise OSError("the fork server ended" if not msg else f"the fork server could not fork: {msg!r}")
        return ForkedProcess(int(msg), fds[0])

    def stop(self) -> None:
        self.sock.close()  # the server reads end-of-file and exits (a fork of this process dropped its copy)
        try:
            self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_lock = threading.Lock()
_server: Optional[_Server] = None


def start_store_process(fd: int, timeout_s: float) -> Optional[ForkedProcess]:
    """A store process forked by this process's fork server (started on first use) to serve connection `fd`,
    or None where pidfds are missing or the server failed (the caller then starts the process itself)."""
    global _server
    if not AVAILABLE:
        return None
    with _lock:
        for attempt in (1, 2):  # a server that ended since the last request is started again once
            try:
                if _server is None:
                    _server = _Server()
                return _server.fork(fd, timeout_s)
            except OSError as exc:
                if _server is not None:
                    _server.stop()
                    _server = None
                if attempt == 2 or isinstance(exc, socket.timeout):
                    logger.warning(
                        "the store processes' fork server failed (%s): starting a store process as its own interpreter",
                        exc,
                    )
                    return None
    return None


def _stop_server() -> None:
    global _server
    with _lock:
        if _server is not None:
            _server.stop()
            _server = None


def _forget_server_in_child() -> None:
    """A fork of the parent does not share its server: the copy of the control socket is closed (so the server
    still ends with the parent), and the child starts its own server if it needs one."""
    global _server, _lock
    _lock = threading.Lock()
    if _server is not None:
        _server.sock.close()
        _server = None


atexit.register(_stop_server)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_server_in_child)


# ---- the server ---------------------------------------------------------------------------------------
def _serve_forks(fd: int) -> None:
    """The fork server: import what a store process runs, then fork one per request until end-of-file."""
    from .process import _serve  # torch, numpy and the data plane: what every store process imports first

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the store processes
    # a Ctrl-C at the engine's terminal reaches the server too: it ends with its parent instead (end-of-file)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctl = socket.socket(fileno=fd)
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(ctl, 16, 1)
        except OSError:
            return
        if not msg:
            return  # the parent is gone
        if not fds:
            continue
        pid = os.fork()
        if pid == 0:  # the store process
            ctl.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # what a store process started on its own has
            signal.signal(signal.SIGINT, signal.default_int_handler)
            status = 1
            try:
                _serve(fds[0])
                status = 0
            finally:
                os._exit(status)
        os.close(fds[0])  # only the parent holds the other end: the store process ends with it
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:  # it ended (and was reaped) already
            ctl.send(f"{exc}".encode())
            continue
        try:
            socket.send_fds(ctl, [str(pid).encode()], [pidfd])
        except OSError:
            return
        finally:
            os.close(pidfd)
