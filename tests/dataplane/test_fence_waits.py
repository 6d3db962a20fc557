"""Every fenced free and release makes the writing stream wait on its fence, as an enqueued wait, not only a
fence marked waited.

On the CPU, `DeferredCpuCopyEngine.waits` records each stream wait made on one of its handles (the stream, the
handle). A free that only set `fence.waited` (or called `mark_waited`) records nothing, so these tests fail
for it on the CPU, where a copy twin's wait would otherwise hide the difference. Covered here: the SGLang
adapter's allocator view, the manager's `fence_copies_in_flight` and the engine writer's `wait_fences` of
reused fenced pages; transformers' fenced swap-out is in tests/integrations/test_transformers_swap.py.
"""

from __future__ import annotations

from typing import Any

import torch

from kvfsm.dataplane import DeferredCpuCopyEngine, KVCacheConfig
from kvfsm.dataplane.fences import SlotFence
from kvfsm.integrations.sglang.objects import AllocatorView
from kvfsm.verify.engine import SimEngine

from .helpers import make_device_pool, make_host_pool


class SGLangAllocator:
    """What AllocatorView calls of SGLang's paged allocator; every call logged in order."""

    page_size = 4
    device = torch.device("cpu")

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def free_segment(self, slots: torch.Tensor, start_pos: int = 0) -> None:
        self.log.append(("free_segment", slots.tolist()))


def test_the_sglang_adapters_fenced_free_waits_before_it_frees() -> None:
    cfg = KVCacheConfig.tiny()
    dev, host = make_device_pool(cfg, 64), make_host_pool(cfg, 32, 4)
    engine = DeferredCpuCopyEngine(stream_ordered=True)  # the GPU's case: a wait lands nothing
    handle = engine.submit_d2h(dev, torch.arange(8, 12), host, host.alloc(4))
    log: list[Any] = []
    waits = engine.waits

    class Logged(list):  # type: ignore[type-arg]
        def append(self, item: Any) -> None:
            log.append(("wait", item))
            super().append(item)

    engine.waits = Logged(waits)
    AllocatorView(SGLangAllocator(log), 64).free(torch.arange(8, 12), fence=SlotFence([handle]))
    assert log == [("wait", (None, handle)), ("free_segment", [8, 9, 10, 11])]  # on the current stream, first
    assert not handle.done()  # ordered, not landed: the host did not wait


def test_fence_copies_in_flight_enqueues_a_wait_on_every_copy_in_flight() -> None:
    e = SimEngine(page_size=2, stride=2, host_slots=16, device_slots=64, rows=3, fenced=True, stream_ordered=True)
    reqs = [e.admit(f"r{i}", 5) for i in range(3)]
    for _ in range(3):
        for r in reqs:
            e.decode(r)
    assert e.manager.offload_batch(reqs) == 3
    pending = [h for h in e.copies.pending]
    stream = object()
    assert e.manager.fence_copies_in_flight(stream) == len(pending) == 1  # one batch: one copy
    assert e.copies.waits == [(stream, h) for h in pending]
    for r in reqs:
        e.end(r)
    e.settle()


def test_the_writer_of_a_reused_fenced_page_waits_on_its_fence() -> None:
    e = SimEngine(page_size=2, stride=2, host_slots=16, device_slots=16, rows=3, fenced=True, stream_ordered=True)
    a = e.admit("a", 5)
    for _ in range(3):
        e.decode(a)
    assert e.manager.offload(a)
    (copy,) = e.copies.pending
    e.end(a)  # fenced release under the copy: its pages go back with the copy's fence
    assert e.allocator.fenced_page_count > 0 and not e.copies.waits
    b = e.admit("b", 9)  # needs more than the plain free pages: takes fenced ones, and its writer waits
    assert b is not None and (None, copy) in e.copies.waits
    e.end(b)
    e.settle()
