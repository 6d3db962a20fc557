"""Tests written to kill survivors of `make mutate` in the dataplane modules (docs/mutation.md)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from kvfsm.dataplane import DeviceKVPool, KVCacheConfig
from kvfsm.dataplane.hashing import page_hash, page_hashes
from kvfsm.dataplane.pools.allocator import TokenSlotAllocator
from kvfsm.dataplane.pools.layer_pool import LayerBufferKVPool

# --- hashing ------------------------------------------------------------------------------------------------


def test_a_numpy_integer_page_size_hashes_as_the_same_int() -> None:
    """page_size may come from numpy arithmetic (an np.int64): it must mean the same int, not be refused."""
    ids = [1, 2, 3, 4]
    assert page_hashes(ids, np.int64(2)) == page_hashes(ids, 2)
    assert page_hashes(np.array(ids), np.int32(2)) == page_hashes(ids, 2)


def test_a_nested_list_of_ids_hashes_like_the_same_ndarray() -> None:
    """A list that array('I') refuses falls through to numpy, so [[..], [..]] keys the pages of its ids."""
    nested = [[1, 2], [3, 4]]
    assert page_hashes(nested, 2) == page_hashes(np.array(nested), 2) == page_hashes([1, 2, 3, 4], 2)


def test_a_prior_hash_with_a_blank_among_its_digits_is_refused() -> None:
    """bytes.fromhex skips blanks, so only the string's length keeps a spaced prior from being accepted."""
    prior = hashlib.sha256(b"x").hexdigest()
    spaced = prior[:10] + " " + prior[10:]  # 65 characters, still 32 bytes
    two_blanks = prior[:10] + "  " + prior[10:]
    for bad in (spaced, two_blanks):
        with pytest.raises(ValueError, match="64 hex digits"):
            page_hashes([1, 2], 2, bad)
    assert page_hashes([1, 2], 2, prior) == page_hashes([1, 2], 2, prior.upper())


def test_page_hash_keys_a_page_in_its_requests_namespace() -> None:
    """page_hash must pass extra_key and cache_salt on: a tenant's single page lives in its own namespace."""
    ids = [7, 8, 9]
    plain = page_hash(ids)
    for kw in ({"extra_key": "e"}, {"cache_salt": "s"}, {"extra_key": "e", "cache_salt": "s"}):
        got = page_hash(ids, **kw)
        assert got == page_hashes(ids, 3, **kw)[0]
        assert got != plain
    assert page_hash(ids, extra_key="e") != page_hash(ids, cache_salt="e")


def test_a_negative_id_error_names_its_value_and_position() -> None:
    """The ValueError names the bad id and where it is (the module's contract), not a valid id before it."""
    with pytest.raises(ValueError, match=r"token id -1 at position 2 "):
        page_hashes(np.array([0, 5, -1, 2], dtype=np.int64), 2)
    with pytest.raises(ValueError, match=r"token id -3 at position 3 "):
        page_hashes(torch.tensor([1, 0, 4, -3]), 2)


def test_an_id_past_int64_error_names_its_value_and_position() -> None:
    """Ids above 2**63 - 1 are named exactly, even after an id that is exactly 2**63 - 1 (still valid)."""
    top = 2**63 - 1
    with pytest.raises(ValueError, match=rf"token id {top + 1} at position 1 "):
        page_hashes(np.array([top, top + 1], dtype=np.uint64), 2)


# --- the slot allocator -----------------------------------------------------------------------------------


def test_alloc_returns_slots_on_the_allocators_device() -> None:
    """Slot indices index a pool on the allocator's device, so alloc must put them there (meta: no GPU)."""
    alloc = TokenSlotAllocator(16, page_size=4, device="meta")
    got = alloc.alloc(8)
    assert got is not None and got.device.type == "meta" and got.dtype == torch.int64 and got.shape == (8,)
    cpu = TokenSlotAllocator(16, page_size=4).alloc(8)
    assert cpu is not None and cpu.device.type == "cpu" and cpu.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_alloc_pages_refuses_a_negative_count() -> None:
    """A negative page count is a caller's bug: it must raise, not hand out an empty list."""
    alloc = TokenSlotAllocator(16, page_size=4)
    with pytest.raises(ValueError):
        alloc.alloc_pages(-1)
    with pytest.raises(ValueError):
        alloc.alloc_pages(True)
    assert alloc.free_page_count == 3


