"""Putting kvfsm in place: `install` / `installed` wrap a model's or a ContinuousBatchingManager's own
methods (on the instance) so that every new batch processor gets a `KvfsmOffloadingManager`, and
`SwapInstallation` is what they return (the managers, their summed metrics, and the undo).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from .compat import (
    TESTED_VERSIONS,
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
    transformers,
    transformers_version_tested,
)
from .config import SwapConfig, SwapMetrics
from .manager import KvfsmOffloadingManager


@dataclass
class SwapInstallation:
    """What `install` returns: the config and every KvfsmOffloadingManager it has put in place."""

    config: SwapConfig
    managers: list[KvfsmOffloadingManager] = field(default_factory=list)
    _undo: list[Any] = field(default_factory=list, repr=False)

    @property
    def metrics(self) -> SwapMetrics:
        total = SwapMetrics()
        for m in self.managers:
            total = total + m.metrics
        return total

    @property
    def coverage(self) -> set[int]:
        out: set[int] = set()
        for m in self.managers:
            out |= m.coverage
        return out

    def leaks(self) -> list[str]:
        return [x for m in self.managers for x in m.leaks()]

    def uninstall(self) -> None:
        """Stop installing on new batch processors (managers already in place stay)."""
        while self._undo:
            self._undo.pop()()


def _install_on_manager(manager: Any, inst: SwapInstallation) -> None:
    if getattr(manager, "_kvfsm_installation", None) is not None:
        return
    original = manager._create_batch_processor

    def create_batch_processor() -> Any:
        existing = getattr(manager, "batch_processor", None)
        if isinstance(existing, ContinuousBatchProcessor) and isinstance(
            existing.offloading_manager, KvfsmOffloadingManager
        ):
            return original()  # reset and reuse: our manager's reset() runs inside
        cb_config = manager.continuous_batching_config
        space = cb_config.cpu_offload_space
        cb_config.cpu_offload_space = 0.0  # transformers' own manager must not pin a pool of its own
        try:
            processor = original()
        finally:
            cb_config.cpu_offload_space = space
        if processor.distributed_helper.tp_size > 1:
            raise NotImplementedError("kvfsm's transformers integration runs in one process (no tensor parallelism)")
        kv = KvfsmOffloadingManager(
            processor.cache, processor.scheduler, processor.inputs_and_outputs.compute_stream, inst.config, space
        )
        processor.offloading_manager = kv
        inst.managers.append(kv)
        return processor

    manager._create_batch_processor = create_batch_processor
    manager._kvfsm_installation = inst

    def undo() -> None:
        if manager.__dict__.get("_create_batch_processor") is create_batch_processor:
            del manager._create_batch_processor
        manager._kvfsm_installation = None

    inst._undo.append(undo)


def install(target: Any, config: Optional[SwapConfig] = None) -> SwapInstallation:
    """Run the KV offloading of `target`'s continuous batching through kvfsm.

    `target`: a model (every manager its `generate_batch` / `init_continuous_batching` creates from now
    on) or a `ContinuousBatchingManager` (before its batch processor exists, i.e. before warmup/start).
    """
    if not transformers_version_tested():
        warnings.warn(
            f"kvfsm.integrations.transformers is tested with transformers {','.join(TESTED_VERSIONS)}; "
            f"this is {transformers.__version__}",
            RuntimeWarning,
            stacklevel=2,
        )
    inst = SwapInstallation(config or SwapConfig())
    if isinstance(target, ContinuousBatchingManager):
        if target.batch_processor is not None and not isinstance(
            target.batch_processor.offloading_manager, KvfsmOffloadingManager
        ):
            raise RuntimeError(
                "install() on a manager whose batch processor already exists: install before warmup/start"
            )
        _install_on_manager(target, inst)
        return inst
    if not callable(getattr(target, "init_continuous_batching", None)):
        raise TypeError(
            f"install() needs a transformers model or ContinuousBatchingManager, got {type(target).__name__}"
        )
    model = target
    original = model.init_continuous_batching

    def init_continuous_batching(*args: Any, **kwargs: Any) -> Any:
        manager = original(*args, **kwargs)
        _install_on_manager(manager, inst)
        return manager

    model.init_continuous_batching = init_continuous_batching
    cached = getattr(model, "_cached_continuous_batching_manager", None)
    if isinstance(cached, ContinuousBatchingManager):
        _install_on_manager(cached, inst)

    def undo() -> None:
        if model.__dict__.get("init_continuous_batching") is init_continuous_batching:
            del model.init_continuous_batching

    inst._undo.append(undo)
    return inst


@contextlib.contextmanager
def installed(target: Any, config: Optional[SwapConfig] = None) -> Iterator[SwapInstallation]:
    """`install` for the duration of a with-block."""
    inst = install(target, config)
    try:
        yield inst
    finally:
        inst.uninstall()
