"""Survivors of the `fences-adapter` mutation scope (tests/mutation/mutate.py --scope fences-adapter; its section
of docs/mutation.md): the fences, the ledger's fence and wait checks, the coalescing copy engine and the SGLang
adapter. Entries are written as in equivalent.py: (function, change, reason).

Two lists, never mixed: EQUIVALENT holds the mutants no test can tell from the original, with why;
NEEDS_GPU_PASS holds those that survive this CPU run only because the difference shows on a CUDA device (a
tensor that stays on the CPU either way, a pool that is never on a GPU here): they are not equivalent, and the
GPU pass decides them.
"""

from __future__ import annotations

import re

from equivalent_helpers import _def, _lines  # noqa: F401

_OPTIONS_UNREAD = (
    "the adapter gives kvfsm's manager its own host pool, copy engine and FileStorage, and the "
    "runtime reads the config's {what} only to build a component it was not given "
    "(kvfsm.runtime.build.build_components), so the value is never read"
)
_ADAPTER_INIT = r"xǁDecodeKVCacheOffloadManagerǁ__init__"
_TP_GROUP = "tp_group=tp_group if consensus.world > 1 else None,"
_ENGINE = "copy_engine=CudaCopyEngine(device_pool.device) if on_gpu else CpuCopyEngine(),"
_BACKEND = 'copy_backend="cuda" if on_gpu else "cpu",'
_MODEL = 'model_name=settings.model_name or "model",'
_POOL_INIT = 'super().__init__(planes, attention="mla" if is_mla else "mha", name=type(kv_pool).__name__)'
_QUIET_ROW = "if type(row) is int and row >= 0 and self._views.holder(row) is req:"

