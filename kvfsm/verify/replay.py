"""Trace conformance: check a recorded transition trace against the spec.

The manager's trace (kvfsm/runtime/trace.py) is JSON lines: a header {"kind": "header", "spec_sha256"},
then one line per accepted event {"t", "req", "event", "from", "to", "transition", "counters", "acquired",
"released"}, where "counters" are the request's counters *after* the step and transition -1 is a declared
no-op. `check_trace` re-simulates every request key from the spec's initial state, straight from the
CompiledSpec (not from the generated code the trace came from): each line's event from `from` must lead to
`to` through the declared transition with that id, whose guard holds for the counters before the step;
the counters after it must be the update's result; what it acquires and releases must be what the spec
declares, and a single-owner resource can be released only while held (no second release). The first
illegal step is reported with its line number.

A trace may come from anywhere (a pull request, another host), so it is read a line at a time within
`kvfsm.input_limits.TRACE_LIMITS` (file size, line length, each line's nesting depth and element count) and
at most `max_requests` request keys are tracked. Input that cannot be read within them is not an illegal
step: `check_trace` raises InputRejected (InputBoundExceeded for a bound) naming the file, line and bound.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from kvfsm.errors import InputBoundExceeded
from kvfsm.input_limits import (
    TRACE_LIMITS,
    TRACE_MAX_REQUESTS,
    InputLimits,
    check_json_nesting,
    count_elements,
    decode_utf8,
    open_regular,
)
from kvfsm.spec import CompiledSpec, expr as ex, load_spec
from kvfsm.spec.locations import packaged_spec


def default_spec_path() -> Path:
    """The shipped decode_offload spec (in a checkout `spec/`, installed inside the package)."""
    return packaged_spec()


@dataclass
class TraceError:
    line: int  # 1-based line number in the trace file
    message: str
    request: Optional[str] = None
    record: Optional[dict[str, Any]] = None


@dataclass
class ReplayResult:
    path: Path
    spec_sha256: str
    lines: int = 0  # lines read (header included)
    steps: int = 0  # transition lines checked
    ignored: int = 0  # declared no-ops among them
    requests: int = 0
    transitions: Counter = field(default_factory=Counter)  # transition id -> steps
    final_states: Counter = field(default_factory=Counter)  # state -> requests ending there
    error: Optional[TraceError] = None

    @property
    def ok(self) -> bool:
        return self.error is None


class _Request:
    __slots__ = ("state", "counters", "held", "host", "params", "spec")

    def __init__(self, spec: CompiledSpec) -> None:
        self.spec = spec
        self.params: dict[str, int] = {}  # the machine's params, fixed by the first step that needs them
        self.state = spec.initial
        self.counters = {c: m.initial for c, m in spec.model.counters.items()}
        self.held = set(spec.model.create.holds if spec.model.create else ())
        self.host: Counter = Counter()  # acquired-many resources (one acquisition per chunk)


class _Illegal(Exception):
    pass


def _holds(r: _Request, env: dict[str, int], pred: Callable[[dict[str, int]], bool]) -> bool:
    """`pred` over the counters and the request's params. A trace does not log params (constants of one
    machine): one still unknown takes the first value (0, then 1) under which the step is legal, and keeps it."""
    unknown = [p for p in r.spec.params if p not in r.params]
    for values in itertools.product((0, 1), repeat=len(unknown)):
        full = {**env, **r.params, **dict(zip(unknown, values))}
        if pred(full):
            r.params.update(
                dict(zip(unknown, values))
                if unknown and any(not pred({**full, p: 1 - full[p]}) for p in unknown)
                else {}
            )
            return True
    return False


def _lines(path: Path, limits: InputLimits) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line, within `limits` (InputRejected past them)."""
    source, size = str(path), 0
    cap = limits.max_line_bytes or limits.max_bytes
    with open_regular(path, "trace") as f:
        for n in itertools.count(1):
            raw = f.readline(cap + 1)
            if not raw:
                return
            size += len(raw)
            if size > limits.max_bytes:
                raise InputBoundExceeded(
                    source, n, "max_bytes", limits.max_bytes, f"trace is larger than {limits.max_bytes} bytes"
                )
            if len(raw) > cap and not raw.endswith(b"\n"):
                raise InputBoundExceeded(source, n, "max_line_bytes", cap, f"a trace line longer than {cap} bytes")
            text = decode_utf8(raw, source, "trace line", n)
            check_json_nesting(text, limits, source, n, "trace line")
            yield n, text