def test_slots_are_int64_even_for_no_pages_or_narrow_page_ids() -> None:
    """Slot indices are int64 whatever the page ids' dtype, including the empty allocation (index_select needs it)."""
    alloc = TokenSlotAllocator(16, page_size=4)
    empty = alloc.alloc(0)
    assert empty is not None and empty.dtype == torch.int64 and empty.numel() == 0
    assert alloc.slots_of([]).dtype == np.int64
    narrow = alloc.slots_of(np.array([1, 3], dtype=np.int32))
    assert narrow.dtype == np.int64 and narrow.tolist() == [4, 5, 6, 7, 12, 13, 14, 15]


# --- device pools -------------------------------------------------------------------------------------------


def _filled_pool() -> DeviceKVPool:
    config = KVCacheConfig(num_layers=2, head_dim=3, kv_heads=2, dtype=torch.float32)
    pool = DeviceKVPool.create(config, 8)
    pool.storage.copy_(torch.arange(pool.storage.numel(), dtype=torch.float32).reshape(pool.storage.shape))
    return pool


def test_device_pool_gathers_the_rows_of_the_slots_named() -> None:
    """gather_rows reads token rows (dim 2) of every plane and layer, in the order of the slots given."""
    pool = _filled_pool()
    idx = torch.tensor([6, 1, 4], dtype=torch.int64)
    got = pool.gather_rows(idx)
    assert got.shape == (2, 2, 3, 2, 3)
    assert torch.equal(got, pool.storage[:, :, [6, 1, 4]])


def test_device_pool_scatters_rows_into_the_slots_named() -> None:
    """scatter_rows writes token rows (dim 2) of every plane and layer at the slots given, and nothing else."""
    pool = _filled_pool()
    before = pool.storage.clone()
    idx = torch.tensor([5, 0], dtype=torch.int64)
    rows = -torch.arange(2 * 2 * 2 * 2 * 3, dtype=torch.float32).reshape(2, 2, 2, 2, 3) - 1
    pool.scatter_rows(idx, rows)
    assert torch.equal(pool.storage[:, :, [5, 0]], rows)
    untouched = [s for s in range(8) if s not in (5, 0)]
    assert torch.equal(pool.storage[:, :, untouched], before[:, :, untouched])


def _layer_buffers(
    dtype: torch.dtype = torch.bfloat16, device: str = "cpu", layers: int = 2
) -> list[list[torch.Tensor]]:
    return [
        [
            torch.arange(8 * 2 * 3, dtype=torch.float32).reshape(8, 2, 3).to(dtype=dtype, device=device)
            + 100 * (p * layers + l)
            for l in range(layers)
        ]
        for p in range(2)
    ]


def test_layer_buffer_pool_refuses_planes_of_unequal_layer_counts() -> None:
    """K and V must have one buffer per layer each: a missing V layer is refused, not half-copied."""
    k, v = _layer_buffers()
    with pytest.raises(ValueError):
        LayerBufferKVPool([k, v[:1]])


def test_layer_buffer_pool_hands_out_each_layers_own_buffers() -> None:
    """layer_buffers(l) is (K[l], V[l]) themselves: the attention kernels write the engine's memory."""
    k, v = _layer_buffers()
    pool = LayerBufferKVPool([k, v])
    got = pool.layer_buffers(1)
    assert len(got) == 2 and got[0] is k[1] and got[1] is v[1]


def test_layer_buffer_pool_gathers_in_the_buffers_dtype_and_device() -> None:
    """Gathered rows keep the KV dtype (bf16 bits, not a float32 copy) and the pool's device (meta here)."""
    k, v = _layer_buffers(torch.bfloat16)
    pool = LayerBufferKVPool([k, v])
    idx = torch.tensor([3, 0], dtype=torch.int64)
    got = pool.gather_rows(idx)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.stack([torch.stack([b[[3, 0]] for b in plane]) for plane in (k, v)]))
    meta = LayerBufferKVPool(_layer_buffers(torch.float32, "meta"))
    assert meta.gather_rows(torch.tensor([1], device="meta")).device.type == "meta"


def test_layer_buffer_pool_pointer_table_lists_the_buffers_once() -> None:
    """layer_pointers is the int64 table of base addresses, plane-major, built once and then reused."""
    k, v = _layer_buffers()
    pool = LayerBufferKVPool([k, v])
    ptrs = pool.layer_pointers()
    assert isinstance(ptrs, torch.Tensor) and ptrs.dtype == torch.int64 and ptrs.device.type == "cpu"
    assert ptrs.tolist() == [b.data_ptr() for b in (*k, *v)]
    assert pool.layer_pointers() is ptrs


# --- generated decode_offload machine: batch forms against the loop of single events ------------------------