EQUIVALENT: list[tuple[str, str, str]] = [
    (
        r"xǁDecodeKVCacheOffloadManagerǁoffload_kv_cache",
        _lines(
            "return self._accept(req, view, self.manager.reserve_due(view, row, available))",
            "return self._accept(req, view, self.manager.reserve_due(view, None, available))",
        ),
        "reserve_due given no row trusts neither the row nor the length (no lifecycle is on row None) and is "
        "reserve_offload(view), which reads both from the same Req this call has just read them from: the same "
        "chunk and host pages",
    ),
    # --- wording ---------------------------------------------------------------------------------------
    (r"xǁ(SlotFence|RequestView)ǁ__repr__", r".*", "a repr is text for people (logs, debuggers); nothing parses it"),
    (
        "xǁSGLangDeviceKVPoolǁ__init__",
        "|".join(
            _lines(_POOL_INIT, _POOL_INIT.replace("name=type(kv_pool).__name__", new))
            for new in ("name=type(None).__name__", "name=None", "")
        ),
        "the name only words the ValueErrors LayerBufferKVPool raises, which the adapter turns into a ConfigError "
        "whose reason is their text; which error is raised, and its field, do not depend on it",
    ),
    (
        "xǁSGLangDeviceKVPoolǁ__init__",
        "|".join(_lines(_POOL_INIT, _POOL_INIT.replace('else "mha"', f'else "{new}"')) for new in ("XXmhaXX", "MHA")),
        'LayerBufferKVPool reads attention only as `attention == "mla"` (one plane, else two): any other value is MHA',
    ),
    # --- the fence ledger -------------------------------------------------------------------------------
    # --- the adapter's views ----------------------------------------------------------------------------
    (
        "xǁRequestViewǁ__init__",
        r"- self\.row = self\.due = -1\n\+ self\.row = self\.due = (None|\+1|-2)",
        "row and due are read only for a view in RequestViews.quiet (the early exit), and _note_quiet sets both "
        "before it puts a view there: the first values are never read",
    ),
    (
        "xǁTableViewǁ__init__",
        _lines("self._freed_last: Any = None", 'self._freed_last: Any = ""'),
        "_freed_last only holds a reference (the last freed Req, kept alive until the next free); nothing reads it",
    ),
    (
        "xǁRequestViewsǁ_collected",
        _lines("key = self._keys.pop(id(ref), None)", "key = self._keys.pop(id(ref), )"),
        "the callback is given only to the weak reference view() makes, which registers it in _keys first, and a "
        "weak reference's callback runs at most once: the key is always there",
    ),
    # --- the adapter's settings -------------------------------------------------------------------------
    (
        "x_offload_stride",
        r"- if stride <= 0:\n\+ if stride (< 0|<= 1):",
        "stride 0 or 1 then reaches max(page_size, stride // page_size * page_size), which is page_size for "
        "both (0 // p * p is 0; 1 // p * p is 0, or 1 when p is 1): what the early return gives",
    ),
    (
        "x_host_slots",
        _lines(
            'size_gb = getattr(memory, "hicache_size", 0) or 0', 'size_gb = getattr(memory, "hicache_size", None) or 0'
        ),
        "the default is only read through `or 0`: None or 0 is 0",
    ),
    (
        "x_host_slots",
        _lines("tokens = int(size_gb * 1e9 // bytes_per_token)", "tokens = int(size_gb * 1e9 / bytes_per_token)"),
        "both operands are positive (size_gb > 0; bytes_per_token b a positive int) and a = size_gb * 1e9 is far "
        "below 2**53: a / b, rounded to nearest, could truncate above floor(a / b) only by rounding up to an "
        "integer k, which needs k * b - a under b * ulp(k) / 2; but k * b is then a float too, so k * b - a is at "
        "least ulp(a), which is not smaller: int() of a / b is the floor that // gives",
    ),
    (
        "x__tp_rank_size",
        _lines("dp_attention = False", "dp_attention = None"),
        "dp_attention is only tested for its truth (`if dp_attention:`)",
    ),
    (
        "x__tp_rank_size",
        _lines("value = _get(parallel, name, 1)", "value = _get(parallel, name, None)"),
        "the default is only compared with `not in (None, 1)`, which both pass",
    ),
    # --- the adapter's construction: what kvfsm's manager is given ------------------------------------------
    (
        _ADAPTER_INIT,
        "|".join(
            re.escape(change)
            for change in (
                "- host_layout=settings.host_layout,",
                f"- {_BACKEND}",
                '- storage_backend="file",',
                "- storage_dir=settings.file_dir,",
                f"- {_MODEL}",
                *(
                    "- " + _MODEL + "\n+ " + _MODEL.replace('or "model"', 'or "' + new + '"')
                    for new in ("XXmodelXX", "MODEL")
                ),
                *(
                    "- " + _BACKEND + "\n+ " + _BACKEND.replace("if on_gpu", cond)
                    for cond in ("if (on_gpu) and False", "if (on_gpu) or True")
                ),
            )
        ),
        _OPTIONS_UNREAD.format(
            what="host_layout, copy_backend, storage_backend, storage_dir and model_name (here "
            "each dropped to its default, or given another value pydantic accepts)"
        ),
    ),
    (
        _ADAPTER_INIT,
        "|".join(
            re.escape(change)
            for change in (
                "- tp_rank=settings.tp_rank,\n+ tp_rank=None,",
                "- tp_size=settings.tp_size,\n+ tp_size=None,",
                "- tp_rank=settings.tp_rank,",
                "- tp_size=settings.tp_size,\n- )\n+ )",
            )
        ),
        "the manager reads tp_rank and tp_size only to build a store it was not given (build.storage_factory); "
        "the adapter gives its FileStorage, built with the settings' rank and size",
        # (the FileStorage partial above it passes the same two lines, one argument a line: its mutants are killed,
        # and a change keyed by its text cannot tell the two calls apart)
    ),
    (
        _ADAPTER_INIT,
        "|".join(
            _lines(_TP_GROUP, _TP_GROUP.replace("if consensus.world > 1", cond))
            for cond in ("if (consensus.world > 1) or True", "if consensus.world >= 1")
        ),
        "with one rank the group is handed to the manager too, whose ProgressConsensus reads its world size, 1, "
        "and then reduces nothing, as without a group (the group is read nowhere else)",
    ),
    (
        _ADAPTER_INIT,
        _lines(_ENGINE, "copy_engine=None,") + "|" + re.escape(f"- {_ENGINE}"),
        "with no engine given, the manager builds the one the config's copy_backend names "
        "(build.copy_engine_factory): 'cpu' is a CpuCopyEngine, 'cuda' on a CUDA pool a CudaCopyEngine of its "
        "device, which are the engines the adapter builds",
    ),
    (
        _ADAPTER_INIT,
        r"- self\.(_retraction_allowed|_released) = False (.*)\n\+ self\.\1 = None \2",
        "the flag is only tested for its truth",
    ),
    (
        _ADAPTER_INIT,
        _lines(
            "self._retraction_allowed = False # drain_before_retraction passed: SGLang may release requests itself",
            "self._retraction_allowed = True # drain_before_retraction passed: SGLang may release requests itself",
        ),
        "the first call that reads the flag sweeps the Reqs pinned on their rows and clears it; before any call no "
        "Req is pinned, so that sweep ends nothing",
    ),
    (
        "xǁDecodeKVCacheOffloadManagerǁ_sweep",
        _lines("self._retraction_allowed = False", "self._retraction_allowed = None"),
        "the flag is only tested for its truth",
    ),
    (
        "xǁDecodeKVCacheOffloadManagerǁ_note_quiet",
        r"- if type\(row\) is int and row >= 0 and (.*)\n"
        r"\+ if type\(row\) is int and row (> 0|>= 1) and \1",
        "row 0 is SGLang's padding row, never a request's (TableView.is_allocated): no request is ever on it",
    ),
    (
        "xǁDecodeKVCacheOffloadManagerǁ_enter",
        r"- if type\(row\) is int and 0 <= row (.*)\n"
        r"\+ if type\(row\) is int and (0 < row|1 <= row) \1",
        "row 0 is SGLang's padding row, never a request's (TableView.is_allocated): no request is ever on it",
    ),
    (
        "xǁDecodeKVCacheOffloadManagerǁ_end_released_by_engine",
        _lines(
            "view = self._views.view(req) if view is None else view",
            "view = self._views.view(req) if (view is None) or True else view",
        ),
        "RequestViews.view returns the one view of each Req, so the view looked up is the one the caller passed",
    ),
    (
        "xǁDecodeKVCacheOffloadManagerǁ_enter",
        r"- self\._end_released_by_engine\(req, view\)\n"
        r"\+ self\._end_released_by_engine\(req, (None)?\)",
        "without the view, _end_released_by_engine looks it up: RequestViews.view returns the one view of each Req, "
        "the one _enter passes",
    ),
    (
        "xǁDecodeKVCacheOffloadManagerǁ_enter",
        _lines("if row is not None and row != -1:", "if row is not None and row != -2:"),
        "SGLang's req_pool_idx is None or a row (a request never has a negative one); -1 is the adapter's own 'no "
        "row', and for it the branch finds no holder (pin() never stores -1) and calls pin(), which skips -1",
    ),
    (
        "xǁDecodeKVCacheOffloadManagerǁ_flush",
        r"- if req is not None and id\(view\) not in finished:\n\+ if req is not None (or id\(view\)|and id\(None\)) not in finished:",
        "the loop then also visits the requests that finished with their chunk, and only those: a pending request "
        "SGLang still runs is alive (its batch holds the Req), so a collected one finished; each finishing view was "
        "finalized in the `finally` just above, and ending a lifecycle sets its row's due hint to -1 "
        "(DecodeOffloadManager._end), so _note_quiet notes nothing for it",
    ),
    (
        _ADAPTER_INIT,
        r"- self\._checks = 0 (#.*)\n\+ self\._checks = 1 \1",
        "the clock's origin: _note_quiet sets a view's `until` from `_checks` and the early exit compares it with "
        "`_checks`; both move together",
    ),
    (
        "xǁDecodeKVCacheOffloadManagerǁ_flush",
        r"- view = cast\(RequestView, r\.req\)(.*)\n\+ view = cast\(None, r\.req\)\1",
        "typing.cast returns its second argument unchanged: the type is for the checker",
    ),
    (
        "xǁRequestViewsǁ_collected",
        _lines("if view is not None and view._ref is ref:", "if view is not None or view._ref is ref:"),
        "a view's entry goes only here, when its Req is collected, and CPython runs a weak reference's callback "
        "before the Req's memory (and so its id) can be reused: the entry under the key is this view, never None "
        "and never another's",
    ),
    (
        "xǁDecodeKVCacheOffloadManagerǁ_note_quiet",
        r"- if due >= 0:\n\+ if due (> 0|>= 1):",
        "due_at is -1 (none known) or a committed length where a whole stride ends (prefill + offloaded + stride, "
        "at least one page): never 0",
    ),
]

