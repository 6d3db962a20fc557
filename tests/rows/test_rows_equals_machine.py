"""The struct-of-arrays batch machine (`generated/<machine>_rows.py`) equals the per-request machine, for every
spec in spec/.

Random sequences of event batches on random rows (a row may appear several times in a batch) run through a
table of rows and, item by item in batch order, through one per-request machine per row. After every batch:
the same states, counters and params; per action the same rows and args in the same order (the rows machine
calls each action once, with the rows that take it in batch order, so a row that appears once sees its own
calls in its transition's order); and the same rejections: where the loop of single events stops at an item,
the batch is rejected with the same error type, that item's row and position, the state the loop saw it in
and the spec's reason, and nothing of the table changed (the per-request machines are put back to compare on).
Rows are also created again once their machine is terminal, and an action that raises leaves every array as
it was. KVFSM_FUZZ=deep runs many more examples.
"""

from __future__ import annotations

import copy
import importlib
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event as hypothesis_event, given, settings, strategies as st

from kvfsm.errors import EventRejected, GuardRejected, RowNotCreated, RowStillLive

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted(p.stem for p in (ROOT / "spec").glob("*.yaml"))
DEEP = os.environ.get("KVFSM_FUZZ", "ci") == "deep"
EXAMPLES = 1500 if DEEP else 40


def machines(name: str) -> tuple[Any, Any, type, type]:
    """(per-request module, rows module, per-request class, rows class) of spec `name`."""
    per = importlib.import_module(f"kvfsm.generated.{name}")
    rows = importlib.import_module(f"kvfsm.generated.{name}_rows")
    stem = "".join(part.title() for part in name.split("_"))
    return per, rows, getattr(per, f"{stem}Machine"), getattr(rows, f"{stem}Rows")


class LoopEffects:
    """The per-request machines' effects: every action logs (action, row, arg)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int, Any]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda m, arg: self.log.append((name, m.ctx, arg))


class RowsEffects:
    """The rows machine's effects: `<action>_rows(rows, args)` logs (action, row, arg) per row; `fail` names an
    action that raises once it has logged its rows."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int, Any]] = []
        self.calls: list[str] = []
        self.fail: str | None = None

    def __getattr__(self, name: str) -> Any:
        if not name.endswith("_rows") or name.startswith("_"):
            raise AttributeError(name)
        action = name[: -len("_rows")]

        def call(rows: np.ndarray, args: Any) -> None:
            assert rows.dtype.kind == "i" and rows.ndim == 1 and rows.size > 0
            assert args is None or len(args) == rows.size
            self.calls.append(action)
            self.log.extend((action, int(r), None if args is None else args[i]) for i, r in enumerate(rows))
            if action == self.fail:
                raise RuntimeError(f"{action} failed")

        return call


def by_action(log: list[tuple[str, int, Any]], order: tuple[str, ...]) -> list[tuple[str, int, Any]]:
    return [entry for a in order for entry in log if entry[0] == a]


def per_row(log: list[tuple[str, int, Any]], row: int) -> list[tuple[str, Any]]:
    return [(a, arg) for a, r, arg in log if r == row]


def fill_cases() -> list[tuple[str, str]]:
    cases = []
    for name in SPECS:
        per = importlib.import_module(f"kvfsm.generated.{name}")
        fills = ("0", "1", "mixed") if getattr(per, "PARAMS", ()) else ("none",)
        cases += [(name, f) for f in fills]
    return cases


