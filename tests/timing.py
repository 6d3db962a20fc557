"""How long a test may wait: limits that hold on a slow or a busy machine (one place for all of them).

A limit in a test either catches a hang or bounds a latency that is itself under test. Neither is a bare
number of seconds here: `make test` runs on 2 cores beside whatever else the machine runs (two CPU-bound
processes beside it must not fail it), and the same machine runs 1.7x slower on some days than on others.

- Speed: `measure()` times a fixed loop of interpreter work (dict and tuple operations, what the runtime and
  the tests are made of) in this process; its wall time over REFERENCE_S, the same loop on the 2-core CI
  machine idle, is the slowdown (never below 1). It counts the machine's speed and its load together, now.
- `scaled(s)`: s seconds of the reference machine, idle, in this process's seconds now. For a latency that is
  under test (a call returns within its timeout plus some slack): the slack is scaled.
- `wait_for(cond, what, within_s, progress=...)`: a hang guard for a condition. It fails only when `within_s`
  scaled (and measured again before it fails: a machine that got busier gets longer) passed with no
  progress; `progress` (e.g. `tree_cpu(pid)`, the CPU time of a process and its children) restarts the clock
  each time it changes, so a process that works, however slowly, is never cut off; CEILING_S bounds it all.
- `run_watched(cmd, what)`: subprocess.run for a test, whose hang guard is progress instead of a timeout: it
  fails when neither the output nor the CPU time of the process and its children moved for a stall interval
  (STALL_S, scaled), or past a ceiling.
- `calibration_cpu()`: the CPU time of the same loop, fastest of three (the machine's speed only; for a
  budget of CPU time, as the explorer's CI bound has).

A limit that runs out raises `TimedOut` (an AssertionError), which says that it timed out, what it waited
for, how long, and the calibration and the load it was measured under.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

LOOP_N = 200_000
# Wall seconds of the loop of LOOP_N on the 2-core CI machine, idle, on a fast day (2026-12-03: 0.055-0.057;
# the same machine has measured up to 1.7x slower on other days, which then counts as a slowdown).
REFERENCE_S = 0.055
STALL_S = 120.0  # run_watched: no output and no CPU time for this long (scaled) is a hang
CEILING_S = 1800.0  # no single wait in the suite may pass this, however slow the machine


class TimedOut(AssertionError):
    """A test's limit ran out: the message says what it waited for, for how long, and under what load."""


def _loop(n: int) -> None:
    d: dict[tuple[int, int], int] = {}
    for i in range(n):
        k = (i & 1023, i >> 10)
        d[k] = d.get(k, 0) + 1


@dataclass(frozen=True)
class Speed:
    """One timing of the calibration loop in this process, with the load average when it ran."""

    wall_s: float
    cpu_s: float
    load: tuple[float, float, float]
    cpus: int

    @property
    def slowdown(self) -> float:
        return max(1.0, self.wall_s / REFERENCE_S)

    def __str__(self) -> str:
        l1, l5, l15 = self.load
        return (
            f"calibration: {LOOP_N:,} loop iterations took {self.wall_s * 1e3:.0f} ms wall "
            f"({self.cpu_s * 1e3:.0f} ms CPU) here, {REFERENCE_S * 1e3:.0f} ms on the idle reference machine: "
            f"slowdown x{self.slowdown:.1f}; load average {l1:.2f} {l5:.2f} {l15:.2f} on {self.cpus} CPUs"
        )


_last: list[tuple[float, Speed]] = []  # (time.monotonic() of the measurement, the measurement)


def measure(max_age_s: float = 5.0) -> Speed:
    """The calibration loop timed now (or within the last `max_age_s` seconds: it costs about 55 ms)."""
    now = time.monotonic()
    if _last and now - _last[0][0] <= max_age_s:
        return _last[0][1]
    t0, c0 = time.perf_counter(), time.process_time()
    _loop(LOOP_N)
    speed = Speed(time.perf_counter() - t0, time.process_time() - c0, _loadavg(), os.cpu_count() or 1)
    _last[:] = [(time.monotonic(), speed)]
    return speed


