"""What a user sets and reads: `SwapConfig` (how kvfsm runs the engine's swaps), `SwapMetrics` (what one
offloading manager counted) and `_size_host_pool`, the host-pool sizing rule SwapConfig documents.

Plain data, no engine state: the manager and the installer both read these, and users build a SwapConfig
before anything else exists.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Optional, Union

from kvfsm.dataplane import CopyEngine

if TYPE_CHECKING:
    from .pool import PagedCachePool


@dataclass
class SwapConfig:
    """How kvfsm runs the engine's swaps.

    Host pool size: `host_blocks` wins, then `host_bytes`, then the engine's own `cpu_offload_space`
    (GiB) when it is positive, else 1 GiB. `copy_engine`: "auto" (CUDA engine for a CUDA cache, CPU
    engine otherwise), "cpu", "cuda", or a CopyEngine instance.

    `fenced` is the spec's `fences` param: a victim's device blocks go back to the engine at its swap-out,
    fenced (the compute stream waits on the copy; the host does not), instead of after a host wait for the
    copy; those of a request ended under its swap-in go back at once, fenced against the swap-in that still
    writes them, instead of at its acknowledgement. None (default): fenced when the copy engine's handles
    fence (`CopyEngine.fences`, true of every kvfsm engine); True requires it; False keeps the deferred release.

    `copy_on_compute_stream` (the CUDA engine the integration builds, "auto"/"cuda"): run each swap's copy
    on the engine's compute stream itself rather than on a copy stream ordered after it. The compute stream
    waits on every swap at once anyway (the fenced release and the restore both make it), so a copy stream
    overlaps nothing, and without it a swap records and waits on no ordering event
    (bench/probes/transformers_host_time.py measures both).
    """

    host_blocks: Optional[int] = None
    host_bytes: Optional[int] = None
    copy_engine: Union[str, CopyEngine] = "auto"
    checked: bool = False
    pin_memory: Optional[bool] = None  # None: pinned when CUDA is available
    fenced: Optional[bool] = None  # None: fenced when the copy engine fences
    copy_on_compute_stream: bool = True


@dataclass
class SwapMetrics:
    """Counts and times of one KvfsmOffloadingManager (add them with `+`)."""

    preempts: int = 0  # swap-outs submitted
    soft_resets: int = 0  # victims the host pool could not hold (re-prefilled by the engine)
    swap_outs_done: int = 0
    restores: int = 0  # swap-ins submitted
    swap_ins_done: int = 0
    finishes: int = 0  # swapped-at-least-once requests that finished
    cancels: int = 0  # cancel events (client cancellation, engine failure or reset)
    deferred_releases: int = 0  # ends while a copy was in flight (release at its ack)
    fenced_releases: int = 0  # swap-outs whose device blocks went back at once, fenced
    fenced_ends: int = 0  # ends under a swap-in whose device blocks went back at once, fenced against it
    restore_waits: int = 0  # restores that waited on the host for a fenced swap-out not yet seen landed
    preempt_waits: int = 0  # swap-outs that waited on the host for the victim's swap-in not yet seen landed
    ignored_ends: int = 0  # declared no-op finish/cancel calls
    blocks_out: int = 0
    blocks_in: int = 0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    verified_copies: int = 0  # checked mode: landed copies compared with their source
    host_blocks_peak: int = 0
    offload_calls: int = 0
    restore_calls: int = 0
    time_offload_s: float = 0.0  # host wall time inside offload_requests (victim choice, swap-outs)
    time_restore_s: float = 0.0  # host wall time inside restore_scheduled_requests calls that restored a request

    def __add__(self, other: SwapMetrics) -> SwapMetrics:
        out = SwapMetrics()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(out, f.name, max(a, b) if f.name == "host_blocks_peak" else a + b)
        return out

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _fenced(config: SwapConfig, engine: CopyEngine) -> bool:
    """SwapConfig.fenced resolved against the engine: a fenced release needs handles that fence."""
    fences = bool(getattr(engine, "fences", False))
    if config.fenced is None:
        return fences
    if config.fenced and not fences:
        raise ValueError(
            f"SwapConfig(fenced=True): the copy engine {type(engine).__name__} does not fence its copies "
            "(CopyEngine.fences is false), so a victim's blocks cannot go back while its copy reads them"
        )
    return bool(config.fenced)


def _size_host_pool(config: SwapConfig, device_pool: PagedCachePool, space_gib: Optional[float]) -> int:
    if config.host_blocks is not None:
        return int(config.host_blocks)
    if config.host_bytes is not None:
        nbytes = int(config.host_bytes)
    elif space_gib:
        nbytes = int(float(space_gib) * 2**30)
    else:
        nbytes = 2**30
    n = nbytes // device_pool.block_bytes
    if n < 1:
        raise ValueError(f"host pool of {nbytes} bytes holds no block of {device_pool.block_bytes} bytes")
    return n