def check_trace(
    path: str | Path,
    spec: CompiledSpec | str | Path | None = None,
    *,
    limits: InputLimits = TRACE_LIMITS,
    max_requests: int = TRACE_MAX_REQUESTS,
) -> ReplayResult:
    """Check every line of the trace at `path`; stops at the first illegal one (result.error). Raises
    InputRejected (nothing checked past it) for input past `limits`, or not UTF-8, and OSError for a path
    that cannot be opened."""
    spec = spec if isinstance(spec, CompiledSpec) else load_spec(spec or default_spec_path())
    path = Path(path)
    res = ReplayResult(path, spec.sha256)
    single_owner = set(spec.model.create.holds if spec.model.create else ())
    reqs: dict[str, _Request] = {}
    for n, raw in _lines(path, limits):
        res.lines = n
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except ValueError as exc:  # JSONDecodeError, or an integer past Python's digit limit
            res.error = TraceError(n, f"not a JSON object: {getattr(exc, 'msg', exc)}")
            return res
        count_elements(rec, limits, str(path), n, "trace line", len(raw))
        if not isinstance(rec, dict):
            res.error = TraceError(n, "not a JSON object")
            return res
        if n == 1 or rec.get("kind") == "header":
            err = _header(rec, n, spec)
            if err is not None:
                res.error = err
                return res
            continue
        key = rec.get("req")
        try:
            if not isinstance(key, str):
                raise _Illegal("no request key ('req')")
            r = reqs.get(key)
            if r is None:
                if len(reqs) >= max_requests:
                    raise InputBoundExceeded(
                        str(path), n, "max_requests", max_requests, f"a trace of more than {max_requests} requests"
                    )
                r = reqs[key] = _Request(spec)
            tid = _step(spec, r, rec, single_owner)
        except _Illegal as exc:
            res.error = TraceError(n, str(exc), key if isinstance(key, str) else None, rec)
            return res
        res.steps += 1
        res.transitions[tid] += 1
        res.ignored += tid < 0
    if res.lines == 0:
        res.error = TraceError(1, "empty trace: no header")
        return res
    res.requests = len(reqs)
    res.final_states = Counter(r.state for r in reqs.values())
    return res


def _header(rec: dict[str, Any], n: int, spec: CompiledSpec) -> Optional[TraceError]:
    if n != 1 or rec.get("kind") != "header":
        return TraceError(
            n,
            'the first line must be the header {"kind": "header", "spec_sha256": ...}'
            if n == 1
            else "a second header line",
        )
    sha = rec.get("spec_sha256")
    if sha != spec.sha256:
        return TraceError(
            n,
            f"the trace was recorded against spec sha256 {str(sha)[:12]}..., but {spec.path} is "
            f"{spec.sha256[:12]}...: regenerate, or replay against the spec it was recorded with",
        )
    return None