class Pair:
    """A table of rows and its per-request twins, driven together and compared."""

    def __init__(self, name: str, n: int, capacity: int, params: list[dict[str, int]], args_as_list: bool) -> None:
        self.per, self.mod, self.Machine, self.Rows = machines(name)
        self.loop_fx, self.rows_fx = LoopEffects(), RowsEffects()
        self.params = params
        self.table = self.Rows(self.rows_fx, capacity)
        rows = np.arange(n)
        self.table.create(rows, **{p: np.array([ps[p] for ps in params]) for p in self.mod.PARAMS})
        self.ms = [self.Machine(self.loop_fx, ctx=r, **params[r]) for r in range(n)]
        self.args_as_list = args_as_list
        self.note: Any = lambda what: None  # hypothesis.event inside a hypothesis test: what the batches met
        self.compare()

    def compare(self) -> None:
        assert [self.table.snapshot(r) for r in range(len(self.ms))] == [m.snapshot() for m in self.ms]
        assert [self.table.params(r) for r in range(len(self.ms))] == self.params
        assert self.rows_fx.log == self.loop_fx.log  # creation, then each batch (checked and trimmed below)

    def restore_loop(self, before: list[tuple[int, ...]]) -> None:
        for m, snap in zip(self.ms, before):
            m.state = snap[0]
            for c, v in zip(self.per.COUNTERS, snap[1:]):
                setattr(m, c, v)

    def fire(self, event: str, picks: list[int], tag: str) -> None:
        args = [f"{tag}:{k}" for k in range(len(picks))]
        before = [m.snapshot() for m in self.ms]
        loop_mark, rows_mark = len(self.loop_fx.log), len(self.rows_fx.log)
        stopped: tuple[int, EventRejected] | None = None
        for k, (r, arg) in enumerate(zip(picks, args)):
            try:
                getattr(self.ms[r], event)(arg)
            except EventRejected as exc:
                stopped = (k, exc)
                break
        batch_args: Any = args if self.args_as_list else np.array(args, dtype=object)
        rows = np.array(picks, dtype=np.int64)
        if len(set(picks)) < len(picks):
            self.note("a batch with a repeated row")
        if stopped is not None:
            self.note(f"rejected: {type(stopped[1]).__name__}")
            k, loop_exc = stopped
            with pytest.raises(EventRejected) as info:
                getattr(self.table, event)(rows, batch_args)
            exc = info.value
            assert type(exc) is type(loop_exc)
            assert (exc.machine.row, exc.machine.position) == (picks[k], k)
            assert (exc.event, exc.state, exc.reason) == (loop_exc.event, loop_exc.state, loop_exc.reason)
            if isinstance(exc, GuardRejected):
                assert exc.guards == loop_exc.guards
            assert len(self.rows_fx.log) == rows_mark, "a rejected batch called an action"
            assert [self.table.snapshot(r) for r in range(len(self.ms))] == before, "a rejected batch changed rows"
            self.restore_loop(before)
            del self.loop_fx.log[loop_mark:]
            return
        getattr(self.table, event)(rows, batch_args)
        if len(picks) > 1:
            self.note("accepted, several items")
        loop_new, rows_new = self.loop_fx.log[loop_mark:], self.rows_fx.log[rows_mark:]
        order = self.mod.ACTION_ORDER[event]
        if len(set(order)) == len(order):
            assert rows_new == by_action(loop_new, order)
        for r in set(picks):
            if picks.count(r) == 1:
                assert per_row(rows_new, r) == per_row(loop_new, r), f"row {r}: calls out of its transition's order"
        assert [self.table.snapshot(r) for r in range(len(self.ms))] == [m.snapshot() for m in self.ms]
        # the whole log compares equal only up to the order across rows: keep both in the loop's order
        self.rows_fx.log[rows_mark:] = loop_new

    def fire_failing(self, event: str, picks: list[int], choose: Any) -> None:
        """A batch that the loop accepts, one of whose actions (`choose` picks it among those the loop calls)
        raises: the exception comes through and every array is as it was."""
        probe, probe_fx = copy.deepcopy(self.ms), LoopEffects()
        for m in probe:
            m.fx = probe_fx
        try:
            for r in picks:
                getattr(probe[r], event)(None)
        except EventRejected:
            return
        called = sorted({a for a, _, _ in probe_fx.log})
        if not called:
            return
        action = choose(called)
        before = [self.table.snapshot(r) for r in range(len(self.ms))]
        mark = len(self.rows_fx.log)
        self.rows_fx.fail = action
        try:
            with pytest.raises(RuntimeError, match=f"{action} failed"):
                getattr(self.table, event)(np.array(picks), None)
        finally:
            self.rows_fx.fail = None
        assert [self.table.snapshot(r) for r in range(len(self.ms))] == before
        del self.rows_fx.log[mark:]

    def recreate(self, picks: list[int], params: list[dict[str, int]]) -> None:
        """New machines in `picks` (distinct): refused with nothing changed while one is live."""
        live = [r for r in picks if self.ms[r].state not in self.per.TERMINAL]
        kw = {p: np.array([ps[p] for ps in params]) for p in self.mod.PARAMS}
        before = [self.table.snapshot(r) for r in range(len(self.ms))]
        if live:
            with pytest.raises(RowStillLive) as info:
                self.table.create(np.array(picks), **kw)
            assert info.value.row == live[0] and info.value.position == picks.index(live[0])
            assert [self.table.snapshot(r) for r in range(len(self.ms))] == before
            return
        self.table.create(np.array(picks), **kw)
        for r, ps in zip(picks, params):
            self.ms[r] = self.Machine(self.loop_fx, ctx=r, **ps)
            self.params[r] = ps


