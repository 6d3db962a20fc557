"""The generated batch events (`<event>_each`): the transitions of a loop of single events.

A batch decides every item (guards, counters, state, in list order, so a machine may appear twice), then
calls each action once with every item that takes it, in the event's action order. So, against a loop of
single events on identical machines: the same final machines, and per action the same items in the same
order; a rejected item or a raising action leaves every machine as it was. Checked mode and tracing make
a batch run item by item, so the manager's two paths must agree on everything observable.
"""

from __future__ import annotations

import collections
import copy
import functools
import random
from typing import Any

import pytest

from test_offload_batch import run_workload  # tests/runtime is on sys.path (rootdir-relative test modules)

import kvfsm.generated.cb_swap as cb_gen
import kvfsm.generated.decode_offload as gen
from kvfsm.codegen.generator import batch_action_order
from kvfsm.errors import EventRejected
from kvfsm.generated.decode_offload import DecodeOffloadEffectsEach, DecodeOffloadMachine
from kvfsm.spec import load_spec


class Recorder(DecodeOffloadEffectsEach):
    """Every action logs (action, machine tag, arg); `fail` names an action that raises."""

    def __init__(self, fail: str | None = None) -> None:
        self.log: list[tuple[str, Any, Any]] = []
        self.fail = fail

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name.endswith("_each") or name not in gen.DecodeOffloadEffects.__dict__:
            raise AttributeError(name)

        def action(m: DecodeOffloadMachine, arg: Any) -> None:
            if name == self.fail:
                raise RuntimeError(f"{name} failed")
            self.log.append((name, m.ctx, arg))

        return action


# Weights of the random walk that puts machines into assorted states: mostly events that keep a request
# live and give it copies and host chunks, rarely an end (a released machine accepts almost nothing).
WALK = {
    "offload": 6,
    "copy_done": 3,
    "copy_parked": 2,
    "backup_resubmit": 2,
    "backup_done": 3,
    "backup_failed": 2,
    "host_full": 1,
    "finish": 1,
    "abort": 1,
    "retract": 1,
}
SEEDS = 330  # 30 per event
# event -> non-empty batches accepted; (event, source state) and transition ids their items took; rejected
# batches per event; seeds run (test_zz_every_event_batched_in_live_states reads these).
ACCEPTED: dict[str, int] = {}
SOURCES: set[tuple[str, int]] = set()
TAKEN: set[int] = set()
REJECTED: dict[str, int] = {}
RAN: set[int] = set()


def _walk(rng: random.Random, m: DecodeOffloadMachine, steps: int) -> None:
    events, weights = list(WALK), list(WALK.values())
    for _ in range(steps):
        try:
            getattr(m, rng.choices(events, weights)[0])(None)
        except EventRejected:
            pass


def _accepts(m: DecodeOffloadMachine, event: str) -> bool:
    probe = copy.deepcopy(m)
    probe.fx, probe.observer = Recorder(), None
    try:
        getattr(probe, event)(None)
    except EventRejected:
        return False
    return True


def random_machines(rng: random.Random, fx: Recorder, n: int, event: str | None = None) -> list[DecodeOffloadMachine]:
    """n machines driven by a random walk of single events into assorted (mostly live) states and counters;
    given `event`, the walk goes on (a bounded number of steps, on random machines) until one accepts it."""
    ms = [DecodeOffloadMachine(fx, ctx=i, fences=rng.randint(0, 1)) for i in range(n)]  # a batch may mix them
    for m in ms:
        _walk(rng, m, rng.randint(0, 10))
    if event is not None:
        for _ in range(60):
            if any(_accepts(m, event) for m in ms):
                break
            _walk(rng, rng.choice(ms), 1)
    fx.log.clear()
    return ms


def pick_items(rng: random.Random, machines: list[DecodeOffloadMachine], event: str) -> tuple[list[int], bool]:
    """Indices for one batch of `event` (repeats allowed): chosen so that the loop accepts every item (a
    clone of the machines is driven as the loop would be), except that one batch in eight ends with an
    item the loop rejects. Returns (picks, expect_rejection)."""
    probe = copy.deepcopy(machines)
    for m in probe:
        m.fx, m.observer = Recorder(), None
    size = rng.randint(1, 6)
    picks: list[int] = []
    reject = rng.random() < 0.125
    for _ in range(size * 4):
        if len(picks) == size:
            break
        i = rng.randrange(len(machines))
        try:
            getattr(probe[i], event)(None)
        except EventRejected:
            if reject:
                return picks + [i], True
            continue
        picks.append(i)
    if reject or not picks:  # nothing acceptable (or a rejection wanted): any machine, as the old test did
        picks.append(rng.randrange(len(machines)))
    return picks, False


@functools.cache
def action_order(event: str) -> list[str] | None:
    """The shipped spec's batch action order of `event`. The spec is loaded once: a load (parse, compile, check)
    costs about 0.15 s, and loaded per case it was 38 of this module's 40 s of CPU."""
    return batch_action_order(_shipped_spec(), event)