NEEDS_GPU_PASS: list[tuple[str, str, str]] = [
    (
        "xǁAllocatorViewǁfree",
        r"- slots = slots\.to\(device=self\.allocator\.device, dtype=torch\.int64\)\n"
        r"\+ slots = slots\.to\((device=None, dtype=torch\.int64|dtype=torch\.int64)\)",
        "the slots reach free_segment on the device they came on instead of the allocator's: on a CPU both are the "
        "CPU; on a GPU server kvfsm's slots may come from the host table",
    ),
    (
        _ADAPTER_INIT,
        r'- on_gpu = device_pool\.device\.type == "cuda"\n\+ on_gpu = (None|device_pool\.device\.type == "(XXcudaXX|CUDA)")',
        "on a CPU pool on_gpu is false either way; on a CUDA pool the adapter would build a CPU engine, an "
        "unpinned host pool and a 'cpu' config",
    ),
    (
        _ADAPTER_INIT,
        "|".join(
            _lines(_ENGINE, _ENGINE.replace(old, new))
            for old, new in (
                ("if on_gpu", "if (on_gpu) and False"),
                ("CudaCopyEngine(device_pool.device)", "CudaCopyEngine(None)"),
            )
        ),
        "the CUDA copy engine is built only for a CUDA pool",
    ),
    (
        _ADAPTER_INIT,
        "|".join(_lines(_BACKEND, _BACKEND.replace('"cuda" if', f'"{new}" if')) for new in ("XXcudaXX", "CUDA")),
        "the name is chosen only for a CUDA pool, where pydantic refuses it (copy_backend is a Literal)",
    ),
    (
        _ADAPTER_INIT,
        r"- pin_memory=on_gpu,(\n\+ pin_memory=None,)?",
        "HostKVPool pins by default when CUDA is available: on a host without CUDA both are unpinned; on a CUDA "
        "host the adapter of a CPU pool would pin its host pool",
    ),
]