@pytest.mark.parametrize("name,fill", fill_cases())
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_rows_machine_equals_per_request_machines(name: str, fill: str, data: st.DataObject) -> None:
    per, mod, _, _ = machines(name)

    def draw_params(count: int) -> list[dict[str, int]]:
        if fill == "mixed":
            return [{p: data.draw(st.integers(0, 1)) for p in mod.PARAMS} for _ in range(count)]
        return [{p: int(fill) for p in mod.PARAMS} for _ in range(count)]

    n = data.draw(st.integers(1, 6), label="rows")
    pair = Pair(
        name,
        n,
        data.draw(st.integers(0, 3), label="capacity"),
        draw_params(n),
        data.draw(st.booleans(), label="args as a list"),
    )
    pair.note = hypothesis_event
    for step in range(data.draw(st.integers(1, 30), label="batches")):
        kind = data.draw(st.sampled_from(["event"] * 8 + ["fail", "create"]), label="kind")
        row = data.draw(st.integers(0, n - 1))
        handled = [e for e in per.EVENTS if pair.ms[row].state in per.HANDLED[e]]
        if handled and data.draw(st.integers(0, 9)) < 8:
            event = data.draw(st.sampled_from(handled), label="event")
        else:
            event = data.draw(st.sampled_from(per.EVENTS), label="event")
        takers = [r for r in range(n) if pair.ms[r].state in per.HANDLED[event]] or list(range(n))
        size = data.draw(st.integers(0, 6), label="batch size")
        picks = [
            data.draw(st.sampled_from(takers) if data.draw(st.integers(0, 4)) else st.integers(0, n - 1))
            for _ in range(size)
        ]
        if kind == "event":
            pair.fire(event, picks, f"b{step}")
        elif kind == "fail":
            pair.fire_failing(event, picks, lambda called: data.draw(st.sampled_from(called), label="failing"))
        elif kind == "create":
            fresh = sorted(set(picks))
            pair.recreate(fresh, draw_params(len(fresh)))
        pair.compare()


# --- the batch checks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SPECS)
def test_bad_batches_are_refused_with_nothing_changed(name: str) -> None:
    per, mod, Machine, Rows = machines(name)
    table = Rows(RowsEffects(), capacity=2)
    table.create([0, 1])
    before = [table.snapshot(r) for r in range(2)]
    event = per.EVENTS[0]
    with pytest.raises(RowNotCreated, match=r"row 5 \(item 1\) is outside its rows"):
        getattr(table, event)([0, 5])
    table.grow(8)
    with pytest.raises(RowNotCreated, match=r"row 5 \(item 1\) holds no machine"):
        getattr(table, event)([0, 5])
    with pytest.raises(RowNotCreated, match=r"row -1 \(item 0\)"):
        getattr(table, event)([-1])
    with pytest.raises(TypeError, match="1-D integer array"):
        getattr(table, event)(np.array([0.0, 1.0]))
    with pytest.raises(TypeError, match="1-D integer array"):
        getattr(table, event)(np.zeros((1, 1), int))
    with pytest.raises(ValueError, match="2 rows but 1 args"):
        getattr(table, event)([0, 1], ["only one"])
    with pytest.raises(ValueError, match="row 1 at items 0 and 2"):
        table.create([1, 3, 1])
    with pytest.raises(RowStillLive, match=r"row 0 \(item 1\) holds a live machine in state"):
        table.create([4, 0])
    with pytest.raises(ValueError, match="is negative"):
        table.create([-2])
    for p in mod.PARAMS:
        with pytest.raises(ValueError, match=rf"param {p} must be 0 or 1, got 2 at item 1"):
            table.create([4, 5], **{p: [0, 2]})
    with pytest.raises(ValueError, match="row 9 at items 0 and 1"):
        table.create([9, 9])  # refused before the table grows for it
    assert [table.snapshot(r) for r in range(2)] == before and not table.created[2:].any()
    assert table.capacity == 8
    getattr(table, event)(np.array([], dtype=np.int64))  # an empty batch is no work
    getattr(table, event)([])
    assert [table.snapshot(r) for r in range(2)] == before


