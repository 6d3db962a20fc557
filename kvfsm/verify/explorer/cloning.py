"""World cloning: an independent copy of a world, by a pickle round trip with a hand-written pickler.

What the pickler does that plain pickle cannot: it copies closures and lambdas (code by value, module by
name, cells copied: fault hooks and backup jobs hold them), re-makes locks, keeps every tensor, ndarray and
bytearray that views one block of memory a view of one copied block (the allocator's mask views a
bytearray), re-points weak references, and shares what must stay shared (the configs, the KV layout, the
immutable pages of the in-memory store). `_fix_records` then re-keys the manager's id()-keyed record
table by the copied requests. What it cannot copy faithfully (a thread, a generator, a CUDA tensor,
partly overlapping views) raises `CloneError`, and the search starts over in replay mode.

Measured (bench/probes/clone_probe.py -> bench/results/clone_probe-cpu.json; one CPU core, 8 seeded walks,
worlds at prefix lengths 0-18 of the default bound, whose BFS depth is 18, and 0-60 of a long-trace bound):
- copy.deepcopy(world) fails: TypeError, cannot pickle '_thread.lock'. With locks made copyable it copies
  (0.66 ms) but 0/32 copies are faithful: the allocator's mask no longer views its bytearray (the copy
  breaks at its next event, live_slot_not_free), the records' weak references point at the original's
  requests, and the storage fault predicate (a closure) reads the original engine. Not an option.
- clone(): 32/32 faithful, 0.73 ms mean (0.65 at the root, 0.82 at 18 events), nearly flat in the prefix.
- replay-from-root: faithful by construction, 0.07 ms + 0.015-0.018 ms per event, 0.25 ms mean at the
  default bound. There it is cheaper than clone(): the whole default-bound search takes 6.6 s in replay
  mode against 11.8 s in copy mode. The costs cross near 50 events (long-trace bound, 60 events: clone
  0.84 ms, replay 0.95 ms).
So deepcopy cannot replace the pickler; replay-from-root can, and at the default bound it is faster. The
pickler is kept because copy mode is the search's default and wins once shortest traces run past ~50
events; making replay the default at small bounds is the change these numbers argue for.
"""

from __future__ import annotations

import functools
import io
import itertools
import marshal
import pickle
import re
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch

from kvfsm.verify.explorer.world import World

_CODE: dict[int, tuple[types.CodeType, bytes]] = {}  # id(code) -> (code, marshal.dumps(code))
_CODE_LOADED: dict[bytes, types.CodeType] = {}
_LOCKS = {type(threading.Lock()): threading.Lock, type(threading.RLock()): threading.RLock}
_COUNT_RE = re.compile(r"count\((-?\d+)\)")
# Object arrays are pickled by their filled slots (off: element by element, as pickle does); a switch so that
# bench/explorer_speed.py can measure what it saves.
SPARSE_OBJECT_ARRAYS = True


class CloneError(RuntimeError):
    """The world holds something `clone` cannot copy faithfully; explore with mode="replay" instead."""


class _Region:
    """One block of memory (a tensor storage, a bytearray, an ndarray's buffer), pickled once however many
    objects view it: a tensor made with torch.frombuffer(bytearray) stays a view of the copied bytearray."""

    __slots__ = ("start", "nbytes", "data", "ba", "base")
    ba: bytearray  # set when rebuilt from its bytes (_rebuild_region)
    base: torch.Tensor

    def __init__(self, start: int, nbytes: int, data: Callable[[], bytes]) -> None:
        self.start, self.nbytes, self.data = start, nbytes, data

    def __reduce__(self) -> tuple:
        return (_rebuild_region, (self.data(),))


def _tensor_bytes(raw: torch.Tensor) -> bytes:
    return raw.numpy().tobytes()


def _forget(records: dict[int, Any], ref: weakref.KeyedRef[int, Any]) -> None:
    """A copied request object is gone (`ref.key` was its id): drop its record."""
    records.pop(ref.key, None)