import collections as _collections  # noqa: E402
import copy as _copy  # noqa: E402
from typing import Any as _Any  # noqa: E402

import kvfsm.generated.decode_offload as _gen  # noqa: E402
from kvfsm.codegen.generator import batch_action_order as _batch_action_order  # noqa: E402
from kvfsm.errors import EventRejected as _EventRejected  # noqa: E402
from kvfsm.spec import load_spec as _load_spec  # noqa: E402


class _Recorder(_gen.DecodeOffloadEffectsEach):
    """Every single-item action logs (action, machine tag, arg)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, _Any, _Any]] = []

    def __getattr__(self, name: str) -> _Any:
        if name.startswith("_") or name.endswith("_each") or name not in _gen.DecodeOffloadEffects.__dict__:
            raise AttributeError(name)

        def action(m: _gen.DecodeOffloadMachine, arg: _Any) -> None:
            self.log.append((name, m.ctx, arg))

        return action


def _reachable_machines(max_depth: int = 8) -> list[tuple[list[str], int, _gen.DecodeOffloadMachine]]:
    """Breadth-first over single events from a fresh machine of each `fences` value: (path, fences, machine)
    for every distinct reachable snapshot within max_depth events."""
    starts = [_gen.DecodeOffloadMachine(_Recorder(), ctx=0, fences=f) for f in (0, 1)]
    seen = {(m.fences, m.snapshot()) for m in starts}
    out = [([], m.fences, m) for m in starts]
    queue = _collections.deque([(m, []) for m in starts])
    while queue:
        m, path = queue.popleft()
        if len(path) >= max_depth:
            continue
        for event in _gen.EVENTS:
            probe = _copy.deepcopy(m)
            try:
                getattr(probe, event)(None)
            except _EventRejected:
                continue
            key = (probe.fences, probe.snapshot())
            if key not in seen:
                seen.add(key)
                out.append((path + [event], probe.fences, probe))
                queue.append((probe, path + [event]))
    return out


_ORDERS: dict[str, _Any] = {}
_SPEC_CACHE: list[_Any] = []


def _SPEC() -> _Any:
    if not _SPEC_CACHE:
        _SPEC_CACHE.append(_load_spec("spec/decode_offload.yaml"))
    return _SPEC_CACHE[0]


def _run_both(machines: list[_gen.DecodeOffloadMachine], event: str) -> None:
    """Loop of single events vs `<event>_each` on deep copies: same outcome, machines, action calls."""
    fx_loop, fx_batch = _Recorder(), _Recorder()
    loop = _copy.deepcopy(machines)
    batch = _copy.deepcopy(machines)
    for k, (a, b) in enumerate(zip(loop, batch)):
        a.fx, b.fx, a.observer, b.observer = fx_loop, fx_batch, None, None
        a.ctx = b.ctx = k
    args = [f"a{k}" for k in range(len(machines))]
    before = [m.snapshot() for m in batch]
    error = None
    try:
        for m, arg in zip(loop, args):
            getattr(m, event)(arg)
    except _EventRejected as exc:
        error = type(exc)
    if error is not None:
        with pytest.raises(error):
            getattr(_gen.DecodeOffloadMachine, f"{event}_each")(batch, args)
        assert [m.snapshot() for m in batch] == before and fx_batch.log == []
        return
    getattr(_gen.DecodeOffloadMachine, f"{event}_each")(batch, args)
    assert [m.snapshot() for m in batch] == [m.snapshot() for m in loop], event
    order = _ORDERS.setdefault(event, _batch_action_order(_SPEC(), event))
    assert order is not None
    assert fx_batch.log == [e for a in order for e in fx_loop.log if e[0] == a], event


def test_every_batch_event_from_every_reachable_state_equals_the_loop() -> None:
    """Each `<event>_each` on a pair of identical machines in every state reachable in a few events (both
    `fences` values, the fenced state included) must match the loop of single events: accept/reject, final
    machines, and each action's items in the event's action order."""
    states = _reachable_machines(6)
    for _path, _f, m in states:
        for event in _gen.EVENTS:
            _run_both([m, m], event)


def test_batches_mixing_machines_in_different_states_equal_the_loop() -> None:
    """A batch mixes machines of different states and fences values (a pair of neighbouring reachable
    states): the batch must decide and act per item exactly as the loop does."""
    states = _reachable_machines(6)
    for k in range(len(states) - 1):
        for event in _gen.EVENTS:
            _run_both([states[k][2], states[k + 1][2]], event)
            _run_both([states[k + 1][2], states[-1 - k][2]], event)