@pytest.mark.parametrize("name", SPECS)
def test_growth_keeps_rows_and_a_failed_create_takes_nothing(name: str) -> None:
    per, mod, Machine, Rows = machines(name)
    fx = RowsEffects()
    table = Rows(fx)
    assert table.capacity == 0
    table.create([3])
    assert table.capacity >= 4 and table.created.tolist()[:4] == [False, False, False, True]
    table.create([40, 7])
    assert table.capacity >= 41 and table.snapshot(3) == table.snapshot(40) == Machine(LoopEffects()).snapshot()
    if Rows.CREATE_ACTIONS:
        fx.fail = Rows.CREATE_ACTIONS[0][: -len("_rows")]
        with pytest.raises(RuntimeError):
            table.create([8, 9])
        assert not table.created[[8, 9]].any()


def test_rejection_names_the_item_a_loop_stops_at_among_repeated_rows() -> None:
    """decode_offload: row 0 has two copies in flight, row 1 one; in the batch 0, 1, 0, 1, 0 the loop stops at
    row 1's second acknowledgement (item 3, row 1 is inflight by then): the batch names it, nothing changed."""
    import kvfsm.generated.decode_offload_rows as mod

    fx = RowsEffects()
    table = mod.DecodeOffloadRows(fx)
    table.create([0, 1])
    table.offload([0, 0, 1])
    before = [table.snapshot(r) for r in range(2)]
    with pytest.raises(EventRejected) as info:
        table.copy_done([0, 1, 0, 1, 0])
    assert (info.value.machine.row, info.value.machine.position) == (1, 3)
    assert info.value.state == "inflight" and "No copy of this request is in flight" in info.value.reason
    assert [table.snapshot(r) for r in range(2)] == before
    table.copy_done([0, 1, 0])
    assert [mod.STATES[table.snapshot(r)[0]] for r in range(2)] == ["inflight", "inflight"]
    assert fx.calls[-2:] == ["hash_chunk", "submit_backup"]
    assert [r for a, r, _ in fx.log if a == "submit_backup"] == [0, 1, 0]


def test_generated_rows_module_points_back_at_the_spec() -> None:
    """Each transition's mask names its id and spec line, and the line is that transition's rule."""
    import kvfsm.generated.decode_offload as per
    import kvfsm.generated.decode_offload_rows as mod

    source = Path(mod.__file__).read_text()
    for tid, t in enumerate(per.TRANSITIONS):
        found = re.search(rf"t{tid} = .*# T{tid} (.*)  \(spec line (\d+)\)", source)
        assert found, f"T{tid} has no mask line"
        assert int(found.group(2)) == t[-1]
    assert mod.SPEC_SHA256 == per.SPEC_SHA256


def _paths_to_every_transition(per: Any, Machine: type) -> dict[int, tuple[dict[str, int], list[str]]]:
    """Per transition id, params and a shortest event path from a fresh machine whose last event takes it
    (breadth-first over single events from a machine of each param assignment)."""
    import collections
    import itertools

    starts = []
    for values in itertools.product((0, 1), repeat=len(getattr(per, "PARAMS", ()))):
        params = dict(zip(getattr(per, "PARAMS", ()), values))
        starts.append((params, Machine(LoopEffects(), ctx=0, **params)))
    paths: dict[int, tuple[dict[str, int], list[str]]] = {}
    seen = {(tuple(p.values()), m.snapshot()) for p, m in starts}
    queue = collections.deque((p, m, []) for p, m in starts)
    while queue and len(paths) < len(per.TRANSITIONS):
        params, m, path = queue.popleft()
        for event in per.EVENTS:
            probe = copy.deepcopy(m)
            tids: list[int] = []
            probe.observer = lambda _m, _e, _s, _d, tid: tids.append(tid)
            try:
                getattr(probe, event)(None)
            except EventRejected:
                continue
            probe.observer = None
            for tid in tids:
                if tid >= 0:  # not a declared no-op
                    paths.setdefault(tid, (params, path + [event]))
            key = (tuple(params.values()), probe.snapshot())
            if key not in seen and len(path) < 10:
                seen.add(key)
                queue.append((params, probe, path + [event]))
    return paths


