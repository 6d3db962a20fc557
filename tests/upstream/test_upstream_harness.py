"""Every scenario runs on upstream SGLang 0.5.23's manager, and what the harness sees is self-consistent.

This is what makes the harness a trustworthy reference for the differential test: if upstream's own run
did not free each owned slot once, return every host slot and store each offloaded page's bytes under its
key, a comparison with kvfsm would compare against noise. Where upstream itself leaks (one scenario, TP
ranks that disagree on host-pool space), the test pins down exactly what it does.
"""

from __future__ import annotations

from collections import Counter

import pytest

import harness
from scenarios import SCENARIOS, Scenario

# Upstream behaviour that breaks the invariants below on purpose; each is asserted in its own test.
UPSTREAM_HAZARDS = {"tp2-host-full-on-one-rank"}


def _results(sc: Scenario, _cache: dict = {}) -> list[harness.RunResult]:  # noqa: B006 (one run per scenario)
    if sc.name not in _cache:
        _cache[sc.name] = harness.run_scenario(sc)
    return _cache[sc.name]


def check_self_consistent(sc: Scenario, r: harness.RunResult) -> None:
    ps = sc.page_size
    # Device: every slot a request allocated goes back exactly once; none of the tree's.
    owned = Counter(s for slots in r.owned.values() for s in slots)
    freed = Counter(r.all_freed())
    assert freed == owned, f"freed - owned: {freed - owned}, owned - freed: {owned - freed}"
    tree = {s for slots in r.tree_slots.values() for s in slots}
    assert not tree & set(freed), "a slot of the radix tree was freed"
    assert r.final["<tree>"]["protected"] == 0, "a prefix stayed locked"
    # Each request is released once, through one free_kv_row of [cache_protected_len, kv_allocated_len).
    released = Counter(rid for st in r.steps for rid in st.released)
    assert released == Counter(spec.rid for spec in sc.requests)
    ranges = {}
    for st in r.steps:
        for rid, rg in st.freed_ranges:
            assert rid not in ranges, f"{rid} released twice"
            ranges[rid] = rg
    for spec in sc.requests:
        allocated = spec.prefix + len(r.owned[spec.rid])
        assert ranges[spec.rid] == [(spec.prefix, allocated)], (spec.rid, ranges[spec.rid])
        assert r.final[spec.rid] == {
            "req_pool_idx": None,
            "kv_allocated_len": 0,
            "cache_protected_len": spec.prefix,
            "lock": False,
        }
    # Host: every slot taken for a copy is returned, and the pool ends as it started.
    host_alloc = sum(st.host_alloc for st in r.steps)
    assert host_alloc == sum(st.host_freed for st in r.steps)
    assert r.host_free_at_end == r.host_free_at_start
    assert host_alloc % ps == 0
    # Storage: each key written once, known, holding exactly the KV written for that page.
    keys = r.all_keys()
    assert len(keys) == len(set(keys)), "a key was written twice"
    for key, data in r.stored.items():
        assert key in r.expected, f"unexpected key {key}"
        assert data == r.expected[key][2], f"bytes of {key} ({r.expected[key][:2]}) differ from the KV written"
    # One key per offloaded page: per request, its stored pages are a prefix of its chain (no holes) ...
    stored_pages = 0
    for spec in sc.requests:
        chain = [p for k, p in r.chains[spec.rid] if k in r.stored]
        stored_pages += len(chain)
        if not sc.fail_backup_pages:
            first = len(spec.prompt) // ps
            assert chain == list(range(first, first + len(chain))), (spec.rid, chain)
    # ... and the offloaded pages (host slots taken) are all stored, unless a backup failed. Identical
    # tokens under one namespace give one key: such a page counts once per request here, once on disk.
    if sc.fail_backup_pages:
        assert stored_pages < host_alloc // ps
    else:
        assert stored_pages == host_alloc // ps, (stored_pages, host_alloc // ps)


@pytest.mark.parametrize("sc", [s for s in SCENARIOS if s.name not in UPSTREAM_HAZARDS], ids=lambda s: s.name)
def test_scenario_is_self_consistent_on_upstream(sc: Scenario) -> None:
    results = _results(sc)
    assert len(results) == sc.tp
    for r in results:
        check_self_consistent(sc, r)
    if sc.tp > 1:
        # Ranks agree on everything but the bytes (each holds its own heads).
        first = results[0]
        for other in results[1:]:
            for a, b in zip(first.steps, other.steps):
                assert (a.offloads, a.released, a.host_alloc, a.host_freed, a.keys) == (
                    b.offloads,
                    b.released,
                    b.host_alloc,
                    b.host_freed,
                    b.keys,
                )
            assert set(first.stored) == set(other.stored)
            assert all(first.stored[k] != other.stored[k] for k in first.stored)


@pytest.mark.parametrize("name", ["plain-p4-s8", "prefix-matched", "abort-mid-offload", "backup-failure", "tp2"])
def test_runs_are_deterministic(name: str) -> None:
    """The same scenario twice gives the same record, so a difference against kvfsm is kvfsm's."""
    sc = next(s for s in SCENARIOS if s.name == name)
    assert harness.diff_runs(_results(sc), harness.run_scenario(sc)) == []


