"""Equivalent survivors of `make mutate` in the runtime manager (kvfsm/runtime/manager.py and the lifecycles, offloading,
progress and ending modules it is composed of), and why (merged into equivalent.EQUIVALENT)."""

from __future__ import annotations

from equivalent_helpers import _def, _lines  # noqa: F401

EQUIVALENT: list[tuple[str, str, str]] = [
    # --- manager: a one-page host run, and offload_batch's admission ----------------------------------------
    (
        "xǁOffloadingǁ_submit",
        r"- host_run = range\(pages\[first\], pages\[first\] \+ 1\) if n == ps else tuple\(pages\[first : end // ps\]\)\n"
        r"\+ host_run = range\(pages\[first\], pages\[first\] \+ 1\) if \(n == ps\) and False else "
        r"tuple\(pages\[first : end // ps\]\)",
        "with n == ps the chunk is one page, and the slice pages[first : end // ps] is that one page: (p,) and "
        "range(p, p + 1) are the same sequence of host pages to every reader (the range only spares a slice)",
    ),
    (
        "xǁOffloadingǁoffload_batch",
        r"- rec = self\._admit\(req, row\)\n\+ rec = self\._admit\(req, (None)?\)",
        "_admit given no row makes the admissibility check itself, which returns the row the check above returned: "
        "nothing changed in between for this request, and the rows this loop admits are distinct (new_rows)",
    ),
    # --- manager: typing.cast ---------------------------------------------------------------------------
    (
        "xǁLifecyclesǁ_admit|xǁOffloadingǁoffload_batch",
        r"- (live|looked) = cast\((LiveRecord|\"list\[tuple\[LiveRecord, OffloadRequest, int\]\]\"), "
        r"(rec|todo)\)( # .*)?\n"
        r"\+ \1 = cast\((None|\"XXlist\[tuple\[LiveRecord, OffloadRequest, int\]\]XX\"|"
        r"\"list\[tuple\[liverecord, offloadrequest, int\]\]\"|"
        r"\"LIST\[TUPLE\[LIVERECORD, OFFLOADREQUEST, INT\]\]\"), \3\)\4",
        "typing.cast returns its second argument unchanged at run time whatever the first (it only informs the "
        "type checker): the same object is bound either way",
    ),
    # --- manager: the host PageSlots of _copy_slots' whole-page path --------------------------------------
    (
        "xǁOffloadingǁ_copy_slots",
        r"- return device, PageSlots\(host_pool\.allocator, host_pages, "
        r"torch\.from_numpy\(both\[count:\]\.reshape\(-1\)\)\)\n"
        r"\+ return device, PageSlots\(host_pool\.allocator, host_pages, (None)?\)",
        "a PageSlots given no slots builds them on first use as torch.from_numpy(allocator.slots_of(pages)); the "
        "host pool's allocator is always its own TokenSlotAllocator, whose page size build_components checks is "
        "config.page_size, and slots_of is np.add.outer(pages * ps, arange(ps)).reshape(-1): the same int64 CPU "
        "values both[count:] holds (starts there are p * ps for the host pages, plus the same _page_offsets). The "
        "token-by-token path already builds its host PageSlots that way (host_pool.page_slots)",
    ),
    # --- manager: due_at's bound ---------------------------------------------------------------------------
    (
        "xǁOffloadingǁdue_at",
        _lines(
            "return int(self._due_at[row]) if 0 <= row < self._rows else -1",
            "return int(self._due_at[row]) if 0 <= row <= self._rows else -1",
        ),
        "the only row the mutant adds is row == rows, which reads _due_at[rows], the sentinel entry (the array has "
        "rows + 1 entries) that stays -1 forever: every write of _due_at indexes rec.row of an admitted record, "
        "which _check_admissible holds to [0, rows); so -1 either way",
    ),
    # --- manager: offload_batch's placeholder for the request the except clauses name -----------------------
    (
        "xǁOffloadingǁoffload_batch",
        _lines(
            "req: Optional[OffloadRequest] = None # the request the except clauses below name (None: none read yet)",
            'req: Optional[OffloadRequest] = "" # the request the except clauses below name (None: none read yet)',
        ),
        "req is bound by the first statement of the loop (req = reqs[i]); the except clauses see the placeholder "
        "only when indexing the batch itself raises (a batch that is not a sequence, a set say). Then, from None "
        "or from '', check_request_fields/check_request_lengths fail the same way on an object with no request "
        "field: raise_if_field_missing raises RequestFieldMissing for 'rid' (differing only in describe()'s "
        "words, '<NoneType object>' vs '<str object>'), raise_if_length_invalid an AttributeError for "
        "'kv_committed_len' (differing only in the type named in its message)",
    ),
]