@pytest.mark.parametrize("name", SPECS)
def test_every_transition_in_a_batch_equals_the_loop(name: str) -> None:
    """Each transition of the spec, taken in an accepted batch of three rows that a shortest path put in its
    source state, and then with one row repeated: the same rows, calls and rejections as the loop."""
    per, mod, Machine, _ = machines(name)
    paths = _paths_to_every_transition(per, Machine)
    assert set(paths) == set(range(len(per.TRANSITIONS))), "a transition no event path reaches"
    for tid, (params, path) in sorted(paths.items()):
        pair = Pair(name, 3, 0, [dict(params) for _ in range(3)], False)
        for k, event in enumerate(path[:-1]):
            pair.fire(event, [0, 1, 2], f"p{k}")
        taken: list[int] = []
        for m in pair.ms:
            m.observer = lambda _m, _e, _s, _d, t: taken.append(t)
        pair.fire(path[-1], [2, 0, 1], "last")
        assert tid in taken, f"T{tid} not taken by {path}"
        for m in pair.ms:
            m.observer = None
        pair.compare()
        pair.fire(path[-1], [1, 1, 0], "again")  # accepted or rejected, as the loop is
        pair.compare()


class Spans:
    """Per-item args as a struct of arrays, the form chunks as rows of preallocated arrays would take."""

    def __init__(self, start: np.ndarray, length: np.ndarray) -> None:
        self.start, self.length = start, length

    def __len__(self) -> int:
        return len(self.start)

    def __getitem__(self, positions: np.ndarray) -> Spans:
        return Spans(self.start[positions], self.length[positions])


def test_args_as_a_struct_of_arrays_reach_each_action_taken_at_its_items() -> None:
    """finish over rows in four states: each action gets the args of the items that take it, a declared no-op
    row's none; an action every item takes gets the args object as given."""
    import kvfsm.generated.decode_offload_rows as mod

    got: dict[str, tuple[list[int], Any]] = {}

    class Fx:
        def __getattr__(self, name: str) -> Any:
            return lambda rows, args: got.__setitem__(name, (rows.tolist(), args))

    table = mod.DecodeOffloadRows(Fx())
    table.create([0, 1, 2, 3], fences=[0, 0, 1, 0])
    table.offload([1, 2])  # 1, 2 offloading (1 without fences, 2 with); 0 and 3 allocated
    table.finish([3])  # 3 released: finish is a declared no-op there
    spans = Spans(np.array([10, 20, 30, 40]), np.array([1, 2, 3, 4]))
    table.finish([0, 1, 2, 3], spans)
    assert got["freeze_lengths_rows"][0] == [0, 1, 2] and got["freeze_lengths_rows"][1].start.tolist() == [10, 20, 30]
    rows, args = got["release_request_rows"]
    assert rows == [0] and args.start.tolist() == [10] and args.length.tolist() == [1]
    rows, args = got["release_request_fenced_rows"]
    assert rows == [2] and args.start.tolist() == [30]
    assert [mod.STATES[table.snapshot(r)[0]] for r in range(4)] == ["released", "finished", "fenced", "released"]
    got.clear()
    table.create([0, 3])
    both = spans[np.array([0, 3])]
    table.offload([0, 3], both)
    assert got["start_copy_rows"][0] == [0, 3] and got["start_copy_rows"][1] is both


def test_reading_a_row_that_holds_no_machine_is_refused() -> None:
    import kvfsm.generated.decode_offload_rows as mod

    table = mod.DecodeOffloadRows(RowsEffects(), capacity=4)
    table.create([1])
    assert table.snapshot(1) == (mod.ALLOCATED, 0, 0, 0) and table.params(1) == {"fences": 0}
    with pytest.raises(RowNotCreated, match=r"DecodeOffloadRows.snapshot: row 0 \(item 0\) holds no machine"):
        table.snapshot(0)
    with pytest.raises(RowNotCreated, match=r"DecodeOffloadRows.params: row 9 \(item 0\) is outside its rows"):
        table.params(9)