@functools.cache
def _shipped_spec() -> Any:
    return load_spec("spec/decode_offload.yaml")


def by_action(log: list[tuple[str, Any, Any]], order: list[str]) -> list[tuple[str, Any, Any]]:
    return [entry for a in order for entry in log if entry[0] == a]


@pytest.mark.parametrize("seed", range(SEEDS))
def test_batch_equals_loop_of_single_events(seed: int) -> None:
    rng = random.Random(seed)
    event = gen.EVENTS[seed % len(gen.EVENTS)]  # every event in SEEDS / 10 cases
    fx_loop = Recorder()
    loop = random_machines(rng, fx_loop, rng.randint(1, 5), event)
    fx_batch = Recorder()
    batch = copy.deepcopy(loop)
    for m in batch:
        m.fx = fx_batch
    picks, _ = pick_items(rng, loop, event)
    taken: list[tuple[int, int]] = []  # (source state, transition id) of each item the loop accepted
    for m in loop:  # the loop's machines report their transitions (the batch's have no observer: batch path)
        m.observer = lambda m, e, src, dst, tid: taken.append((src, tid))
    args = [f"arg{k}" for k in range(len(picks))]
    before = [m.snapshot() for m in batch]
    RAN.add(seed)
    error: type[BaseException] | None = None
    try:
        for i, arg in zip(picks, args):
            getattr(loop[i], event)(arg)
    except EventRejected as exc:
        error = type(exc)
    if error is not None:
        with pytest.raises(error):
            getattr(DecodeOffloadMachine, f"{event}_each")([batch[i] for i in picks], args)
        assert [m.snapshot() for m in batch] == before and fx_batch.log == []
        REJECTED[event] = REJECTED.get(event, 0) + 1
        return
    assert all(m.observer is None for m in batch)
    getattr(DecodeOffloadMachine, f"{event}_each")([batch[i] for i in picks], args)
    assert [m.snapshot() for m in batch] == [m.snapshot() for m in loop]
    order = action_order(event)
    assert order is not None
    assert fx_batch.log == by_action(fx_loop.log, order)
    ACCEPTED[event] = ACCEPTED.get(event, 0) + 1
    SOURCES.update((event, src) for src, _ in taken)
    TAKEN.update(tid for _, tid in taken if tid >= 0)


@functools.lru_cache(maxsize=1)
def _paths_to_every_transition(max_depth: int = 8) -> dict[int, tuple[int, list[str]]]:
    """Per transition id, the `fences` param and a shortest event path from a fresh machine whose last event
    takes it (a breadth-first search over single events, from a machine of each param value: the random
    walks above reach some transitions only by luck)."""
    starts = [DecodeOffloadMachine(Recorder(), ctx=0, fences=f) for f in (0, 1)]
    paths: dict[int, tuple[int, list[str]]] = {}
    seen = {(m.fences, m.snapshot()) for m in starts}
    queue = collections.deque([(m, []) for m in starts])
    while queue and len(paths) < len(gen.TRANSITIONS):
        m, path = queue.popleft()
        for event in gen.EVENTS:
            probe = copy.deepcopy(m)
            tids: list[int] = []
            probe.observer = lambda _m, _e, _src, _dst, tid: tids.append(tid)
            try:
                getattr(probe, event)(None)
            except EventRejected:
                continue
            probe.observer = None
            for tid in tids:
                paths.setdefault(tid, (probe.fences, path + [event]))
            if (probe.fences, probe.snapshot()) not in seen and len(path) < max_depth:
                seen.add((probe.fences, probe.snapshot()))
                queue.append((probe, path + [event]))
    return paths


@pytest.mark.parametrize("tid", range(len(gen.TRANSITIONS)))
def test_every_transition_in_a_batch_equals_the_loop(tid: int) -> None:
    """Each transition taken by a batch of two machines that a shortest path put in its source state: the
    same machines and the same action calls as the loop of single events."""
    fences, path = _paths_to_every_transition()[tid]
    fx_loop, fx_batch = Recorder(), Recorder()
    loop = [DecodeOffloadMachine(fx_loop, ctx=i, fences=fences) for i in range(2)]
    for m in loop:
        for event in path[:-1]:
            getattr(m, event)(None)
    batch = copy.deepcopy(loop)
    for m in batch:
        m.fx = fx_batch
    fx_loop.log.clear()
    taken: list[tuple[int, int]] = []
    for m in loop:
        m.observer = lambda _m, _e, src, _dst, t: taken.append((src, t))
    event, args = path[-1], ["a0", "a1"]
    for m, arg in zip(loop, args):
        getattr(m, event)(arg)
    getattr(DecodeOffloadMachine, f"{event}_each")(batch, args)
    assert [m.snapshot() for m in batch] == [m.snapshot() for m in loop] and tid in {t for _, t in taken}
    order = action_order(event)
    assert order is not None and fx_batch.log == by_action(fx_loop.log, order)
    SOURCES.update((event, src) for src, _ in taken)
    TAKEN.update(t for _, t in taken if t >= 0)