def test_frees_are_attributed_to_their_owner() -> None:
    """Every freed slot belongs to the request releasing it, at a row position it allocated."""
    for sc in SCENARIOS:
        if sc.name in UPSTREAM_HAZARDS:
            continue
        for r in _results(sc):
            for st in r.steps:
                assert {owner for owner, _ in st.freed_at} <= set(st.released), (sc.name, st.step)
            for spec in sc.requests:
                positions = sorted(pos for st in r.steps for owner, pos in st.freed_at if owner == spec.rid)
                assert positions == list(range(spec.prefix, spec.prefix + len(r.owned[spec.rid]))), spec.rid


def test_every_tag_offloads_something() -> None:
    """No scenario degenerates into a run with no offload at all."""
    for sc in SCENARIOS:
        assert any(st.offloads for r in _results(sc) for st in r.steps), sc.name


def test_identical_namespaces_share_keys_and_distinct_ones_do_not() -> None:
    """`cache_salt=""` is no salt (same keys as a plain request); `extra_key=""` is a namespace of its own;
    LoRA extends extra_key."""
    sc = next(s for s in SCENARIOS if s.name == "namespaced")
    (r,) = _results(sc)
    chains = {rid: frozenset(k for k, _ in chain) for rid, chain in r.chains.items()}
    assert chains["empty-salt"] == chains["plain"]
    others = [v for rid, v in chains.items() if rid != "empty-salt"]
    assert len(set(others)) == len(others)
    assert all(chains[rid] <= set(r.stored) for rid in chains)


def test_abort_mid_offload_releases_at_the_next_progress_check() -> None:
    """A request that ends while its copy is unacknowledged keeps its slots until the ack arrives."""
    sc = next(s for s in SCENARIOS if s.name == "abort-mid-offload")
    (r,) = _results(sc)
    end = {spec.rid: spec.start + spec.decode for spec in sc.requests}
    released_at = {rid: st.step for st in r.steps for rid in st.released}
    assert released_at["a"] == end["a"] + 1  # the progress check of the abort step was skipped
    assert released_at["b"] == end["b"]


def test_tail_after_the_last_chunk_is_never_offloaded() -> None:
    """Finishing off a chunk boundary drops the tail; on a boundary the final call offloads one more chunk
    (and the release waits for it)."""
    sc = next(s for s in SCENARIOS if s.name == "finish-on-and-off-boundary")
    (r,) = _results(sc)
    stored = {rid: sum(1 for k, _ in r.chains[rid] if k in r.stored) for rid in ("on", "off")}
    assert stored == {"on": 2, "off": 2}
    end = {spec.rid: spec.start + spec.decode for spec in sc.requests}
    released_at = {rid: st.step for st in r.steps for rid in st.released}
    offload_steps = {rid: [st.step for st in r.steps if rid in st.offloads] for rid in ("on", "off")}
    assert offload_steps["on"][-1] == end["on"] and released_at["on"] == end["on"] + 1
    assert offload_steps["off"][-1] < end["off"] and released_at["off"] == end["off"]


def test_host_pool_full_retries_the_chunk_later() -> None:
    """A refused copy leaves the request's offload cursor where it was: the next accepted chunk starts
    there, so the chain has no hole."""
    sc = next(s for s in SCENARIOS if s.name == "host-pool-full")
    (r,) = _results(sc)
    assert max(st.host_alloc for st in r.steps) <= r.host_free_at_start
    stored = {rid: sum(1 for k, _ in chain if k in r.stored) for rid, chain in r.chains.items()}
    assert stored["r2"] < stored["r0"]  # r2 lost the race for host slots at least once


def test_backup_failure_frees_host_slots_and_does_not_retry() -> None:
    sc = next(s for s in SCENARIOS if s.name == "backup-failure")
    (r,) = _results(sc)
    offloaded = sum(st.host_alloc for st in r.steps) // sc.page_size
    # A failing page ends its op: page 1 is the second page of a's first chunk, page 6 the first of a later
    # chunk, whose second page is then never attempted.
    assert len(r.stored) == offloaded - 3


def test_tp2_host_full_on_one_rank_strands_the_other_rank() -> None:
    """Upstream hazard: the host-full decision is per rank, but acks are consumed by the MIN over ranks.
    When only rank 1 refuses a chunk, rank 0's copy is never acknowledged: rank 0 never releases the
    request (device and host slots held, nothing stored) while rank 1 does, and every later retraction is
    refused on both ranks."""
    sc = next(s for s in SCENARIOS if s.name == "tp2-host-full-on-one-rank")
    r0, r1 = _results(sc)
    assert [st.step for st in r0.steps if st.offloads] == [8] and not any(st.offloads for st in r1.steps)
    assert not any(st.released for st in r0.steps) and r0.final["a"]["req_pool_idx"] is not None
    assert not r0.all_freed() and r0.host_free_at_end == r0.host_free_at_start - 8 and not r0.stored
    assert [st.released for st in r1.steps if st.released] == [["a"]] and len(r1.all_freed()) == 16
    for r in (r0, r1):
        (retract,) = [st.retract for st in r.steps if st.retract]
        assert retract.startswith("refused: Decode KV offload copies are still pending on some rank")
