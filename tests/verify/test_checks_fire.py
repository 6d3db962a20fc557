"""The checker checked: every invariant of the explorer's `check_world` fires on a world with its bug seeded.

The explorer's claim (no violation within a bound) is only as strong as its checks, and a weakened check
still passes every test that explores correct code. Here each check gets a reachable world and one
corruption of exactly what it guards: the device KV of a live request, the host KV of the first and of the
last of two landed copies (a check that looks at fewer chunks misses one), a stored page's bytes, an extra page, row or protected
token, two holders sharing a page, a chunk dropped from the copy queue, and so on. `check_world` must raise
a `Violation` with that check's name, and the same world without the corruption must pass.

The teardown checks (`teardown_device_full`, `..._host_full`, `..._rows_free`, `..._protected_zero`) are the
accounting checks at a quiescent state, which come first and fire on the same corruptions (their worlds
below say which); `teardown_ledger_empty` has its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvfsm.verify.explorer.checks import Violation, check_world
from kvfsm.verify.explorer.events import build
from kvfsm.verify.explorer.world import ExplorerConfig, World

CFG = ExplorerConfig(requests=2, decodes=2, backup_queue=1, host_slots=8)
GROWN = [("admit", 0), ("admit", 1), ("decode", 0), ("decode", 1), ("decode", 0), ("decode", 1)]
TWO_COPIES = GROWN + [("offload", 0), ("offload", 1)]  # two chunks in flight, neither landed
# r0's chunk stored, r1's copy landed and not yet acknowledged
STORED = TWO_COPIES + [("copy", 0), ("progress",), ("backup", 0), ("progress",), ("copy", 0)]
QUIET = GROWN + [("finish", 0), ("finish", 1), ("progress",)]  # nothing live, nothing in flight
TWO_LANDED = TWO_COPIES + [("copy", 0), ("copy", 0)]  # both copies landed, neither acknowledged


def _done_chunk(w: World, which: int) -> Any:
    done = [c for c in w.engine.manager.fx.copy_fifo if c.handle.done()]
    assert len(done) == 2, "the world must hold two landed copies, so a check of fewer chunks misses one"
    return done[which]


def _corrupt_host_copy(which: int) -> Callable[[World], Any]:
    return lambda w: w.engine.host_pool.token_view().__setitem__(
        (slice(None), slice(None), int(_done_chunk(w, which).host_indices[-1])), -1.0
    )


def _live_slot(w: World, i: int = 1) -> int:
    req = w.reqs[i]
    return int(w.engine.req_to_token.req_to_token[req.req_pool_idx, 0])


def _share_page(w: World) -> None:
    """r1's first page entry in the table becomes r0's first page."""
    t = w.engine.req_to_token.req_to_token
    r0, r1 = w.reqs[0].req_pool_idx, w.reqs[1].req_pool_idx
    t[r1, 0:2] = t[r0, 0:2]


def _share_host_slot(w: World) -> None:
    a, b = list(w.engine.manager.fx.copy_fifo)
    b._host[b.lo : b.hi] = a._host[a.lo : a.hi]


def _corrupt_stored(w: World) -> None:
    page = next(iter(w.engine.store.pages.values()))
    page[0] ^= 0xFF


def _hide_end(w: World) -> None:
    w.ends.clear()


def _ledger_owner(w: World) -> None:
    w.engine.manager.ledger.device_owner[10_000] = "nobody"


# check name -> (events to a reachable world, the corruption that check guards against)
SEEDED: dict[str, tuple[list, Callable[[World], Any]]] = {
    "spec_invariants": (TWO_COPIES, lambda w: setattr(w.engine.manager.machine_of(w.reqs[0]), "copies", -1)),
    "counters_match_chunks": (TWO_COPIES, lambda w: w.engine.manager.fx.copy_fifo.pop()),
    "deferred_release_known": (TWO_COPIES + [("finish", 0)], _hide_end),
    "holder_has_row": (GROWN, lambda w: setattr(w.reqs[1], "req_pool_idx", w.engine.req_to_token.rows)),
    "no_shared_device_page": (GROWN, _share_page),
    "live_slot_not_free": (GROWN, lambda w: w.engine.allocator.free_pages([_live_slot(w) // CFG.page_size])),
    "device_accounting": (GROWN, lambda w: w.engine.allocator.alloc_pages(1)),
    "row_accounting": (GROWN + [("finish", 1), ("progress",)], lambda w: w.engine.req_to_token.alloc()),
    "protected_accounting": (GROWN, lambda w: setattr(w.engine.protected, "size", w.engine.protected.size + 2)),
    "device_kv_content": (
        GROWN,
        lambda w: w.engine.device_pool.token_view().__setitem__((slice(None), slice(None), _live_slot(w)), -1.0),
    ),
    "no_shared_host_slot": (TWO_COPIES, _share_host_slot),
    "host_accounting": (TWO_COPIES, lambda w: w.engine.host_pool.alloc_pages(1)),
    # two landed copies, each corrupted in turn: a check that looks at fewer chunks misses one of them
    "host_kv_content of the first landed copy": (TWO_LANDED, _corrupt_host_copy(0)),
    "host_kv_content of the last landed copy": (TWO_LANDED, _corrupt_host_copy(-1)),
    "ledger_host_pages": (TWO_COPIES, lambda w: w.engine.manager.ledger.host_owner.popitem()),
    "stored_means_in_storage": (STORED, lambda w: w.engine.store.pages.clear()),
    "storage_kv_content": (STORED, _corrupt_stored),
    "teardown_ledger_empty": (QUIET, _ledger_owner),
    # the teardown pool checks: the accounting checks fire first on the same worlds
    "device_accounting at teardown": (QUIET, lambda w: w.engine.allocator.alloc_pages(1)),
    "row_accounting at teardown": (QUIET, lambda w: w.engine.req_to_token.alloc()),
    "host_accounting at teardown": (QUIET, lambda w: w.engine.host_pool.alloc_pages(1)),
    "protected_accounting at teardown": (QUIET, lambda w: setattr(w.engine.protected, "size", 2)),
}


@pytest.mark.parametrize("name", list(SEEDED))
def test_each_check_fires_on_its_seeded_bug(name: str) -> None:
    events, corrupt = SEEDED[name]
    w = build(CFG, events)  # every state on the way passes every check
    check_world(w)
    corrupt(w)
    with pytest.raises(Violation) as caught:
        check_world(w)
    assert caught.value.name == name.split(" ")[0], f"seeded {name}, {caught.value}"


def test_every_named_check_of_check_world_is_seeded() -> None:
    """A check added to check_world without a seeded bug here fails this test."""
    import inspect
    import re

    from kvfsm.verify.explorer import checks

    named = set(re.findall(r'_check\([^"]*?"([a-z_0-9]+)"', inspect.getsource(checks.check_world)))
    named |= set(re.findall(r'_check\([^"]*?"([a-z_0-9]+)"', inspect.getsource(checks._Snap)))
    redundant = {
        "teardown_device_full",
        "teardown_host_full",
        "teardown_rows_free",
        "teardown_protected_zero",
        "live_request_live_machine",
    }
    assert named - redundant - {n.split(" ")[0] for n in SEEDED} == set()
