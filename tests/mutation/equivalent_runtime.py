"""Equivalent survivors of `make mutate` in the runtime modules, and why (merged into equivalent.EQUIVALENT)."""

from __future__ import annotations

from equivalent_helpers import _def, _lines  # noqa: F401

EQUIVALENT: list[tuple[str, str, str]] = [
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
        r"- int\(lens\.sum\(\)\), dtype=np\.int64\)\n\+ int\(lens\.sum\(\)\), (dtype=None)?\)",
        "np.arange of a Python int is int64 whether or not the dtype is given",
    ),
    (
        "xǁDeviceTableSlotsǁspans",
        r'- if self\.device\.type == "cuda":\n\+ if self\.device\.type == "(XXcudaXX|CUDA)":',
        "not told apart on a CPU-only host, where the table's device is the CPU and the upload branch is skipped either "
        "way (a GPU run of tests/upstream/test_adapter_gpu.py sees the difference)",
    ),
    (
        "xǁDeviceTableSlotsǁspans",
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
        "xǁDecodeOffloadManagerǁ_admit",
        _lines(
            "else self.fx.device_table.span(row, 0, rec.prefix_len).tolist())",
            "else self.fx.device_table.span(row, None, rec.prefix_len).tolist())",
        ),
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