def _rebuild_region(data: bytes) -> _Region:
    r = _Region(0, len(data), lambda: b"")
    r.ba = bytearray(data)
    r.base = torch.frombuffer(r.ba, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return r


def _rebuild_tensor(r: _Region, offset: int, dtype: torch.dtype, size: tuple, stride: tuple) -> torch.Tensor:
    return torch.empty(0, dtype=dtype).set_(r.base.untyped_storage(), offset, size, stride)


def _rebuild_ndarray(r: _Region, offset: int, dtype: Any, shape: tuple, strides: tuple) -> Any:
    import numpy as np

    return np.ndarray(shape, dtype=dtype, buffer=r.ba, offset=offset, strides=strides)


def _rebuild_object_array(shape: tuple, filled: list[tuple[int, Any]]) -> Any:
    import numpy as np

    a = np.empty(shape, dtype=object)
    flat = a.reshape(-1)  # a view: C-contiguous
    for i, v in filled:
        flat[i] = v
    return a


class _Unpickler(pickle.Unpickler):
    def __init__(self, f: io.BytesIO, shared: dict[int, Any]) -> None:
        super().__init__(f)
        self.shared = shared

    def persistent_load(self, pid: Any) -> Any:
        kind, x = pid
        return x.ba if kind == "bytearray" else self.shared[x]


def _rebuild_function(
    code: bytes, module: str, name: str, defaults: Any, kwdefaults: Any, cells: Optional[tuple]
) -> types.FunctionType:
    c = _CODE_LOADED.get(code)
    if c is None:
        c = _CODE_LOADED[code] = marshal.loads(code)
    f = types.FunctionType(
        c,
        sys.modules[module].__dict__,
        name,
        defaults,
        None if cells is None else tuple(types.CellType(x) for x in cells),
    )
    f.__kwdefaults__ = kwdefaults
    return f


class _Pickler(pickle.Pickler):
    def __init__(self, f: io.BytesIO, shared: dict[int, Any]) -> None:
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.shared = shared
        self.regions: list[_Region] = []
        self.by_value: list[tuple[int, int]] = []  # ndarrays copied by value: nothing else may view them

    def check_aliasing(self) -> None:
        for lo, hi in self.by_value:
            for r in self.regions:
                if lo < r.start + r.nbytes and r.start < hi:
                    raise CloneError(
                        "an ndarray that owns its memory is also viewed by a tensor or bytearray; "
                        "explore with mode='replay'"
                    )

    def _region(self, start: int, nbytes: int, data: Callable[[], bytes], what: str) -> tuple[_Region, int]:
        """The region holding [start, start + nbytes) and the offset into it; the first object seen defines it."""
        for r in self.regions:
            if r.start <= start and start + nbytes <= r.start + r.nbytes:
                return r, start - r.start
            if start < r.start + r.nbytes and r.start < start + nbytes:
                raise CloneError(f"{what} partly overlaps memory another object views; explore with mode='replay'")
        r = _Region(start, nbytes, data)
        self.regions.append(r)
        return r, 0

    def persistent_id(self, obj: Any) -> Any:
        # shared objects; and bytearrays, which never reach reducer_override (the C pickler saves them
        # directly): a tensor made with torch.frombuffer(bytearray) and the bytearray stay one block of memory
        if id(obj) in self.shared:
            return ("shared", id(obj))
        if type(obj) is not bytearray or not obj:
            return None
        import numpy as np

        start = np.frombuffer(obj, dtype=np.uint8).ctypes.data
        r, off = self._region(start, len(obj), functools.partial(bytes, obj), "a bytearray")
        if off or r.nbytes != len(obj):
            raise CloneError("a bytearray lies inside memory another object defined first")
        return ("bytearray", r)

    def reducer_override(self, obj: Any) -> Any:  # noqa: C901 - one branch per kind of object
        t = type(obj)
        if t is torch.Tensor:
            if obj.device.type != "cpu" or obj.requires_grad:
                raise CloneError(f"cannot copy a {obj.device} tensor (requires_grad={obj.requires_grad})")
            st = obj.untyped_storage()
            if st.nbytes() == 0:
                return (_empty_tensor, (obj.dtype, tuple(obj.size())))
            raw = torch.empty(0, dtype=torch.uint8).set_(st)
            r, off = self._region(st.data_ptr(), st.nbytes(), functools.partial(_tensor_bytes, raw), "a tensor")
            item = obj.element_size()
            if off % item:
                raise CloneError("a tensor views memory at an offset that is not a multiple of its element size")
            return (
                _rebuild_tensor,
                (r, off // item + obj.storage_offset(), obj.dtype, tuple(obj.size()), obj.stride()),
            )
        if t.__module__ == "numpy" and t.__name__ == "ndarray":
            root = obj
            while getattr(root, "base", None) is not None and type(root.base).__name__ == "ndarray":
                root = root.base
            base = root.base
            if (
                SPARSE_OBJECT_ARRAYS
                and base is None
                and obj.dtype.hasobject
                and obj.dtype.names is None
                and obj.flags.c_contiguous
            ):
                # an object array that owns its memory, by its filled slots only: the manager's stored-page
                # index keeps two 1024-slot rings of mostly None (2000 of a world's 3000 pickled objects)
                filled = [(i, v) for i, v in enumerate(obj.reshape(-1).tolist()) if v is not None]
                return (_rebuild_object_array, (obj.shape, filled))
            if base is None or obj.size == 0:
                if obj.size:
                    at = obj.__array_interface__["data"][0]
                    self.by_value.append((at, at + obj.nbytes))
                return NotImplemented  # owns its memory: copied by value
            start = obj.__array_interface__["data"][0]
            if isinstance(base, torch.Tensor) and base.device.type == "cpu" and base.untyped_storage().nbytes():
                st = base.untyped_storage()
                raw = torch.empty(0, dtype=torch.uint8).set_(st)
                r, off = self._region(st.data_ptr(), st.nbytes(), functools.partial(_tensor_bytes, raw), "a tensor")
            elif isinstance(base, bytearray) and base:
                import numpy as np

                at = np.frombuffer(base, dtype=np.uint8).ctypes.data
                r, off = self._region(at, len(base), functools.partial(bytes, base), "a bytearray")
            else:
                return NotImplemented  # a view of memory nothing else here shares: copied by value
            return (_rebuild_ndarray, (r, start - r.start, obj.dtype, obj.shape, obj.strides))
        if t is types.FunctionType:
            if obj.__closure__ is None and getattr(sys.modules.get(obj.__module__), obj.__qualname__, None) is obj:
                return NotImplemented  # importable: pickled by reference
            # a closure or a lambda: its code by value, its module by name, its cells copied
            module = obj.__globals__.get("__name__")
            if getattr(sys.modules.get(module), "__dict__", None) is not obj.__globals__:
                raise CloneError(f"cannot copy function {obj.__qualname__}: its globals are no module's")
            code = _CODE.get(id(obj.__code__))
            if code is None:
                code = _CODE[id(obj.__code__)] = (obj.__code__, marshal.dumps(obj.__code__))
            cells = None if obj.__closure__ is None else tuple(c.cell_contents for c in obj.__closure__)
            return (_rebuild_function, (code[1], module, obj.__name__, obj.__defaults__, obj.__kwdefaults__, cells))
        if t is weakref.ReferenceType or t is weakref.KeyedRef:
            return (weakref.ref, (obj(),))  # the callback is re-made by _fix_records
        if t in _LOCKS:
            return (_LOCKS[t], ())
        if t is itertools.count:
            match = _COUNT_RE.fullmatch(repr(obj))
            if match:
                return (itertools.count, (int(match.group(1)),))
        if t is threading.Thread or t is types.GeneratorType:
            raise CloneError(f"cannot copy a {t.__name__}; explore with mode='replay'")
        return NotImplemented


def _empty_tensor(dtype: torch.dtype, size: tuple) -> torch.Tensor:
    return torch.empty(size, dtype=dtype)


class Snapshot:
    """A world pickled once, thawed into any number of independent copies. The search expands a state by
    thawing one copy per child: pickling is 3/4 of a clone's cost (0.50 of 0.70 ms at the default bound,
    bench/explorer_speed.py), so it is paid once per state instead of once per child."""

    __slots__ = ("data", "shared")

    def __init__(self, w: World) -> None:
        # immutable: the configs, and the pages in the in-memory store (it copies pages in and out)
        store = w.engine.store
        assert store is not None  # the explorer's engine keeps its in-memory store
        self.shared = {id(o): o for o in (w.config, w.engine.config, w.engine.kv, *store.pages.values())}
        buf = io.BytesIO()
        pickler = _Pickler(buf, self.shared)
        pickler.dump(w)
        pickler.check_aliasing()
        self.data = buf.getvalue()

    def thaw(self) -> World:
        """An independent copy of the world as it was when the snapshot was taken."""
        new = _Unpickler(io.BytesIO(self.data), self.shared).load()
        _fix_records(new)
        return new


def clone(w: World) -> World:
    """An independent copy of a world (engine, pools, manager, requests, pending copies and backups)."""
    return Snapshot(w).thaw()


def _fix_records(w: World) -> None:
    """The manager keys its records by id(request): re-key them by the copied request objects."""
    records = w.engine.manager._records
    forget = functools.partial(_forget, records)
    fixed = {}
    for rec in records.values():
        req = rec.req_ref()
        if req is None:
            continue
        key = id(req)
        rec.req_ref = weakref.KeyedRef(req, forget, key)
        fixed[key] = rec
    records.clear()
    records.update(fixed)