def test_zz_every_event_batched_in_live_states() -> None:
    """After the cases above (file order): every event was exercised by accepted, non-empty batches from
    every state that handles it (copy and backup completions in live states included), every spec
    transition was taken inside one, and rejected batches were compared too."""
    if RAN != set(range(SEEDS)):
        pytest.skip("only part of test_batch_equals_loop_of_single_events ran in this session")
    missing_events = [e for e in gen.EVENTS if ACCEPTED.get(e, 0) == 0]
    assert not missing_events, f"events never batched: {missing_events} ({ACCEPTED})"
    handled = {(e, s) for e, states in gen.HANDLED.items() for s in states}
    missing = sorted((e, gen.STATES[s]) for e, s in handled - SOURCES)
    assert not missing, f"(event, state) never batched: {missing}"
    assert set(range(len(gen.TRANSITIONS))) <= TAKEN, (
        f"transitions never batched: {sorted(set(range(len(gen.TRANSITIONS))) - TAKEN)}"
    )
    assert sum(REJECTED.values()) >= 10, REJECTED
    for e in ("copy_done", "copy_parked", "backup_done", "backup_failed", "backup_resubmit"):
        assert ACCEPTED[e] >= 10, f"only {ACCEPTED[e]} accepted {e} batches"


@pytest.mark.parametrize(
    "event,fail", [("copy_done", "submit_backup"), ("backup_done", "free_host_chunk"), ("offload", "start_copy")]
)
def test_a_raising_action_leaves_every_machine_as_it_was(event: str, fail: str) -> None:
    fx = Recorder()
    ms = [DecodeOffloadMachine(fx, ctx=i) for i in range(3)]
    for m in ms:  # two copies each, one of them acknowledged: every event above is accepted
        m.offload(None)
        m.offload(None)
        m.copy_done(None)
    fx.fail = fail
    before = [m.snapshot() for m in ms]
    with pytest.raises(RuntimeError, match=fail):
        getattr(DecodeOffloadMachine, f"{event}_each")(ms, [None] * 3)
    assert [m.snapshot() for m in ms] == before


def test_observed_machines_run_item_by_item() -> None:
    fx = Recorder()
    seen: list[tuple[str, int]] = []
    ms = [DecodeOffloadMachine(fx, ctx=i, observer=lambda m, e, s, d, t: seen.append((e, t))) for i in range(2)]
    DecodeOffloadMachine.offload_each(ms + ms[:1], ["a", "b", "c"])
    assert seen == [("offload", 0), ("offload", 0), ("offload", 1)]  # one observer call per transition
    assert [e[2] for e in fx.log if e[0] == "start_copy"] == ["a", "b", "c"]
    with pytest.raises(ValueError):
        DecodeOffloadMachine.offload_each(ms, ["only one arg"])


def test_an_event_whose_transitions_disagree_on_action_order_has_no_batch_order() -> None:
    spec = load_spec("spec/cb_swap.yaml")
    assert batch_action_order(spec, "swap_out_done") is None  # its batch form runs item by item
    assert action_order("copy_done") == ["hash_chunk", "submit_backup", "release_request"]
    assert "item by item" in (cb_gen.CbSwapMachine.swap_out_done_each.__doc__ or "")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("page_size,stride,host_slots", [(1, 0, 12), (2, 4, 8), (4, 0, 64)])
def test_checked_item_by_item_equals_unchecked_batches(
    seed: int, page_size: int, stride: int, host_slots: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manager's batch path (unchecked) against its item-by-item path (checked mode's observer), with
    parked chunks (a backup queue of 1) and failed backups (a quarter of the page hashes)."""
    from kvfsm.dataplane import storage

    real = storage.FaultyStorage.__init__

    def failing(self, inner, fail_writes=None, **kw):  # type: ignore[no-untyped-def]
        real(self, inner, fail_writes=lambda key: int(key[:2], 16) < 64, **kw)

    monkeypatch.setattr(storage.FaultyStorage, "__init__", failing)
    kw = dict(
        page_size=page_size,
        stride=stride,
        host_slots=host_slots,
        device_slots=96,
        rows=5,
        max_context=48,
        backup_queue=1,
    )
    checked = run_workload(True, seed, checked=True, **kw)
    unchecked = run_workload(True, seed, checked=False, **kw)
    for step, (a, b) in enumerate(zip(checked, unchecked)):
        assert a == b, f"step {step}: item-by-item and batch paths diverge"
    assert checked[-1]["metrics"]["backup_failures"] > 0 and checked[-1]["metrics"]["parked_chunks"] > 0
