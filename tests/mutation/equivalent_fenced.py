"""Equivalent survivors of `make mutate` in the fenced release's code (allocator, effects, ledger, manager, build), and why (merged into equivalent.EQUIVALENT)."""

from __future__ import annotations

from equivalent_helpers import _def, _lines  # noqa: F401

_ALLOC_FENCED_RETURN = 'return (out if self.device.type == "cpu" else out.to(self.device)), fences'

EQUIVALENT: list[tuple[str, str, str]] = [
    # --- the allocator ---------------------------------------------------------------------------------
    (
        "xǁTokenSlotAllocatorǁalloc_fenced",
        "|".join(
            _lines(_ALLOC_FENCED_RETURN, _ALLOC_FENCED_RETURN.replace('self.device.type == "cpu"', cond))
            for cond in (
                '(self.device.type == "cpu") and False',
                'self.device.type == "XXcpuXX"',
                'self.device.type == "CPU"',
            )
        ),
        "the test then never holds (`and False`, or a device type torch never spells: its types are lower case), "
        "so the slots always go through out.to(self.device): on a CPU allocator Tensor.to to the device the tensor is already on returns that same "
        "tensor (no copy), and on any other device it is what the original does",
    ),
    (
        "xǁTokenSlotAllocatorǁalloc_pages_fenced",
        _lines("ever[p] = 1", "ever[p] = 2"),
        "the ever-allocated bytes are only read for their truth (_validate_free: NeverAllocated or DoubleFree), "
        "and a page reused from the fenced list was allocated before it was freed, so its byte is already 1",
    ),
    # --- the `fences` capability flags: a missing attribute's default ----------------------------------
    (
        "x_check_fences",
        _lines(
            'if config.fenced_release and not getattr(copy_engine, "fences", False):',
            'if config.fenced_release and not getattr(copy_engine, "fences", None):',
        ),
        "the default is only tested with `not`: `not None` and `not False` are both True",
    ),
    (
        "xǁDecodeOffloadManagerǁ__init__",
        _lines(
            'if config.fenced_release and not getattr(allocator, "fences", False):',
            'if config.fenced_release and not getattr(allocator, "fences", None):',
        ),
        "the default is only tested with `not`: `not None` and `not False` are both True",
    ),
    # --- the engine's fenced release: the ledger's event name --------------------------------------------
    (
        "xǁOffloadEffectsǁrecord_engine_release_fenced",
        _lines(
            'self.ledger.release_owned(rec.key, "released_by_engine_fenced", fence)',
            "self.ledger.release_owned(rec.key, ",
        )
        + r'(None|"XXreleased_by_engine_fencedXX"|"RELEASED_BY_ENGINE_FENCED")'
        + r", fence\)",
        "the event only labels a CheckedModeError, and release_owned raises none here: its pages are exactly those "
        "the ledger has the request own (never the prefix cache's or another request's, and never also released by "
        "it: claiming a page clears its released mark), every copy still reading them is one of the request's own "
        "(claim_device refuses any other owner's copy, B1), tracked in the copy FIFO until its acknowledgement takes "
        "it off the page's readers, and the fence is made of every handle of the request's copies in that FIFO, so "
        "it covers each reader (and the LifecycleError for copies the engine's stream never waited on comes before)",
    ),
]
