"""The generated batch events (`<event>_each`): the transitions of a loop of single events.

A batch decides every item (guards, counters, state, in list order, so a machine may appear twice), then
calls each action once with every item that takes it, in the event's action order. So, against a loop of
single events on identical machines: the same final machines, and per action the same items in the same
order; a rejected item or a raising action leaves every machine as it was. Checked mode and tracing make
a batch run item by item, so the manager's two paths must agree on everything observable.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

import kvfsm.generated.cb_swap as cb_gen
import kvfsm.generated.decode_offload as gen
from kvfsm.generated.decode_offload import DecodeOffloadEffectsEach, DecodeOffloadMachine
from kvfsm.codegen.generator import batch_action_order
from kvfsm.errors import EventRejected
from kvfsm.spec import load_spec

from test_offload_batch import run_workload  # tests/runtime is on sys.path (rootdir-relative test modules)


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


def random_machines(rng: random.Random, fx: Recorder, n: int) -> list[DecodeOffloadMachine]:
    """n machines driven by random single events into assorted states and counters."""
    ms = [DecodeOffloadMachine(fx, ctx=i) for i in range(n)]
    for _ in range(n * 6):
        m = rng.choice(ms)
        try:
            getattr(m, rng.choice(gen.EVENTS))(None)
        except EventRejected:
            pass
    fx.log.clear()
    return ms


def by_action(log: list[tuple[str, Any, Any]], order: list[str]) -> list[tuple[str, Any, Any]]:
    return [entry for a in order for entry in log if entry[0] == a]


@pytest.mark.parametrize("seed", range(300))
def test_batch_equals_loop_of_single_events(seed: int) -> None:
    rng = random.Random(seed)
    fx_loop = Recorder()
    loop = random_machines(rng, fx_loop, rng.randint(1, 5))
    fx_batch = Recorder()
    batch = copy.deepcopy(loop)
    for m in batch:
        m.fx = fx_batch
    event = rng.choice(gen.EVENTS)
    picks = [rng.randrange(len(loop)) for _ in range(rng.randint(0, 6))]  # repeats allowed
    args = [f"arg{k}" for k in range(len(picks))]
    before = [m.snapshot() for m in batch]
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
        return
    getattr(DecodeOffloadMachine, f"{event}_each")([batch[i] for i in picks], args)
    assert [m.snapshot() for m in batch] == [m.snapshot() for m in loop]
    order = batch_action_order(load_spec("spec/decode_offload.yaml"), event)
    assert order is not None
    assert fx_batch.log == by_action(fx_loop.log, order)


@pytest.mark.parametrize("event,fail", [("copy_done", "submit_backup"), ("backup_done", "free_host_chunk"),
                                        ("offload", "start_copy")])
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
    assert batch_action_order(load_spec("spec/decode_offload.yaml"), "copy_done") == [
        "hash_chunk", "submit_backup", "release_request"]
    assert "item by item" in (cb_gen.CbSwapMachine.swap_out_done_each.__doc__ or "")


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("page_size,stride,host_slots", [(1, 0, 12), (2, 4, 8), (4, 0, 64)])
def test_checked_item_by_item_equals_unchecked_batches(seed: int, page_size: int, stride: int, host_slots: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager's batch path (unchecked) against its item-by-item path (checked mode's observer), with
    parked chunks (a backup queue of 1) and failed backups (a quarter of the page hashes)."""
    from kvfsm.dataplane import storage

    real = storage.FaultyStorage.__init__

    def failing(self, inner, fail_writes=None, **kw):  # type: ignore[no-untyped-def]
        real(self, inner, fail_writes=lambda key: int(key[:2], 16) < 64, **kw)
    monkeypatch.setattr(storage.FaultyStorage, "__init__", failing)
    kw = dict(page_size=page_size, stride=stride, host_slots=host_slots, device_slots=96, rows=5, max_context=48,
              backup_queue=1)
    checked = run_workload(True, seed, checked=True, **kw)
    unchecked = run_workload(True, seed, checked=False, **kw)
    for step, (a, b) in enumerate(zip(checked, unchecked)):
        assert a == b, f"step {step}: item-by-item and batch paths diverge"
    assert checked[-1]["metrics"]["backup_failures"] > 0 and checked[-1]["metrics"]["parked_chunks"] > 0
