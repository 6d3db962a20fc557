"""The spec-independent half of a generated struct-of-arrays machine (`generated/<machine>_rows.py`).

A rows machine keeps one machine per table row: its state, counters and params live in numpy arrays indexed
by row, so a scheduler that fires an event for thousands of requests pays a few array operations, not a
Python call and an object per request. The generated subclass decides each event for a set of distinct rows
(`_decide_<event>`: from-state and guard masks, new values, which rows take each action) straight from the
spec; this class does what is the same for every spec:

- checks the batch (a 1-D int array of created rows; args None or index-aligned with it);
- runs a row that appears k times in k rounds (its i-th appearance in round i), so each appearance meets the
  row as the appearances before it left it, as a loop of single events would;
- rejects the whole batch, before any action runs and with every array as it was, when any item meets a
  declared error or no guard holds, naming the first such item (`Row`), its state and the spec's reason;
- writes the arrays, then calls each action once (`<action>_rows(rows, args)`) with the rows that take it,
  in the batch's order, in the event's action order, and puts the arrays back if an action raises (the
  actions that already ran stay done, as with the per-request machine's batch events).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Optional

import numpy as np

from kvfsm.errors import EventRejected, GuardRejected, RowNotCreated, RowStillLive

STATE_DTYPE = np.int8
COUNTER_DTYPE = np.int64
PARAM_DTYPE = np.int8


class Row:
    """The item of a batch that a rejection names: the machine's `row` and its `position` in the batch."""

    __slots__ = ("machine", "row", "position")

    def __init__(self, machine: RowMachine, row: int, position: int) -> None:
        self.machine, self.row, self.position = machine, row, position

    def __repr__(self) -> str:
        return f"<{type(self.machine).__name__} row {self.row}, item {self.position} of the batch>"


class Decided(NamedTuple):
    """One event decided for distinct rows (what a generated `_decide_<event>` returns); nothing written yet."""

    bad: Optional[np.ndarray]  # items the event rejects (declared error, or no guard holds); None: it rejects none
    state: np.ndarray  # each item's state before the event
    writes: tuple[tuple[str, np.ndarray, np.ndarray], ...]  # (array name, values before, values after)
    takes: tuple[np.ndarray, ...]  # per action call of the event, in its order: which items take it (bool)


def take_args(args: Any, positions: np.ndarray, n: int) -> Any:
    """The args of the items at `positions` (sorted, distinct) of a batch of `n` items: all of them as given."""
    if args is None or positions.size == n:
        return args
    return args[positions]


