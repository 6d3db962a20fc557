"""Equivalent survivors of `make mutate` in the runtime modules, and why (merged into equivalent.EQUIVALENT)."""

from __future__ import annotations

from equivalent_helpers import _def, _lines  # noqa: F401

EQUIVALENT: list[tuple[str, str, str]] = [
    # --- the stored-page index's batch write (put_many) and growth -----------------------------------------
    (
        "xǁStoredPageIndexǁput_many",
        _lines("if n > size:", "if n >= size:"),
        "put_many is put for each triple in order; a batch of exactly the ring's size going put by put instead of "
        "through the batched writes records the same entries, drops and ages (the batched path only makes the "
        "ring's writes as numpy assignments)",
    ),
    (
        "xǁStoredPageIndexǁput_many",
        r"- droppable = (.*) if nxt - first \+ n > size else \[\]\n"
        r"\+ droppable = \1 if (\(nxt - first \+ n > size\) or True|nxt \+ first \+ n > size|nxt - first \+ n >= size) "
        r"else \[\]",
        "droppable is read only when the ring is full at the limit (nxt - first == size), which implies the original "
        "condition; each mutant computes it in more cases (first >= 0), always the same oldest hashes, never read then",
    ),
    (
        "xǁStoredPageIndexǁput_many",
        r"- while self\._next - self\._first \+ n > self\._hash\.size < self\.limit:\n"
        r"\+ while self\._next (\+ self\._first \+ n >|- self\._first \+ n >=) self\._hash\.size < self\.limit:",
        "the ring then grows in more cases, never past the limit: its capacity differs, never its entries, their "
        "order or what is dropped (a drop happens only when the ring is full at the limit)",
    ),
    (
        "xǁStoredPageIndexǁput_many",
        _lines(
            "slots = np.fromiter(writes, dtype=np.int64, count=len(writes))",
            "slots = np.fromiter(writes, dtype=np.int64, )",
        ),
        "count only lets numpy allocate the array once; the dict's keys make the same array without it",
    ),
    (
        "xǁStoredPageIndexǁ_grow",
        r"- seqs = np\.arange\(self\._first, self\._next, dtype=np\.int64\)\n"
        r"\+ seqs = np\.arange\(self\._first, self\._next, (dtype=None)?\)",
        "np.arange of two Python ints is int64 whether or not the dtype is given",
    ),
    (
        "xǁStoredPageIndexǁ_grow",
        r"- seqs = np\.arange\(self\._first, self\._next, dtype=np\.int64\)\n"
        r"\+ seqs = np\.arange\(self\._next, dtype=np\.int64\)",
        "the ring grows only below its limit and drops an entry only at it (put, put_many), so _first is 0 whenever "
        "_grow runs and arange(_next) is arange(_first, _next)",
    ),
    # --- the release by page id ------------------------------------------------------------------------------
    (
        "xǁOffloadEffectsǁ__init__",
        _lines(
            'self._frees_page_ids = bool(getattr(allocator, "frees_page_ids", False))',
            'self._frees_page_ids = bool(getattr(allocator, "frees_page_ids", None))',
        ),
        "an allocator with no frees_page_ids gets bool(None), False as bool(False) is",
    ),
    (
        "xǁOffloadEffectsǁ_release",
        r"- slots_freed = len\(pages\) \* self\.page_size\n\+ slots_freed = (None|len\(pages\) / self\.page_size)",
        "slots_freed is read only by the DEBUG log line's count of freed slots, text for people",
    ),
    (
        "xǁDeviceTableSlotsǁpage_ids_many",
        r"- out = torch\.empty\(total, dtype=torch\.int64, device=self\.device\)\n"
        r"\+ out = torch\.empty\(total, dtype=torch\.int64, (device=None)?\)",
        "not told apart on a CPU-only host: a tensor made with no device is on the CPU, the table's own device there "
        "(a table on CUDA would get a CPU output, which torch.div's out= refuses)",
    ),
    (
        "xǁDeviceTableSlotsǁpage_ids_many",
        r"- (flat = .*) \+ np\.arange\(total, dtype=np\.int64\) \* ps\n\+ \1 \+ np\.arange\(total, (dtype=None)?\) \* ps",
        "np.arange of a Python int is int64 whether or not the dtype is given",
    ),
    (
        "xǁOffloadEffectsǁrelease_request_each",
        r"- self\._release_row\(rec, None, (.*)\)\n\+ self\._release_row\(rec, None, .*\)",
        "the count of freed slots reaches only _release_row's DEBUG log line, text for people",
    ),
    (
        "xǁOffloadEffectsǁ_release",
        r"- self\._release_row\(rec, fence, slots_freed\)\n\+ self\._release_row\(rec, None, slots_freed\)",
        "the fence reaches _release_row only for its DEBUG log line (the frees that need it are made before)",
    ),
    (
        "xǁOffloadEffectsǁrelease_request_each",
        r"- if newest_first is None or self\.ledger is not None or len\(items\) < 2 or unlock_frees:\n"
        r"\+ if newest_first is None or self\.ledger is not None (and len\(items\) < 2|or len\(items\) (<= 2|< 3)) or unlock_frees:",
        "a batch event is never given a ledger's effects (checked mode observes every machine, and the generated batch "
        "events then run item by item, calling the single action); a batch of two released one at a time frees the "
        "same pages in the same order as the one free that lays them out so, only with one call more",
    ),
    (
        "xǁOffloadEffectsǁrelease_request_each",
        r"- (slots = np\.concatenate\(parts\) if) (isinstance\(parts\[0\], np\.ndarray\)) (else torch\.cat\(parts\).*)\n"
        r"\+ \1 \(\2\) or True \3",
        "not told apart on a CPU-only host: a release reads its slots as tensors only from a table with no host mirror, "
        "which numpy concatenates as well while they are on the CPU (on a CUDA table it would refuse them)",
    ),
    (
        "xǁOffloadEffectsǁrelease_request_each",
        r"- self\.release_request\(m, arg\)(.*)\n\+ self\.release_request\(m, None\)\1",
        "release_request reads only its machine (a copy_done's chunk or a finish's None, never used)",
    ),
    (
        "xǁDeviceTableSlotsǁpage_ids",
        r"- out = torch\.empty\(firsts\.shape\[0\], dtype=torch\.int64, device=self\.device\)\n"
        r"\+ out = torch\.empty\(firsts\.shape\[0\], dtype=torch\.int64, (device=None)?\)",
        "not told apart on a CPU-only host: a tensor made with no device is on the CPU, the table's own device there "
        "(a table on CUDA would get a CPU output, which torch.div's out= refuses)",
    ),
    # --- the FIFO's index of copies (copies_reading): a cache --------------------------------------------------
    (
        "xǁOffloadEffectsǁcopies_reading",
        r"- (if index is None or index\[0\] != fifo\[0\]\.serial or index\[1\] != fifo\[-1\]\.serial:|"
        r"index = self\._fifo_index)\n"
        r"\+ (if index is None or index\[0\] != fifo\[0\]\.serial or index\[2\] != fifo\[-1\]\.serial:|index = None)",
        "the index is a cache of the FIFO: each mutant rebuilds it on every call (index[2] is the list of calls, "
        "never equal to a serial), from the same FIFO, so it answers the same handles",
    ),
    (
        "xǁOffloadEffectsǁcopies_reading",
        r"- (handle: Optional\[CopyHandle\] = None|records: set\[RequestRecord\] = set\(\))\n"
        r"\+ (handle: Optional\[CopyHandle\] = \"\"|records: set\[RequestRecord\] = None)",
        "the first chunk of the FIFO always starts a call of its own: every chunk in it has the handle of the copy "
        "that started it (start_copy_each sets it), never None or '', so the initial handle and set are replaced "
        "before any record is added",
    ),
    # --- device_table: dtypes numpy and torch give anyway, and the CUDA upload --------------------------
    (
        "xǁDeviceTableSlotsǁ__init__",
        r"- self\._page_offsets = torch\.arange\(self\.page_size, dtype=torch\.int64, device=self\.device\)\n"
        r"\+ self\._page_offsets = torch\.arange\(self\.page_size, (dtype=None, )?device=self\.device\)",
        "torch.arange of a Python int is int64 whether or not the dtype is given",
    ),
    (
        "xǁDeviceTableSlotsǁ__init__",
        r"- self\._page_offsets = torch\.arange\(self\.page_size, dtype=torch\.int64, device=self\.device\)\n"
        r"\+ self\._page_offsets = torch\.arange\(self\.page_size, dtype=torch\.int64, (device=None)?\)",
        "not told apart on a CPU-only host, where every table that can be read (and so self.device) is on the CPU, "
        "torch's default device (a GPU run of tests/upstream/test_adapter_gpu.py sees the difference)",
    ),
    (
        "xǁDeviceTableSlotsǁspans",
        r"- lens = np\.asarray\(lengths, dtype=np\.int64\)\n\+ lens = np\.asarray\(lengths, (dtype=None)?\)",
        "the lengths are integers (the manager passes a list of Python ints, which numpy makes int64 anyway); an "
        "integer array of another width gives the same repeats and positions (np.cumsum widens small integers to int64)",
    ),
    (
        "xǁDeviceTableSlotsǁspans",
        r"- flat = np\.repeat\(np\.asarray\(firsts, dtype=np\.int64\) (.*)\n\+ flat = np\.repeat\(np\.asarray\(firsts, (dtype=None)?\) \1",
        "the firsts are integers (the manager passes a list of Python ints, which numpy makes int64 anyway); "
        "subtracting the int64 cumsum makes any integer width int64 with the same positions",
    ),
    (
        "xǁDeviceTableSlotsǁspans",
        r"- int\(lens\.sum\(\)\), dtype=np\.int64\n(\+ int\(lens\.sum\(\)\), dtype=None|- \)\n\+ int\(lens\.sum\(\)\), \))",
        "np.arange of a Python int is int64 whether or not the dtype is given",
    ),
    (
        "xǁDeviceTableSlotsǁ_uploaded",
        r'- if self\.device\.type == "cuda":\n\+ if self\.device\.type == "(XXcudaXX|CUDA)":',
        "not told apart on a CPU-only host, where the table's device is the CPU and the upload branch is skipped either "
        "way (a GPU run of tests/upstream/test_adapter_gpu.py sees the difference)",
    ),
    (
        "xǁDeviceTableSlotsǁ_uploaded",
        r"- positions = positions\.pin_memory\(\)\.to\(self\.device, non_blocking=True\) # pageable would sync\n"
        r"\+ positions = .* # pageable would sync",
        "the upload of the positions to a CUDA table runs only on a CUDA host: on a CPU-only host the branch is never "
        "taken (a GPU run of tests/upstream/test_adapter_gpu.py sees the difference)",
    ),
    (
        "xǁDeviceTableSlotsǁwhole_pages",
        _lines(
            "starts = self.table[row, start:end:ps].to(torch.int64)", "starts = self.table[row, start:end:ps].to(None)"
        ),
        "starts keep the table's integer dtype, and adding the int64 _page_offsets promotes the result to int64 "
        "with the same values",
    ),
    # --- effects -------------------------------------------------------------------------------------
    (
        "xǁOffloadEffectsǁ__init__",
        _lines(
            "self.device_table: Optional[DeviceTableSlots] = None # set by the manager when there is no mirror",
            'self.device_table: Optional[DeviceTableSlots] = "" # set by the manager when there is no mirror',
        ),
        "the manager, OffloadEffects' only constructor, sets device_table (None or a DeviceTableSlots) right after "
        "building it, before any action runs",
    ),
    (
        "xǁOffloadEffectsǁrecord_engine_release",
        r'- rec\.(lock|req) = None\n\+ rec\.\1 = ""',
        "released_by_engine ends the lifecycle (released, or draining to released), whose remaining actions "
        "(mark_stored, free_host_chunk, count_backup_failure) never read rec.lock or rec.req; '' holds no "
        "reference, as None",
    ),
    (
        "xǁOffloadEffectsǁrecord_engine_release",
        r'- self\.ledger\.release_owned\(rec\.key, "released_by_engine"\)\n'
        r'\+ self\.ledger\.release_owned\(rec\.key, (None|"XXreleased_by_engineXX"|"RELEASED_BY_ENGINE")\)',
        "the event reaches only a CheckedModeError that release_owned cannot raise here: the spec takes "
        "released_by_engine only in allocated and inflight, where no copy reads the request's pages (B2), and the "
        "pages it frees are the request's own, claimed since any earlier release (no B9, B16)",
    ),
    # --- ledger: wording ---------------------------------------------------------------------------
    (
        "xǁSlotLedgerǁclaim_device",
        r'- whose = "the prefix cache \(a matched prefix\)" if other == PREFIX_CACHE else f"live request \{other\}"\n\+ .*',
        "the words that name the other owner in the B1 error's message; the error and its fields are the same",
    ),
    # --- manager -----------------------------------------------------------------------------------
    (
        "xǁDecodeOffloadManagerǁ__init__",
        _lines(
            "self._width = int((table if table is not None else req_to_token.req_to_token).shape[1])",
            "self._width = int((table if (table is not None) and False else req_to_token.req_to_token).shape[1])",
        ),
        "a request table's host mirror has the table's shape (ReqToTokenPool's is zeros_like it, the SGLang "
        "adapter's is the table itself), so the width read from either is the same",
    ),
    (
        "xǁLifecyclesǁ_admit",
        r"- else self\.fx\.device_table\.span\(row, 0, rec\.prefix_len\)\.tolist\(\),(.*)\n"
        r"\+ else self\.fx\.device_table\.span\(row, None, rec\.prefix_len\)\.tolist\(\),\1",
        "span slices the row from `start`, and a slice from None starts at 0",
    ),
    # --- protocols ---------------------------------------------------------------------------------
    (
        "xǁSimplePrefixCacheǁlock",
        r"- slots = torch\.as_tensor\(slots, dtype=torch\.int64\)(.*)\n\+ slots = torch\.as_tensor\(slots, (dtype=None)?\)\1",
        "a lock's slots are integers (a table row, or Python ints, which torch makes int64 anyway) used only "
        "through numel() and int(): counts, pages and evictions are the same in any integer dtype",
    ),
    (
        "xǁSimplePrefixCacheǁunlock",
        r"- self\.allocator\.free\(torch\.tensor\((.*)\], dtype=torch\.int64\)\)\n\+ self\.allocator\.free\(torch\.tensor\(\1\], (dtype=None)?\)\)",
        "torch.tensor of a (non-empty) list of Python ints is int64 whether or not the dtype is given",
    ),
    # --- tp ----------------------------------------------------------------------------------------
    (
        "xǁProgressConsensusǁany",
        _lines("if self.world <= 1:", "if self.world < 1:"),
        "world is at least 1; on one rank agree() is the identity, so -(-flag) > 0 is the flag the fast path returns",
    ),
]