def _step(spec: CompiledSpec, r: _Request, rec: dict[str, Any], single_owner: set[str]) -> int:
    event, src, dst, tid = rec.get("event"), rec.get("from"), rec.get("to"), rec.get("transition")
    counters = rec.get("counters")
    for name, value in (("event", event), ("from", src), ("to", dst)):
        if not isinstance(value, str):
            raise _Illegal(f"{name!r} is {value!r}, not a name")
    for name in ("acquired", "released"):
        value = rec.get(name, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _Illegal(f"{name!r} is {value!r}, not a list of resource names")
    if event not in spec.events:
        raise _Illegal(f"undeclared event {event!r}")
    if src not in spec.states or dst not in spec.states:
        raise _Illegal(f"undeclared state in {src!r} -> {dst!r}")
    if not isinstance(tid, int) or isinstance(tid, bool):
        raise _Illegal(f"transition id {tid!r} is not an integer")
    if not isinstance(counters, dict) or set(counters) != set(spec.counters):
        raise _Illegal(f"counters {counters!r} do not name exactly the spec's counters {list(spec.counters)}")
    if src != r.state:
        raise _Illegal(f"the request is in state {r.state!r}, but the step starts from {src!r}")
    before = dict(r.counters)
    acquired, released = rec.get("acquired", []), rec.get("released", [])
    handlers = spec.handlers(src, event)
    outcome = spec.outcomes.get((src, event))
    if tid == -1:
        if outcome is None or outcome.kind != "ignore":
            what = (
                f"handled by transitions {[t.id for t in handlers]}"
                if handlers
                else f"a declared error ({outcome.reason})"
                if outcome is not None
                else "not declared"
            )
            raise _Illegal(f"{event!r} in state {src!r} is logged as a declared no-op, but it is {what}")
        if dst != src:
            raise _Illegal(f"a declared no-op of {event!r} moves the request from {src!r} to {dst!r}")
        if counters != before:
            raise _Illegal(f"a declared no-op of {event!r} changes the counters {before} -> {counters}")
        if acquired or released:
            raise _Illegal(f"a declared no-op of {event!r} acquires {acquired} / releases {released}")
        return tid
    if not 0 <= tid < len(spec.transitions):
        raise _Illegal(f"no transition has id {tid} (the spec declares T0..T{len(spec.transitions) - 1})")
    t = spec.transitions[tid]
    if not handlers:
        what = f"a declared {outcome.kind} ({outcome.reason})" if outcome is not None else "not declared"
        raise _Illegal(f"{event!r} is not handled in state {src!r}: it is {what}")
    if t.src != src or t.event != event:
        raise _Illegal(
            f"transition T{tid} is {t.label!r}, not {event!r} from {src!r} "
            f"(which is {', '.join(f'T{h.id}' for h in handlers)})"
        )
    guard = t.guard
    if guard is not None and not _holds(r, before, lambda env: bool(ex.evaluate(spec.guards[guard], env))):
        raise _Illegal(f"T{tid} {t.label}: guard {t.guard!r} does not hold for the counters before the step {before}")
    if dst != t.dst:
        raise _Illegal(f"T{tid} {t.label} leads to {t.dst!r}, but the step ends in {dst!r}")
    after = dict(before)
    for c, delta in t.update:
        after[c] += delta
    if counters != after:
        raise _Illegal(f"T{tid} {t.label}: counters {before} -> {counters}, the spec's update gives {after}")
    if list(acquired) != list(t.acquires) or list(released) != list(t.releases):
        raise _Illegal(
            f"T{tid} {t.label} acquires {list(t.acquires)} and releases {list(t.releases)}, the step says "
            f"{list(acquired)} and {list(released)}"
        )
    for res_name in t.releases:
        if res_name in single_owner:
            if res_name not in r.held:
                raise _Illegal(
                    f"T{tid} {t.label} releases {res_name!r}, which the request already released (double release)"
                )
            r.held.discard(res_name)
        else:
            if r.host[res_name] <= 0:
                raise _Illegal(f"T{tid} {t.label} releases {res_name!r}, which the request does not hold (double free)")
            r.host[res_name] -= 1
    for res_name in t.acquires:
        if res_name in single_owner:
            r.held.add(res_name)
        else:
            r.host[res_name] += 1
    if not _holds(r, after, lambda env: spec.state_holds(dst, env)):
        raise _Illegal(f"T{tid} {t.label}: the counters {after} violate the invariants of {dst!r}")
    r.state, r.counters = dst, after
    return tid


__all__ = ["ReplayResult", "TraceError", "check_trace", "default_spec_path"]