class RowMachine:
    """Base of every generated rows machine; the subclass sets the class attributes below from its spec."""

    STATES: tuple[str, ...] = ()
    INITIAL: int = 0
    TERMINAL: frozenset[int] = frozenset()
    COUNTERS: tuple[str, ...] = ()
    COUNTER_INITIAL: tuple[int, ...] = ()
    PARAMS: tuple[str, ...] = ()
    CREATE_ACTIONS: tuple[str, ...] = ()  # effects methods `create` calls, in order
    ERRORS: Mapping[str, Mapping[int, str]] = {}  # event -> state -> the spec's reason it is an error there
    GUARDED: Mapping[str, Mapping[int, tuple[str, ...]]] = {}  # event -> state -> guards, one of which must hold

    def __init__(self, fx: Any, capacity: int = 0) -> None:
        self.fx = fx
        self.capacity = 0
        self.created = np.zeros(0, bool)  # whether the row holds a machine (from its first `create` on)
        self.state = np.zeros(0, STATE_DTYPE)
        for name in self.COUNTERS:
            setattr(self, name, np.zeros(0, COUNTER_DTYPE))
        for name in self.PARAMS:
            setattr(self, name, np.zeros(0, PARAM_DTYPE))
        self._mark = np.zeros(0, np.intp)  # scratch for the repeated-row test
        self._iota = np.arange(0)
        self._terminal = np.array([i in self.TERMINAL for i in range(len(self.STATES))], bool)
        self.grow(capacity)

    def _arrays(self) -> tuple[str, ...]:
        return ("state", *self.COUNTERS, *self.PARAMS, "created")

    def grow(self, capacity: int) -> None:
        """Make room for rows 0..capacity-1 (never shrinks; existing rows keep their values). Arrays are
        replaced, so read them through the machine, not through a reference kept from before."""
        capacity = int(capacity)
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if capacity <= self.capacity:
            return
        for name in (*self._arrays(), "_mark"):
            old = getattr(self, name)
            new = np.zeros(capacity, old.dtype)
            new[: old.size] = old
            setattr(self, name, new)
        self.capacity = capacity

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {int(self.created.sum())} of {self.capacity} rows created>"

    def snapshot(self, row: int) -> tuple[int, ...]:
        """(state, counters...) of one row: the per-request machine's `snapshot()`, for differential tests."""
        row = self._check_row(row, "snapshot")
        return (int(self.state[row]), *(int(getattr(self, c)[row]) for c in self.COUNTERS))

    def params(self, row: int) -> dict[str, int]:
        """The params one row's machine was created with."""
        row = self._check_row(row, "params")
        return {p: int(getattr(self, p)[row]) for p in self.PARAMS}

    def _check_row(self, row: int, what: str) -> int:
        row = int(row)
        if not (0 <= row < self.capacity and self.created[row]):
            raise RowNotCreated(self, what, row, 0, self.capacity)
        return row

    # --- batches ---------------------------------------------------------------------------------------

    def _batch(self, what: str, rows: Any, args: Any) -> tuple[np.ndarray, Any]:
        """`rows` as a 1-D intp array and `args` as None or index-aligned with it; raises on a bad batch."""
        rows = np.asarray(rows)
        if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
            raise TypeError(
                f"{type(self).__name__}.{what}: rows must be a 1-D integer array, got {rows.ndim}-D {rows.dtype}"
            )
        rows = rows.astype(np.intp, copy=False)
        if isinstance(args, (list, tuple)):
            args = np.fromiter(args, dtype=object, count=len(args))
        if args is not None and len(args) != rows.size:
            raise ValueError(f"{type(self).__name__}.{what}: {rows.size} rows but {len(args)} args")
        return rows, args

    def _distinct(self, rows: np.ndarray) -> bool:
        if self._iota.size < rows.size:
            self._iota = np.arange(max(rows.size, 2 * self._iota.size))
        iota = self._iota[: rows.size]
        self._mark[rows] = iota  # a repeated row keeps only one of its positions
        return bool((self._mark[rows] == iota).all())

    def _check_created(self, what: str, rows: np.ndarray) -> None:
        if rows.min() < 0 or rows.max() >= self.capacity:
            outside = (rows < 0) | (rows >= self.capacity)
            i = int(outside.argmax())
            raise RowNotCreated(self, what, int(rows[i]), i, self.capacity)
        if not self.created[rows].all():
            i = int((~self.created[rows]).argmax())
            raise RowNotCreated(self, what, int(rows[i]), i, self.capacity)

    def _rejection(self, event: str, row: int, position: int, state: int) -> EventRejected:
        ref = Row(self, row, position)
        guards = self.GUARDED.get(event, {}).get(state)
        if guards is not None:
            return GuardRejected(ref, event, self.STATES[state], guards)
        return EventRejected(ref, event, self.STATES[state], self.ERRORS[event][state])

    def _fire(
        self, event: str, decide: Callable[[np.ndarray], Decided], actions: tuple[str, ...], rows: Any, args: Any
    ) -> None:
        """Run `event` for the batch: decide (in rounds when rows repeat), reject or write, call the actions."""
        rows, args = self._batch(event, rows, args)
        n = rows.size
        if n == 0:
            return
        self._check_created(event, rows)
        if self._distinct(rows):
            d = decide(rows)
            if d.bad is not None and d.bad.any():
                i = int(d.bad.argmax())
                raise self._rejection(event, int(rows[i]), i, int(d.state[i]))
            for name, _, after in d.writes:
                getattr(self, name)[rows] = after
            found: dict[int, np.ndarray] = {}  # an event's calls often share one mask (`taken`)
            positions = [found[id(m)] if id(m) in found else found.setdefault(id(m), m.nonzero()[0]) for m in d.takes]
            saved = [(name, rows, before) for name, before, _ in d.writes]
        else:
            positions, saved = self._rounds(event, decide, rows, len(actions))
        fx = self.fx
        whole = rows.view()
        whole.flags.writeable = False  # what puts the arrays back if an action raises indexes with `rows`
        try:
            for name, pos in zip(actions, positions):
                if pos.size:
                    getattr(fx, name)(whole if pos.size == n else rows[pos], take_args(args, pos, n))
        except BaseException:
            self._restore(saved)
            raise

    def _rounds(
        self, event: str, decide: Callable[[np.ndarray], Decided], rows: np.ndarray, calls: int
    ) -> tuple[list[np.ndarray], list[tuple[str, np.ndarray, np.ndarray]]]:
        """A batch with repeated rows: round k decides and writes every row's k-th appearance. Returns the
        positions taking each action call (in batch order) and what puts the arrays back; on a rejection the
        arrays are put back first and the item a loop would have stopped at is named."""
        n = rows.size
        order = np.argsort(rows, kind="stable")  # each row's appearances together, in batch order
        srt = rows[order]
        first = np.ones(n, bool)
        np.not_equal(srt[1:], srt[:-1], out=first[1:])
        starts = first.nonzero()[0]
        rank = np.empty(n, np.intp)  # how many appearances of its row come before each item
        rank[order] = np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n)))
        touched = srt[starts]
        saved = [(name, touched, getattr(self, name)[touched].copy()) for name in ("state", *self.COUNTERS)]
        taken = [np.zeros(n, bool) for _ in range(calls)]
        worst: Optional[tuple[int, int]] = None  # (position, state) of the first rejected item
        for k in range(int(rank.max()) + 1):
            pos = (rank == k).nonzero()[0]
            rk = rows[pos]
            d = decide(rk)
            if d.bad is not None and d.bad.any():
                j = int(d.bad.argmax())
                if worst is None or pos[j] < worst[0]:
                    worst = (int(pos[j]), int(d.state[j]))
            for name, _, after in d.writes:
                getattr(self, name)[rk] = after
            for i, m in enumerate(d.takes):
                taken[i][pos[m]] = True  # the positions (in the batch) of this round's items that take it
        if worst is not None:
            self._restore(saved)
            raise self._rejection(event, int(rows[worst[0]]), worst[0], worst[1])
        return [t.nonzero()[0] for t in taken], saved

    def _restore(self, saved: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
        for name, where, before in saved:
            getattr(self, name)[where] = before

    # --- creation --------------------------------------------------------------------------------------

    def _create(self, rows: Any, args: Any, params: Mapping[str, Any]) -> None:
        """New machines in `rows` (distinct; each never created, or its machine terminal), growing the arrays
        as needed; then the spec's `create` actions, once each with every new row."""
        rows, args = self._batch("create", rows, args)
        n = rows.size
        if n == 0:
            return
        if (rows < 0).any():
            i = int((rows < 0).argmax())
            raise ValueError(f"{type(self).__name__}.create: row {int(rows[i])} at item {i} is negative")
        if np.unique(rows).size != n:
            seen: dict[int, int] = {}
            for i, r in enumerate(rows.tolist()):
                if r in seen:
                    raise ValueError(
                        f"{type(self).__name__}.create: row {r} at items {seen[r]} and {i}; a row holds one machine"
                    )
                seen[r] = i
        values = {}
        for p, v in params.items():
            arr = np.broadcast_to(np.asarray(v), (n,))
            wrong = ~np.isin(arr, (0, 1))
            if wrong.any():
                i = int(wrong.argmax())
                raise ValueError(f"param {p} must be 0 or 1, got {arr[i].item()!r} at item {i}")
            values[p] = arr
        inside = rows < self.capacity
        live = np.zeros(n, bool)
        live[inside] = self.created[rows[inside]] & ~self._terminal[self.state[rows[inside]]]
        if live.any():
            i = int(live.argmax())
            raise RowStillLive(self, int(rows[i]), i, self.STATES[int(self.state[rows[i]])])
        capacity = self.capacity
        if rows.max() >= capacity:
            self.grow(max(int(rows.max()) + 1, 2 * capacity))
        saved = [(name, rows, getattr(self, name)[rows].copy()) for name in self._arrays()]
        self.state[rows] = self.INITIAL
        for c, initial in zip(self.COUNTERS, self.COUNTER_INITIAL):
            getattr(self, c)[rows] = initial
        for p, arr in values.items():
            getattr(self, p)[rows] = arr
        self.created[rows] = True
        try:
            for name in self.CREATE_ACTIONS:
                getattr(self.fx, name)(rows, args)
        except BaseException:
            self._restore(saved)
            raise