def _loadavg() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:  # not on every platform
        return (float("nan"),) * 3  # type: ignore[return-value]


def scaled(seconds: float) -> float:
    """`seconds` of the reference machine, idle, on this machine as it runs now (never fewer)."""
    return seconds * measure().slowdown


def calibration_cpu(n: int = 1_000_000, runs: int = 3) -> float:
    """CPU seconds of the calibration loop of `n` iterations: the fastest of `runs`, so that a moment of
    contention does not shrink a budget measured in it."""
    best = float("inf")
    for _ in range(runs):
        t0 = time.process_time()
        _loop(n)
        best = min(best, time.process_time() - t0)
    return best


def timed_out(what: str, waited_s: float, limit: str, detail: str = "") -> TimedOut:
    return TimedOut(
        f"timed out after {waited_s:.1f} s waiting for {what} ({limit}); {measure(0)}"
        + (f"\n{detail}" if detail else "")
    )


# ---- progress of processes ----------------------------------------------------------------------------


def _stat(pid: str) -> Optional[tuple[int, int]]:
    """(ppid, CPU ticks: its own and those of its reaped children) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime


def tree_cpu(*pids: int) -> Optional[int]:
    """CPU ticks used by these processes and all their descendants (live, or reaped by them); None where
    /proc is not there to read (then only the output or the scaled limit tell progress)."""
    if not os.path.isdir("/proc/self"):
        return None
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(name)
            if st is not None:
                children.setdefault(st[0], []).append(int(name))
                ticks[int(name)] = st[1]
    total, todo, seen = 0, list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += ticks.get(pid, 0)
        todo += children.get(pid, [])
    return total


# ---- waiting ------------------------------------------------------------------------------------------


def wait_for(
    cond: Callable[[], Any],
    what: str,
    within_s: float,
    *,
    progress: Optional[Callable[[], Any]] = None,
    poll_s: float = 0.05,
    ceiling_s: float = CEILING_S,
    detail: Optional[Callable[[], str]] = None,
) -> Any:
    """Poll `cond` until it returns something true, and return that. A hang guard: `within_s` is what the
    wait may take on the reference machine, idle; it fails after `within_s` scaled with no progress (a
    change in what `progress()` returns restarts that clock), or after `ceiling_s` in all, raising TimedOut
    (with `detail()` appended: a log's tail, say)."""
    start = last = time.monotonic()
    mark = progress() if progress is not None else None
    limit = scaled(within_s)
    while True:
        got = cond()
        if got:
            return got
        now = time.monotonic()
        if progress is not None:
            p = progress()
            if p != mark:
                mark, last = p, now
        if now - last > limit:
            limit = max(limit, within_s * measure(0).slowdown)  # measured again: busier now, longer
        if now - last > limit or now - start > ceiling_s:
            stalled = f"no progress for {now - last:.1f} s, " if progress is not None else ""
            raise timed_out(
                what,
                now - start,
                f"{stalled}limit {limit:.1f} s = {within_s:g} s on the reference machine "
                f"scaled, ceiling {ceiling_s:g} s",
                detail() if detail is not None else "",
            )
        time.sleep(poll_s)


def backups_settled(worker: Any, what: str = "the backup worker's jobs to finish", within_s: float = 10.0) -> None:
    """`ThreadBackupWorker.wait_idle` with this module's hang guard: every job submitted has finished (not yet
    collected). Each job that finishes restarts the clock, so a slow store is waited for and a hung one is not."""
    worker.flush()
    wait_for(
        lambda: worker.completed() >= worker.outstanding(), what, within_s, progress=worker.completed, poll_s=0.001
    )


def join_all(threads: Sequence[Any], what: str, within_s: float) -> None:
    """Join threads (started by the caller; returns as soon as the last one ends) with a hang guard:
    TimedOut, naming the ones still alive, when they have not all finished after `within_s` scaled (measured
    again before it fails)."""
    start = time.monotonic()
    limit = scaled(within_s)
    while True:
        for t in threads:
            t.join(max(0.0, limit - (time.monotonic() - start)))
        alive = [t.name for t in threads if t.is_alive()]
        if not alive:
            return
        waited = time.monotonic() - start
        limit = max(limit, within_s * measure(0).slowdown)
        if waited >= limit:
            raise timed_out(
                what,
                waited,
                f"limit {limit:.1f} s = {within_s:g} s on the reference machine scaled",
                "still running: " + ", ".join(alive),
            )


class Watch:
    """A hang guard for a loop that waits on a process (reading its pipe, say): `poke()` when something
    arrives, `check()` between waits; `check()` raises TimedOut when neither a poke nor the CPU time of the
    process tree moved for `within_s` scaled, or after `ceiling_s`."""

    def __init__(self, what: str, within_s: float, *pids: int, ceiling_s: float = CEILING_S) -> None:
        self.what, self.within_s, self.pids, self.ceiling_s = what, within_s, pids, ceiling_s
        self.start = self.last = time.monotonic()
        self.mark = tree_cpu(*pids) if pids else None
        self.limit = scaled(within_s)

    def poke(self) -> None:
        self.last = time.monotonic()

    def check(self, detail: Optional[Callable[[], str]] = None) -> None:
        now = time.monotonic()
        if self.pids:
            cpu = tree_cpu(*self.pids)
            if cpu != self.mark:
                self.mark, self.last = cpu, now
        if now - self.last > self.limit:
            self.limit = max(self.limit, self.within_s * measure(0).slowdown)
        if now - self.last > self.limit or now - self.start > self.ceiling_s:
            raise timed_out(
                self.what,
                now - self.start,
                f"no output and no CPU time for {now - self.last:.1f} s, limit {self.limit:.1f} s = "
                f"{self.within_s:g} s on the reference machine scaled, ceiling {self.ceiling_s:g} s",
                detail() if detail is not None else "",
            )

    def remaining(self, most: float = 0.5) -> float:
        """How long the caller may block before the next check()."""
        return max(0.01, min(most, self.limit - (time.monotonic() - self.last)))


def run_watched(
    cmd: Sequence[str],
    what: str,
    *,
    stall_s: float = STALL_S,
    ceiling_s: float = CEILING_S,
    cwd: Any = None,
    env: Optional[dict[str, str]] = None,
    input: Optional[str] = None,
) -> subprocess.CompletedProcess[str]:
    """subprocess.run(cmd, capture_output=True, text=True) with a hang guard on progress: the process (in a
    session of its own, so that its children go with it) is killed and TimedOut raised, with the output's
    tails, when neither its output nor the CPU time of it and its children moved for `stall_s` scaled, or
    after `ceiling_s`."""
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    out: dict[int, bytearray] = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}  # type: ignore[union-attr]
    watch = Watch(what, stall_s, proc.pid, ceiling_s=ceiling_s)
    sel = selectors.DefaultSelector()
    try:
        if input is not None:
            proc.stdin.write(input.encode())  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
        for f in (proc.stdout, proc.stderr):
            sel.register(f, selectors.EVENT_READ)  # type: ignore[arg-type]
        open_pipes = 2
        while open_pipes:
            for key, _ in sel.select(watch.remaining(1.0)):
                chunk = os.read(key.fd, 65536)
                if chunk:
                    out[key.fd] += chunk
                    watch.poke()
                else:
                    sel.unregister(key.fileobj)
                    open_pipes -= 1
            if open_pipes:
                watch.check(lambda: _tails(out, proc))
        while proc.poll() is None:  # the pipes closed: it is exiting (or a child of it kept them and left)
            watch.check(lambda: _tails(out, proc))
            time.sleep(0.02)
    except BaseException:
        _kill_session(proc)
        raise
    finally:
        sel.close()
        for f in (proc.stdout, proc.stderr):
            f.close()  # type: ignore[union-attr]
    stdout, stderr = (bytes(b).decode(errors="replace") for b in out.values())
    return subprocess.CompletedProcess(list(cmd), proc.returncode, stdout, stderr)


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _tails(out: dict[int, bytearray], proc: subprocess.Popen) -> str:
    stdout, stderr = (bytes(b).decode(errors="replace") for b in out.values())
    return f"stdout (tail):\n{stdout[-3000:]}\nstderr (tail):\n{stderr[-3000:]}"
