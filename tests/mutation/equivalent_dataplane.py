"""Equivalent survivors of `make mutate` in the dataplane modules, and why (merged into equivalent.EQUIVALENT)."""

from __future__ import annotations

from equivalent_helpers import _def, _lines  # noqa: F401

_NS_ARGS = r'\(\("extra_key", extra_key\), \("cache_salt", cache_salt\)'  # storage_namespace_seed's loop

EQUIVALENT: list[tuple[str, str, str]] = [
    (
        "xǁTokenSlotAllocatorǁalloc_pages",
        _lines("if type(k) is int and k == 1 and free:", "if type(None) is int and k == 1 and free:"),
        "the one-page fast path is then never taken, and the general path hands out the same page (the free "
        "list's first), with the same DoubleAlloc check and the same marks",
    ),
    # --- hashing: token words --------------------------------------------------------------------------
    (
        "x__from_array",
        r'- return np\.empty\(0, dtype="<u4"\)\n\+ return np\.empty\(0, (dtype=None|dtype="<U4"|)\)',
        "an empty array of any dtype has no page to hash: page_hashes, where these words go, returns [] either way",
    ),
    (
        "x__from_array",
        _lines('if arr.dtype.kind not in "iu":', 'if arr.dtype.kind not in "XXiuXX":'),
        "numpy's dtype kinds are single letters: 'X' is none of them, so the test accepts exactly 'i' and 'u' still",
    ),
    (
        "x__from_array",
        r'- if arr\.dtype == np\.dtype\("<u4"\):\n\+ if arr\.dtype == np\.dtype\((None|"<U4")\):',
        "the shortcut for a little-endian uint32 array is then never taken (float64 and '<U4' are no integer dtype), "
        "and the general path gives such an array the same words: no sign check for kind 'u', itemsize 4, "
        "astype('<u4')",
    ),
    (
        "x__from_array",
        r"- if arr\.dtype\.itemsize <= 4:\n\+ if arr\.dtype\.itemsize (< 4|<= 5):",
        "integer itemsizes are 1, 2, 4 or 8: '<= 5' is '<= 4', and with '< 4' a 4-byte array (no id below 0 by now) "
        "goes on to its max, always below 2**32, and is converted to '<u4' all the same",
    ),
    (
        "x__from_array",
        _lines('return np.ascontiguousarray(arr.astype("<u4"))', "return np.ascontiguousarray(arr.astype(None))"),
        "float64 holds these ids (all below 2**32) exactly, and page_hashes, where the words go, sends 8-byte words "
        "to _wide_chain, which finds no id >= 2**32 and hashes each page's astype('<u4') bytes: the same keys",
    ),
    (
        "x__from_array|x__wide_chain|xǁTokenSlotAllocatorǁslots_of",
        r"- (.*)\.reshape\(-1(.*)\n\+ \1\.reshape\(-2\2",
        "numpy takes any negative size in a reshape for the one dimension it infers (it gives a negative size no "
        "other meaning; checked on the installed 2.4), so "
        "-2 means what -1 does",
    ),
    (
        "x__token_words",
        _lines("return _from_list(token_ids)", "return _from_list(None)"),
        "unreachable: the branch needs a list and _NATIVE_LE, and page_hashes, the only caller, converts such a list "
        "itself and never passes it on",
    ),
    (
        "x__token_words",
        _lines(
            'return _from_array(token_ids.detach().to("cpu").reshape(-1).numpy())',
            "return _from_array(token_ids.detach().to(None).reshape(-1).numpy())",
        ),
        "not told apart on a CPU-only host, where every tensor already is on the CPU and .to(None) leaves it there (a GPU "
        "run sees the difference)",
    ),
    # --- hashing: page_hashes' fast paths, whose general path gives the same result ------------------------
    (
        "x_page_hashes",
        _lines(
            "if type(page_size) is not int: # the hot path passes an int: one check",
            "if type(None) is not int: # the hot path passes an int: one check",
        ),
        "every page size then goes through _index, which returns an int unchanged (operator.index): only the "
        "shortcut for ints is lost",
    ),
    (
        "x_page_hashes",
        _lines('prev = b""', 'prev = b"XXXX"'),
        "the surviving copy is the one for a prior that fromhex refuses: 4 bytes fail the 32-byte test as no bytes "
        "do, and _prior_bytes raises the same ValueError (the same change at the un-namespaced chain start is killed)",
    ),
    (
        "x_page_hashes",
        _lines("prev = bytes.fromhex(prior_hash)", "prev = bytes.fromhex(None)"),
        "fromhex(None) raises TypeError, so prev is b'' and the length test sends the prior to _prior_bytes, which "
        "returns the same 32 bytes or raises the same ValueError",
    ),
    (
        "x_page_hashes",
        _lines("if len(prev) != 32 or len(prior_hash) != 64:", "if len(prev) != 33 or len(prior_hash) != 64:"),
        "every prior then goes through _prior_bytes, which returns the same 32 bytes for a valid one and raises for "
        "the rest (33 bytes need 66 digits, which the second test catches)",
    ),
    (
        "x_page_hashes",
        r'- words: array\.array \| np\.ndarray = array\.array\("I", token_ids\)\n'
        r'\+ words: array\.array \| np\.ndarray = array\.array\((None, token_ids|"I", None|token_ids|"XXIXX", token_ids)\)',
        "the fast path then raises TypeError, which it catches to call _from_list, which builds the same array('I') "
        "(or, with an id past 2**32, the same wide words)",
    ),
    # --- hashing: _prior_bytes ---------------------------------------------------------------------------
    (
        "x__prior_bytes",
        _lines('return b""', 'return b"XXXX"'),
        "no caller uses what it returns for an empty prior: page_hashes calls it only with a non-empty prior_hash, "
        "and PageRun only to validate a namespace, discarding the result",
    ),
    (
        "x__prior_bytes",
        _lines('raw = b""', 'raw = b"XXXX"'),
        "4 bytes fail the 32-byte test as no bytes do: the same ValueError",
    ),
    # --- wording: argument names that only reach an error's message --------------------------------------
    (
        "x__prior_bytes",
        _def(
            'def _prior_bytes(prior_hash: str | None, what: str = "prior_hash") -> bytes:',
            'def _prior_bytes(prior_hash: str | None, what: str = "XXprior_hashXX") -> bytes:',
        ),
        "`what` only names the argument inside the ValueError's message",
    ),
    (
        "xǁPageRunǁ__init__",
        r'- _prior_bytes\(namespace, "namespace"\)(.*)\n\+ _prior_bytes\(namespace, "XXnamespaceXX"\)\1',
        "`what` only names the argument inside the ValueError's message",
    ),
    (
        "x_request_namespace",
        r'- for name, v in \(\("extra_key", extra_key\), \("cache_salt", cache_salt\), \("lora_id", lora_id\)\):\n'
        r'\+ for name, v in \((\(("XXextra_keyXX"|"EXTRA_KEY"), extra_key\), \("cache_salt", cache_salt\), \("lora_id", lora_id\)'
        r'|\("extra_key", extra_key\), \(("XXcache_saltXX"|"CACHE_SALT"), cache_salt\), \("lora_id", lora_id\)'
        r'|\("extra_key", extra_key\), \("cache_salt", cache_salt\), \("XXlora_idXX", lora_id\))\):',
        "`name` only names the argument inside the TypeError's message",
    ),
    (
        "x_storage_namespace_seed",
        r"- for name, part in " + _NS_ARGS + r"\):\n"
        r'\+ for name, part in (\(\("XXextra_keyXX", extra_key\), \("cache_salt", cache_salt\)|\(\("extra_key", extra_key\), \("XXcache_saltXX", cache_salt\))\):',
        "`name` only names the argument inside the TypeError's and ValueError's messages",
    ),
    (
        "x_storage_namespace_seed",
        _lines('encoded = part.encode("utf-8")', 'encoded = part.encode("UTF-8")'),
        "codec names are looked up case-insensitively: 'UTF-8' is the same codec",
    ),
    # --- the slot allocator ------------------------------------------------------------------------------
    (
        "xǁTokenSlotAllocatorǁalloc",
        r'- return out if self\.device\.type == "cpu" else out\.to\(self\.device\)\n'
        r'\+ return out if (\(self\.device\.type == "cpu"\) and False|self\.device\.type == "XXcpuXX"|'
        r'self\.device\.type == "CPU") else out\.to\(self\.device\)',
        "the test is then always false (device types are lower-case), so every alloc takes out.to(self.device), "
        "which for a CPU allocator returns out itself: only the shortcut is lost",
    ),
    # --- the layer-buffer pool ---------------------------------------------------------------------------
    (
        "xǁLayerBufferKVPoolǁ__init__",
        r'- self, planes: Sequence\[Sequence\[torch\.Tensor\]\], \*, attention: str = "mha", name: str = "layer buffers"\n'
        r'\+ self, planes: Sequence\[Sequence\[torch\.Tensor\]\], \*, attention: str = "(XXmhaXX|MHA)", '
        r'name: str = "layer buffers"',
        "the pool only asks whether attention == 'mla', so any other default means MHA as 'mha' does; the default's "
        "text reaches only the ValueError's message",
    ),
    (
        "xǁLayerBufferKVPoolǁ__init__",
        r'- (self, planes: .*, name: str = )"layer buffers"\n\+ \1"(XXlayer buffersXX|LAYER BUFFERS)"',
        "the name only opens the ValueError messages",
    ),
    (
        "xǁLayerBufferKVPoolǁlayer_pointers",
        r"- ptrs = torch\.tensor\(\[b\.data_ptr\(\) for plane in self\.planes for b in plane\], dtype=torch\.int64\)\n"
        r"\+ ptrs = torch\.tensor\(\[b\.data_ptr\(\) for plane in self\.planes for b in plane\], (dtype=None|)\)",
        "torch.tensor infers int64, the dtype asked for, from a non-empty list of Python ints (addresses, below "
        "2**63; a pool has at least one buffer)",
    ),
    (
        "xǁLayerBufferKVPoolǁlayer_pointers",
        r'- if self\.device\.type == "cuda":\n\+ if self\.device\.type == "(XXcudaXX|CUDA)":',
        "not told apart on a CPU-only host, where no pool is on CUDA and the test is false either way (the GPU test "
        "tests/dataplane/test_layer_pool.py::test_pointer_table_kernel_on_gpu sees the difference)",
    ),
    (
        "xǁLayerBufferKVPoolǁlayer_pointers",
        r"- ptrs = ptrs\.pin_memory\(\)\.to\(self\.device, non_blocking=True\)(.*)\n"
        r"\+ (ptrs = None|ptrs = ptrs\.pin_memory\(\)\.to\(None, non_blocking=True\)|ptrs = ptrs\.pin_memory\(\)\.to\(non_blocking=True\))\1",
        "not told apart on a CPU-only host: the line runs only for a pool on CUDA (the GPU test "
        "tests/dataplane/test_layer_pool.py::test_pointer_table_kernel_on_gpu sees the difference)",
    ),
    (
        "xǁLayerBufferKVPoolǁlayer_pointers",
        r"- ptrs = ptrs\.pin_memory\(\)\.to\(self\.device, non_blocking=True\)(.*)\n"
        r"\+ ptrs = ptrs\.pin_memory\(\)\.to\(self\.device, (non_blocking=None|non_blocking=False|)\)\1",
        "a blocking copy from pinned memory lands the same table; non_blocking only lets the host go on before it "
        "lands, and the caller's stream orders the copy before its kernels either way (and the line runs only for a "
        "pool on CUDA)",
    ),
    (
        "x__from_list",
        r"- return np\.array\(token_ids, dtype=\"<u8\"\)\n\+ return np\.array\(token_ids, (dtype=None|)\)",
        "every id reaching this line is an int in [0, 2**63) (the loop above refuses the rest, floats included since "
        "this run found them truncated here: tests/dataplane/test_hashing_refusals.py::"
        "test_a_float_among_wide_ids_is_refused_not_truncated), so numpy's default int64 has the u64 words' bytes",
    ),
]
