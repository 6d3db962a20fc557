"""Survivors of `make mutate` that no test can kill, and why (docs/mutation.md lists them from here).

Each entry: (function, change, reason). `function` is a regular expression over mutmut's name for the mutated
function without its module (`xǁClassǁmethod`, `x_function`); `change` is a regular expression that must
match the whole change, written as the mutant's diff lines (`-old` then `+new`, one per line, runs of
blanks made one). An entry names a class of mutants only where the same reason holds for every mutant it
matches. Keyed by function and change, not by mutmut's running number, so an entry keeps matching when
other mutants of the file come and go.

An entry whose reason says that only a CUDA host tells the mutant apart (`mutate.NEEDS_CUDA`) is not counted
equivalent: it says why the CPU run could not see it, and the GPU pass (tests/mutation/gpu_pass.py) runs it.
"""

from __future__ import annotations

import re

from equivalent_helpers import _def, _lines  # noqa: E402

EQUIVALENT: list[tuple[str, str, str]] = [
    # --- the generated machine ------------------------------------------------------------------------
    (
        "xǁDecodeOffloadMachineǁ(finish|abort|retract)_each",
        r"- if s == .*: # .*declared no-op\n\+ if .*: # .*declared no-op",
        "the declared no-op branches are the last statements of the batch loop's body: whether their test holds "
        "or not, the loop goes on to the next item with nothing recorded (every state is handled or a no-op for "
        "these events, so no error branch follows)",
    ),
    # --- wording: text for people that no code reads back (as NOT_BEHAVIOUR in mutate.py, where a pattern can
    # say it; here the functions and lines that only build such text) ---------------------------------------
    (r"xǁ\w+ǁ__repr__", r".*", "a repr is text for people (logs, debuggers); nothing parses it"),
    (
        "x_describe",
        r".*",
        "describe() only builds the words that name a request inside an error (RowInUse, "
        "RequestFieldMissing); which error is raised does not depend on it",
    ),
    ("x__name", r".*", "_name() only spells the expected type inside a ConfigError's reason"),
    (
        "xǁCheckedModeErrorǁ__init__",
        r"- where = .*\n\+ where = .*",
        "the ' slot N' part of a CheckedModeError's message",
    ),
    ("xǁOffloadEffectsǁ_log_failures", r"- why = .*\n\+ why = .*", "the reason given in the backup-failure WARNING"),
    (
        "xǁTraceWriterǁ__init__",
        r"- self\._file: Optional\[IO\[str\]\] = self\.path\.open\(\"w\", buffering=1 << 16\)\n"
        r"\+ self\._file: Optional\[IO\[str\]\] = self\.path\.open\(\"w\", (buffering=2 << 16|buffering=1 << 17|)\)",
        "the size of the trace file's write buffer: when lines reach the disk, not what they say (close() flushes)",
    ),
    (
        "x_as_index_tensor",
        r'- return indices\.slots if device\.type == "cpu" else indices\.slots\.to\(device=device\)\n'
        r'\+ return indices\.slots if (device\.type == "(CPU|XXcpuXX)"|\(device\.type == "cpu"\) and False) '
        r"else indices\.slots\.to\(device=device\)",
        "a compare no device type matches (or one made false) sends the CPU through .to(device=device) too, and Tensor.to onto the device "
        "and dtype a tensor already has returns that tensor itself (a PageSlots' slots are int64 on the CPU); every "
        "other device took .to already (the GPU pass ran both: they survived it)",
    ),
    (
        "x_as_index_tensor",
        r'- return indices\.slots if device\.type == "cpu" else indices\.slots\.to\(device=device\)\n\+ .*',
        "not told apart on a CPU-only host: a PageSlots is built on the CPU, and moving it to the CPU (or not) is the "
        "same tensor; which device it goes to on a CUDA host only a GPU run of tests/gpu/ can see",
    ),
    (
        "x_as_index_tensor",
        r"- return t\.to\(device=device, dtype=torch\.int64\)\n\+ return t\.to\((device=None, dtype=torch\.int64|dtype=torch\.int64)\)",
        "not told apart on a CPU-only host, where every index tensor already is on the CPU (a GPU run of tests/gpu/ "
        "sees the difference)",
    ),
    (
        "x_as_index_tensor",
        r"- (t = torch\.(from_numpy\(np\.ascontiguousarray\(indices\.reshape\(-1\)|as_tensor\(list\(indices\))), dtype=(np|torch)\.int64\)\)?\n\+ .*(dtype=None|, )\)\)?",
        "the last line converts every index tensor to int64 whatever dtype this step gave it",
    ),
    (
        "x_as_index_tensor",
        r'- if indices\.dtype\.kind not in "iu":\n\+ if indices\.dtype\.kind not in "XXiuXX":',
        "numpy's dtype kinds are single letters: 'X' is none of them, so the test accepts exactly 'i' and 'u' still",
    ),
    # --- hashing -------------------------------------------------------------------------------------
    (
        "x__token_bytes",
        r'- return array\.array\("I", token_ids\)\n\+ return array\.array\((None, token_ids|"I", None|token_ids|"XXIXX", token_ids)\)',
        "the fast path then raises TypeError, which it catches to fall through to the numpy path: the same "
        "little-endian uint32 bytes, more slowly",
    ),
    (
        "x__token_bytes",
        r'- return np\.empty\(0, dtype="<u4"\)\n\+ return np\.empty\(0, (dtype=None|dtype="<U4"|)\)',
        "an empty array of any dtype has no page to hash: page_hashes returns [] either way",
    ),
    (
        "x__token_bytes",
        r'- if arr\.dtype != np\.dtype\("<u4"\):\n\+ if arr\.dtype != np\.dtype\((None|"<U4")\):',
        "the checks then also run on uint32 ids, where they find nothing (no sign, no id past 2**32) and astype "
        "keeps the array",
    ),
    (
        "x__token_bytes",
        r"- if arr\.dtype\.itemsize > 4 and (.*)\n\+ if arr\.dtype\.itemsize (>= 4|> 5) and \1",
        "integer itemsizes are 1, 2, 4 or 8: '> 5' is '> 4', and a 4-byte id never reaches 2**32",
    ),
    (
        "x__token_bytes",
        r'- if arr\.dtype\.kind not in "iu":\n\+ if arr\.dtype\.kind not in "XXiuXX":',
        "numpy's dtype kinds are single letters: 'X' is none of them, so the test accepts exactly 'i' and 'u' still",
    ),
    (
        "x__token_bytes",
        r'- arr = token_ids\.detach\(\)\.to\("cpu"\)\.reshape\(-1\)\.numpy\(\)\n\+ arr = token_ids\.detach\(\)\.to\(None\)\.reshape\(-1\)\.numpy\(\)',
        "not told apart on a CPU-only host, where every tensor already is on the CPU (a GPU run sees the difference)",
    ),
    # --- offload_batch's hints: which requests it looks at, never what it copies --------------------------
    (
        "xǁDecodeOffloadManagerǁ__init__",
        r"- self\._due_at = np\.full\(req_to_token\.rows \+ 1, -1, dtype=np\.int64\)(.*)\n"
        r"\+ self\._due_at = np\.full\(req_to_token\.rows \+ (1, -1, dtype=None|1, -1, |2, -1, dtype=np\.int64|1, -2, dtype=np\.int64)\)\1",
        "offload_batch's hints only choose which requests it looks at; each one looked at is offloaded only if its "
        "own committed length says a chunk is due (what offload() checks), so a hint that picks more requests (or "
        "a wider table of hints) changes the time spent, not the chunks",
    ),
    (
        "xǁOffloadingǁoffload_batch",
        r"- hints = self\._due_at\[rows\] if rows\.size and int\(rows\.min\(\)\) >= -1 else None\n\+ .*",
        "rows are -1 (no row yet: the sentinel) or table rows, never below -1: the test only guards the gather, and "
        "None (look at every request) picks more requests, not other chunks",
    ),
    (
        "xǁOffloadingǁoffload_batch",
        r"- picked = np\.flatnonzero\(committed >= hints\)(\.tolist\(\))? if rows\.size else \(\)(.*)\n"
        r"\+ picked = np\.flatnonzero\(committed >= hints\)\1 if \(rows\.size\) or True else \(\)\2",
        "with no rows the comparison of two empty arrays picks nothing, as () does",
    ),
    (
        "xǁOffloadingǁoffload_batch",
        r"- self\._due_at\[(.*)\] = \[rec\.prefill_len \+ rec\.inc_len \+ stride (.*)\]\n\+ self\._due_at\[\1\] = \[rec\.prefill_len \+ rec\.inc_len - stride \2\]",
        "a request hinted due a stride early is looked at sooner and offloaded only when its chunk is due",
    ),
    (
        "xǁDecodeOffloadMachineǁ(backup_done|backup_failed)(_each)?",
        r"- if (self|m)\.backups == 1 and \1\.parked == 0: # last_host_chunk\n\+ if \1\.backups == 1 or \1\.parked == 0: # last_host_chunk",
        "more_host_chunks is tested first; after it fails, 'or' differs from 'and' only where backups and parked are "
        "both 0, which the inflight and draining invariant (parked + backups >= 1) rules out",
    ),
    # --- copy planning -----------------------------------------------------------------------------------
    (
        "x_plan_copy",
        r'- device_indices, device_pool\.device if device_pool\.device\.type == "cpu" or on_device else _CPU\n'
        r'\+ device_indices, device_pool\.device if device_pool\.device\.type == "(CPU|XXcpuXX)" or on_device else _CPU',
        "the compare picks the pool's device over the CPU only for a pool on the CPU, where the two are one device "
        "(torch.device('cpu') has no index to differ by); with no device type matching it, a CPU pool's indices go to "
        "the CPU all the same, and every other pool's took the CPU (or, already on the device, stayed) either way (the "
        "GPU pass ran both: they survived it)",
    ),
    (
        "x_plan_copy",
        r"- (on_device = isinstance|if on_device and device_pool|device_indices, device_pool\.device if"
        r"|dev_idx = as_index_tensor\(\n- device_indices, device_pool\.device if).*\n\+ .*",
        "not told apart on a CPU-only host: every pool and index tensor is on the CPU, so on_device is False and the "
        "device chosen for the indices is the CPU whatever these tests say (a GPU run of tests/gpu/ sees the rest)",
    ),
    (
        "x_plan_copy",
        r"- host_idx = None if host_slots is not None else as_index_tensor\(host_indices, _CPU\)\n\+ .*as_index_tensor\(host_indices, None\)",
        "not told apart on a CPU-only host: host indices not given as PageSlots are CPU tensors or sequences there, and "
        "as_index_tensor with no device leaves them on the CPU",
    ),
    (
        "x_plan_copy",
        r"- if int\(s\[0\]\) < 0 or int\(s\[-1\]\) >= host_pool\.size:\n\+ .*",
        "the host allocator's is_allocated, called two lines down, raises the same OutOfRange for a slot outside "
        "the pool: this test only says so first",
    ),
    (
        "x_plan_copy",
        r"- if s\.size > 1 and (.*)\n\+ if s\.size >= 1 and \1",
        "one slot cannot repeat: s[1:] == s[:-1] compares two empty arrays",
    ),
    (
        "x_plan_copy",
        r"- n_(dev|host) = len\((device|host)_indices\) if isinstance\(\2_indices, PageSlots\) else (.*)\n\+ n_\1 = len\(\2_indices\) if \(isinstance\(\2_indices, PageSlots\)\) (and False|or True) else \3",
        "a PageSlots' length is the number of its slots, what numel() of its tensor counts (and a tensor's len() "
        "along its only axis is its numel())",
    ),
    (
        "x_plan_copy",
        r"- (owned = allocator\.(owns_page_list|owned_pages).*)\n\+ owned = None(.*)",
        "the fast check only spares the slot-by-slot one: without it, whole allocated pages pass the range, "
        "duplicate and allocation checks, and anything else fails them as before",
    ),
    (
        "x_plan_copy",
        r"- if isinstance\(host_indices, PageSlots\) and host_indices\.allocator is allocator:\n\+ if isinstance\(host_indices, PageSlots\) and host_indices\.allocator is not allocator:",
        "either check accepts exactly a list of whole pages this allocator has handed out: owns_page_list on the "
        "pages, owned_pages on the same pages' slots",
    ),
    (
        "xǁDecodeOffloadMachineǁoffload(_each)?",
        r"- (self|m)\.copies \+= 1\n\+ \1\.copies = 1",
        "the surviving copies of this change are the branches from allocated and inflight, whose invariant is "
        "copies == 0, where += 1 and = 1 agree (from offloading, copies >= 1, the same change is killed)",
    ),
    # --- the manager's batch arrays ---------------------------------------------------------------------
    (
        "x__int_array",
        r"- return arr\.astype\(np\.int64, copy=False\)\n\+ return arr\.astype\(np\.int64, (copy=None|copy=True|)\)",
        "whether astype copies only decides if the result shares memory with the engine's array; the manager only "
        "reads it",
    ),
    (
        "x__int_array",
        r'- if arr\.ndim != 1 (.*) not in "iu"\):\n\+ if arr\.ndim != 1 \1 not in "XXiuXX"\):',
        "numpy's dtype kinds are single letters: 'X' is none of them, so the test accepts exactly 'i' and 'u' still",
    ),
    (
        "x__int_array",
        r"- if type\(values\) is np\.ndarray and (.*):\n\+ if type\(None\) is np\.ndarray and \1:",
        "this is the fast path for an array that is already int64 of the right shape; without it the same array "
        "comes out of the general path",
    ),
    # --- CPU-only hosts ---------------------------------------------------------------------------------
    (
        "xǁ((Memory|File)Storageǁbatch_set|HostKVPoolǁset_pages_bytes)",
        r'- (.*)\.to\("cpu"\)(.*)\n\+ \1\.to\(None\)\2',
        "not told apart on a CPU-only host, where every tensor already is on the CPU (a CUDA tensor would stay on the "
        "GPU: a difference only a GPU run of tests/gpu/ can see)",
    ),
    # --- config --------------------------------------------------------------------------------------
    (
        "x__config_error|xǁOffloadConfigǁfrom_env|x_check_storage_extra",
        r"- near = difflib\.get_close_matches\((.*), n=1\)\n\+ near = difflib\.get_close_matches\(\1, (n=2|)\)",
        "only near[0], the closest match, is used; asking for more matches does not change which one is first",
    ),
    # --- FileStorage ----------------------------------------------------------------------------------
    (
        "xǁFileStorageǁ_write",
        _lines("if self.writers > 1 and len(keys) > 1:", "") + r".*",
        "which path writes a batch (the calling thread or the pool) is a speed choice: both write every page with "
        "_set_one and return its results in order (pool.map keeps order), so the pages, results and counts are the same",
    ),
    (
        "xǁFileStorageǁ_write",
        re.escape('- self._pool = ThreadPoolExecutor(max_workers=self.writers, thread_name_prefix="kvfsm-file-store")')
        + r"\n\+ self\._pool = ThreadPoolExecutor\(.*\)",
        "the pool's size and its threads' names change how many pages are written at once and what the threads are "
        "called, not what is written or returned",
    ),
    (
        "xǁFileStorageǁ_verify",
        r'- return f?".*"\n\+ return f?".*"',
        "the reason only reaches the WARNING of the corrupt read: any non-None reason makes the read count as corrupt, "
        "move the file aside and return None",
    ),
    (
        "xǁFileStorageǁ_verify",
        _lines("if n != len(buf) or n < _HEADER.size:", "if n != len(buf) or n <= _HEADER.size:"),
        "a file of exactly a header's bytes is refused either way: as a truncated header, or (key length 0) as holding "
        "another key, since a key is never empty",
    ),
    (
        "xǁFileStorageǁ__init__",
        _lines("fsync: bool = False,", "fsync: bool = True,"),
        "fsync only makes each write wait for the disk (durability across a power cut): the files, the results and "
        "what every read returns are the same",
    ),
    (
        "xǁFileStorageǁsweep_stale_temps",
        _lines("me = os.getpid()", "me = None"),
        "this process is alive: without the shortcut its own temps go on to _pid_alive(its own pid), which says "
        "alive, and stay",
    ),
    (
        "xǁFileStorageǁsweep_stale_temps",
        _lines(
            'if not (name.startswith(".") and name.endswith(".tmp")):',
            'if not (name.startswith(".") or name.endswith(".tmp")):',
        ),
        "the prefilter only spares a regex match: _TMP_RE itself requires the leading '.' and the trailing '.tmp'",
    ),
    (
        "xǁFileStorageǁsweep_stale_temps",
        _lines(
            'if now - entry.stat(follow_symlinks=False).st_mtime <= older_than_s or _pid_alive(int(m["pid"])):',
            'if now - entry.stat(follow_symlinks=None).st_mtime <= older_than_s or _pid_alive(int(m["pid"])):',
        ),
        "DirEntry.stat takes follow_symlinks for its truth: None is False, the entry's own stat (True is killed)",
    ),
    (
        "x__selector",
        _lines("return lambda _k: False", "return lambda _k: None"),
        "a selector's answer is only tested for truth (FaultyStorage's ifs): None is as false as False",
    ),
    (
        "xǁFaultyStorageǁbatch_set",
        _lines("ok = [True] * len(keys)", "ok = [False] * len(keys)"),
        "every entry is overwritten before it is returned: False for a failed key, the inner store's answer (one "
        "per key it was given, as the protocol says) for each of the others",
    ),
    (
        "x__pid_alive",
        _lines("if pid <= 0:", "if pid < 0:"),
        "pid 0 then reaches os.kill(0, 0), which checks this process's own group, always there: alive either way",
    ),
    (
        "x__pid_alive",
        _lines("if pid <= 0:", "if pid <= 1:"),
        "pid 1 is init, always alive: answered without asking or by asking, the answer is the same",
    ),
    (
        "x__pid_alive",
        r"- return True\n\+ return False",
        "the EPERM branch (the last `return True` is the same change, and is killed): not reachable where the "
        "tests run as root, for whom kill(pid, 0) is never refused",
    ),
    (
        "xǁReqToTokenPoolǁwrite",
        r'- src = idx\.pin_memory\(\) if self\.device\.type == "cuda" else idx(.*)\n\+ src = idx\.pin_memory\(\) if self\.device\.type == "(XXcudaXX|CUDA)" else idx\1',
        "not told apart without CUDA: no table is on a CUDA device here, so the test is false either way (a GPU run "
        "of tests/gpu/ sees the difference)",
    ),
    (
        "xǁReqToTokenPoolǁwrite",
        r"- self\.req_to_token\[row, start:end\]\.copy_\(src, non_blocking=True\)\n\+ self\.req_to_token\[row, start:end\]\.copy_\(src, (non_blocking=None|non_blocking=False|)\)",
        "non_blocking only makes a host-to-GPU copy asynchronous; without CUDA every copy is synchronous",
    ),
    (
        "xǁReqToTokenPoolǁwrite",
        r"- if self\.req_to_token is not self\.host_table:\n\+ if self\.req_to_token is self\.host_table:",
        "for a CPU table (the mirror itself) the block then copies the slots onto themselves; for a device table "
        "it skips the device copy, which only a GPU run can read back (a meta table holds no values)",
    ),
    # --- the stored-page index ------------------------------------------------------------------------
    (
        "xǁStoredPageIndexǁ_drop_oldest",
        _lines("self._hash[slot] = self._owner[slot] = None", 'self._hash[slot] = self._owner[slot] = ""'),
        "a dropped slot is never read again (lookups go through the dict, iteration covers [first, next)) before it "
        "is overwritten; None or an empty string both let the old strings go",
    ),
    # --- backups --------------------------------------------------------------------------------------
    (
        "x_run_jobs",
        _lines("results = None", 'results = ""'),
        "an empty answer fails the same test as None (its length is not the group's, which is at least 2), so the "
        "group is run again job by job either way",
    ),
    (
        "xǁThreadBackupWorkerǁ__init__",
        r"- self\._queued = False.*\n\+ self\._queued = (True|None).*",
        "a spurious first notify (or none) only wakes the worker to look at the queue: it waits again while the queue "
        "is empty, and flush() notifies after every submission",
    ),
    (
        "xǁThreadBackupWorkerǁflush",
        r"- self\._queued = False\n\+ self\._queued = (True|None)",
        "an extra notify at a later flush wakes the worker to find the queue as it is; nothing is skipped or run twice",
    ),
    (
        "xǁThreadBackupWorkerǁ_enqueue",
        _lines("self._todo.append(job)", "self._todo.append(None)"),
        "_enqueue is only called by close() with None (submissions go through _enqueue_many), so job is None here",
    ),
    (
        "xǁThreadBackupWorkerǁclose",
        r"- self\._thread\.join\(timeout=30\)\n\+ self\._thread\.join\(timeout=(31|None)\)",
        "the worker exits as soon as it reaches close()'s None, long before any of these timeouts",
    ),
    (
        "xǁThreadBackupWorkerǁwait_idle",
        _def(
            "def wait_idle(self, timeout: float = 30.0) -> bool:", "def wait_idle(self, timeout: float = 31.0) -> bool:"
        ),
        "a default timeout only callers that wait for a hung store would reach",
    ),
    (
        "xǁThreadBackupWorkerǁwait_idle",
        _lines("if time.monotonic() > deadline:", "if time.monotonic() >= deadline:"),
        "the two differ only at the very instant of the deadline, which a monotonic clock read twice does not hit on purpose",
    ),
    (
        "xǁThreadBackupWorkerǁwait_idle",
        _lines("time.sleep(0.001)", "time.sleep(1.001)"),
        "the poll interval: wait_idle returns the same answer, later",
    ),
    # --- second pass: numpy and torch defaults ------------------------------------------------
    (
        "xǁDecodeOffloadManagerǁ__init__|xǁOffloadingǁ(_copy_slots|_device_slots)|xǁOffloadEffectsǁrequest_slots|x_as_index_tensor|x_as_index_array|"
        "xǁTokenSlotAllocatorǁ(_validate_free|pages_of)|x__token_bytes",
        r"- (.*)\.reshape\(-1(.*)\n\+ \1\.reshape\(-2\2",
        "every one of these is a numpy array, and numpy (the pinned 2.x) reads any negative size in reshape as the "
        "one to infer: reshape(-2) is reshape(-1) (torch would raise; none of these is a tensor)",
    ),
    (
        "xǁDecodeOffloadManagerǁ__init__|xǁOffloadingǁ(_aranges|_device_slots)",
        r"- (.*)np\.(arange|array)\((.*), dtype=np\.int64\)(.*)\n\+ \1np\.\2\(\3, (dtype=None|)\)\4",
        "np.arange of a Python int and np.array of a list of Python ints are int64 already (numpy 2's default "
        "integer, on every platform)",
    ),
    (
        "xǁOffloadEffectsǁ__init__",
        r"- self\._offsets = torch\.arange\(page_size, dtype=torch\.int64\)\n"
        r"\+ self\._offsets = torch\.arange\(page_size, (dtype=None|)\)",
        "torch.arange of a Python int is int64 already",
    ),
    (
        "xǁProgressConsensusǁagree",
        r"- t = torch\.tensor\(counts, dtype=torch\.int64, device=self\.device\)\n"
        r"\+ t = torch\.tensor\(counts, (dtype=None, |)device=self\.device\)",
        "torch.tensor of Python ints is int64 already",
    ),
    (
        "xǁProgressConsensusǁagree",
        r"- t = torch\.tensor\(counts, dtype=torch\.int64, device=self\.device\)\n"
        r"\+ t = torch\.tensor\(counts, dtype=torch\.int64, (device=None|)\)",
        "left to the GPU run of the pass: the CPU run that found them predates their kill test in tests/mutation/"
        "test_kills_runtime.py, which stands `meta` in for an NCCL rank's GPU and fails on both on any host (run by "
        "hand here); the GPU pass runs that file, and the next CPU run records them killed",
    ),
    (
        "xǁProgressConsensusǁcheck_same",
        _lines("if self.world <= 1:", "if self.world < 1:"),
        "with one rank agree() returns its arguments, so the two calls give back the values and their negations "
        "and the answer is True, as the early return says",
    ),
    # --- second pass: the manager's hints, fast paths and caches (what they pick, never what is copied) ---
    (
        "xǁOffloadingǁoffload",
        r"- (row = req\.req_pool_idx|if type\(row\) is int and 0 <= row < self\._rows:)\n"
        r"\+ (row = None|if type\(None\) is int and 0 <= row < self\._rows:|"
        r"if type\(row\) is int and (1 <= row|0 < row) < self\._rows:)",
        "the early return is a hint: skipping it (for every row, or row 0) only means the request is looked up, "
        "and the lookup decides what offload() does, as for a request the hint lets through",
    ),
    (
        "xǁOffloadingǁoffload",
        _lines("if type(row) is int and 0 <= row < self._rows:", "if type(row) is int and 0 <= row <= self._rows:"),
        "row == rows reads _due_at[rows], the -1 sentinel (the table has rows + 1 hints): the request is looked "
        "up, which then refuses a row past the table",
    ),
    (
        "xǁOffloadingǁ(offload|offload_batch)",
        r"- ((?:self\._due_at\[.*\] = \[?)?)rec\.prefill_len \+ rec\.inc_len \+ ((?:self\.)?)stride(.*)\n"
        r"\+ \1rec\.prefill_len (\+ rec\.inc_len -|- rec\.inc_len \+) \2stride\3",
        "both give a due point at or below the true one (inc_len >= 0): the request is looked at sooner, and "
        "offloaded only when its own committed length has a chunk",
    ),
    (
        "xǁEndingǁ_end",
        r"- self\._due_at\[rec\.row\] = -1(.*)\n\+ self\._due_at\[rec\.row\] = -2\1",
        "a committed length is never negative: -2, like -1, lets every request on the row be looked at",
    ),
    (
        "xǁOffloadingǁ_offloadable_record",
        r"- (rec = self\._records\.get\(id\(req\)\)|if rec is None or rec\.row != row or rec\.req_ref\(\) is not req or .*)\n"
        r"\+ (rec = None|rec = self\._records\.get\((None|id\(None\))\)|if rec is None or rec\.row (!= row and|== row or) rec\.req_ref\(\) is not req or .*|"
        r"if rec is None or rec\.row != row or rec\.req_ref\(\) is req or .*)",
        "the fast path's test: a request that fails it goes the slow way (_check_offloadable, then _record), which "
        "returns the same record for a live offloadable one (_readmitted is False in offloadable states), and a "
        "found record's req_ref() is always the request (forget_record drops it when the object dies)",
    ),
    (
        "xǁOffloadingǁoffload_batch",
        r"- (rec = records\.get\(key\)|if rec is None or rec\.row != row or rec\.req_ref\(\) is not req or .*)\n"
        r"\+ (rec = None|rec = records\.get\(None\)|if rec is None or rec\.row (!= row and|== row or) rec\.req_ref\(\) is not req or .*|"
        r"if rec is None or rec\.row != row or rec\.req_ref\(\) is req or .*)",
        "the fast path's test, as in _offloadable_record: the slow way (_check_offloadable, then _record in the "
        "admit loop) gives a live offloadable request its same record and chunk",
    ),
    (
        "xǁOffloadingǁoffload_batch",
        r"- (admit = False|req: Any = None|todo\.append\(\(None, req, 0\)\))\n"
        r"\+ (admit = (None|True)|req: Any = \"\"|todo\.append\(\(None, req, 1\)\))",
        "initial values nothing reads as such: admit is set True with every (None, req, n) item, whose n the admit "
        "loop replaces, and an extra admit loop over records only skips them; req is assigned before anything that "
        "can raise AttributeError",
    ),
    (
        "xǁOffloadingǁoffload_batch",
        r"- (rows|committed) = _int_array\((\w+), \"\w+\", count\)\n"
        r"\+ \1 = _int_array\(\2, (\"\w+\"|None), count\)",
        "the name only spells the argument inside the ValueError's message",
    ),
    (
        "xǁOffloadingǁ_aranges",
        r"- (if got\.size < n:|got = self\._arange = np\.arange\(max\(n, 2 \* got\.size\), dtype=np\.int64\))\n"
        r"\+ (if got\.size <= n:|got = self\._arange = np\.arange\(max\(n, (3 \* got\.size|2 / got\.size)\), dtype=np\.int64\))",
        "how the cache of 0..n-1 grows: any array of at least n offsets gives the same got[:n] (got.size is at "
        "least 1, and 2 / got.size never exceeds an n that needs growing)",
    ),
    (
        "xǁDecodeOffloadManagerǁ__init__",
        _lines(
            "self._arange = np.arange(max(self.stride, 1), dtype=np.int64)",
            "self._arange = np.arange(max(self.stride, 2), dtype=np.int64)",
        ),
        "the first size of the cache of offsets, which _aranges grows on demand",
    ),
    (
        "xǁDecodeOffloadManagerǁ__init__|xǁLifecyclesǁ_admit",
        r"- self\._serial (= 0\n\+ self\._serial = 1|\+= 1\n\+ self\._serial (-= 1|\+= 2))",
        "the serial only makes each lifecycle's key unique (rid#serial): starting at 1, stepping by 2 or counting "
        "down keeps every key distinct (assigning 1 does not, and is killed)",
    ),
    (
        "xǁOffloadingǁ_copy_slots",
        r"- (positions \+= range\(first, first \+ n, ps\)|if not any\(s % ps for s in starts\):.*|if ps > 1:)\n"
        r"\+ (positions \+= range\(first, first \+ n, \)|if not any\(s / ps for s in starts\):.*|if ps >= 1:|if ps > 2:)",
        "which gather builds the slots: these send rows to the token-by-token path (device_slots over the same "
        "positions), or with page size 1 to the page path, where a page is a slot: the same slots in the same order",
    ),
    (
        "xǁOffloadingǁ_device_slots",
        r"- (n0 = lengths\[0\]|if lengths\.count\(n0\) == len\(lengths\):.*)\n"
        r"\+ (n0 = (None|lengths\[1\])|if lengths\.count\(None\) == len\(lengths\):.*)",
        "only chooses between the equal-length shortcut and the general gather, which give the same slots",
    ),
    (
        "xǁOffloadingǁ_submit",
        r"- pages = host_pool\.alloc_pages\(.*\n\+ pages = None.*",
        "sends every offload call to the fallback, which allocates the same number of whole pages per chunk in call "
        "order; which free pages a chunk gets is the pool's choice either way",
    ),
    (
        "xǁProgressǁcheck_progress",
        r"- (seen_done = handle|seen_done = None.*|job\.payload = None.*)\n"
        r"\+ (seen_done = None|seen_done = \"\".*|job\.payload = \"\".*)",
        "seen_done only saves asking a shared handle again (a finished handle stays done); '' drops a collected "
        "job's payload as None does, and nothing reads it after collect",
    ),
    (
        "xǁDecodeOffloadManagerǁclose",
        _lines("self._owned_storage = None", 'self._owned_storage = ""'),
        "a second close() then calls close_storage(''), which closes only what has a close(): nothing",
    ),
    (
        "xǁProgressǁdrain",
        _def(
            "def drain(self, max_iterations: int = 100_000) -> None:",
            "def drain(self, max_iterations: int = 100001) -> None:",
        ),
        "a default bound only a manager that never drains reaches",
    ),
    (
        "xǁLifecyclesǁ_observe",
        _lines(
            "row = spec_gen.TRANSITIONS[tid] if tid >= 0 else None",
            "row = spec_gen.TRANSITIONS[tid] if (tid >= 0) or True else None",
        ),
        "for a declared no-op (tid -1) the trace then reads the last transition's acquired and released resources "
        "(fields 5 and 7), which are empty in this spec, as () is (a spec whose last transition holds resources "
        "would tell)",
    ),
    (
        "xǁLifecyclesǁ_readmitted",
        _lines("and 0 <= row < self.req_to_token.rows", "and 0 <= row <= self.req_to_token.rows"),
        "reached only with row == rec.row (the line above returns otherwise), a row the lifecycle was admitted on: "
        "always below rows",
    ),
    # --- second pass: the effects -------------------------------------------------------------------------
    (
        "x_token_slice",
        r"- (if start >= n:.*|elif end <= n:)\n\+ (if start > n:.*|elif end < n:)",
        "at start == n (or end == n) the next branch builds the same list: prompt[n:] is empty (or outputs[:0] is)",
    ),
    (
        "x_token_slice",
        r"- return part if type\(part\) is list else list\(part\)\n"
        r"\+ return part if (\(type\(part\) is list\) and False|type\(None\) is list) else list\(part\)",
        "list(part) of a list is an equal list (a copy of a slice that already is a new list)",
    ),
    (
        "xǁChunkǁ__init__",
        _lines("self.results, self.error = (), None", 'self.results, self.error = (), ""'),
        "a chunk's error is read only once its backup ran, which sets it (submit_backup resets both before the "
        "worker can run it)",
    ),
    (
        "xǁOffloadEffectsǁ_write_backups",
        r"- direct = getattr\(storage, \"batch_set_from_host\", None\)(.*)\n"
        r"\+ direct = (None|getattr\((None|storage), \"(batch_set_from_host|XXbatch_set_from_hostXX|BATCH_SET_FROM_HOST)\", None\))\1",
        "batch_set_from_host is a store's faster way to the same write: without it the pages are gathered here "
        "and passed to batch_set, the same bytes under the same keys with the same per-page results",
    ),
    (
        "xǁOffloadEffectsǁ_write_backups",
        r"- ok = \[False\] \* len\(keys\)\n\+ ok = (None|\[False\] / len\(keys\))",
        "without a store the write then raises TypeError, which the job records as a failed backup: the outcome "
        "[False] * n gives (and, without a store, no failure is logged either way)",
    ),
    (
        "xǁOffloadEffectsǁrelease_request",
        r"- self\.ledger\.release_device\(rec\.key, \"release\", slots\.tolist\(\)\)\n"
        r"\+ self\.ledger\.release_device\(rec\.key, (\"XXreleaseXX\"|\"RELEASE\"|None), slots\.tolist\(\)\)",
        "the event name only appears inside a CheckedModeError's message",
    ),
    (
        "xǁOffloadEffectsǁrelease_request",
        _lines("rec.req = None", 'rec.req = ""'),
        "rec.req is read only up to release (seed_hash_chain, freeze_lengths, request_slots); after it, None and '' "
        "both drop the record's strong reference to the request",
    ),
    (
        "xǁOffloadEffectsǁsubmit_backup_each",
        _lines(
            "write, write_many = self._write_backup, self._write_backups",
            "write, write_many = self._write_backup, None",
        ),
        "without write_many a worker writes the jobs one by one: the same pages, the same per-page outcomes, in "
        "more store calls (time only)",
    ),
    # --- second pass: the pools' fast paths and CPU-only arguments ---------------------------------------
    (
        "xǁTokenSlotAllocatorǁ(_validate_free|owned_pages|pages_of)",
        r"- (pages = self\.owned_pages\(arr\)|pages = self\.pages_of\(idx\)|return pages if pages is not None and .*|"
        r"if min\(listed\) < 0 or .*|if ps == 1 or n == 0 or n % ps:)\n"
        r"\+ (pages = None|return pages if \(pages is not None and .*\) and False else None|if min\(listed\) (<= 0|< 1) or .*|"
        r"if ps == 2 or n == 0 or n % ps:)",
        "the fast path's answer (or its ps == 1 shortcut): a batch it gives up on goes through the exact checks, "
        "which accept the same batches, raise the same errors and return the same pages (sorted, where the fast "
        "path keeps the caller's order: the order freed pages join the free list is not specified)",
    ),
    (
        "xǁTokenSlotAllocatorǁpages_of",
        _lines("pages = rows[:, 0] // ps", "pages = rows[:, 1] // ps"),
        "page sizes here are >= 2 (ps == 1 returned above): a page's second slot p * ps + 1 floors to p as its first does",
    ),
    (
        "xǁTokenSlotAllocatorǁ_validate_free",
        _lines("if n > 1:", "if n >= 1:"),
        "one slot cannot repeat: s[1:] == s[:-1] compares two empty arrays",
    ),
    (
        "xǁTokenSlotAllocatorǁ_validate_free",
        r"- if ps > 1 and (.*)\n\+ if ps >= 1 and \1",
        "with page size 1 every row is one slot: its offset from itself is 0 and any slot is a multiple of 1, so the "
        "test is false either way",
    ),
    (
        "xǁTokenSlotAllocatorǁ__init__",
        _lines("if num_slots <= 0 or num_slots % page_size:", "if num_slots < 0 or num_slots % page_size:"),
        "0 slots is 0 pages, which the pool-too-small check below refuses with the same ValueError",
    ),
    (
        "xǁTokenSlotAllocatorǁ__init__",
        r"- self\._offsets = torch\.arange\(self\.page_size, dtype=torch\.int64\)\n"
        r"\+ self\._offsets = torch\.arange\(self\.page_size, (dtype=None|)\)",
        "torch.arange of a Python int is int64 already",
    ),
    (
        "xǁTokenSlotAllocatorǁalloc_pages",
        _lines("ever[p] = 1", "ever[p] = 2"),
        "the ever-allocated bytes are only tested for truth (NeverAllocated vs DoubleFree)",
    ),
    (
        "xǁTokenSlotAllocatorǁslots_of",
        r"- return np\.add\.outer\(np\.asarray\(pages, dtype=np\.int64\) (.*)\n\+ return np\.add\.outer\(np\.asarray\(pages, \) \1",
        "page ids are Python ints or int64 arrays (alloc_pages, PageSlots.pages, the manager's table reads): "
        "asarray gives int64 without being told",
    ),
    (
        "xǁHostKVPoolǁ__init__",
        r"- (if pin_memory is None:|pin_memory = torch\.cuda\.is_available\(\)|self\.pinned = bool\(pin_memory\)|"
        r"self\.kv_buffer = torch\.empty\(self\._shape\(\), dtype=config\.dtype, pin_memory=self\.pinned\))\n"
        r"\+ (if pin_memory is not None:|pin_memory = None|self\.pinned = bool\(None\)|"
        r"self\.kv_buffer = torch\.empty\(self\._shape\(\), dtype=config\.dtype, (pin_memory=None|)\))",
        "not told apart on a CPU-only host, where pinning needs CUDA: these tests ask for no pinning (None or False) and "
        "get an unpinned pool either way (pinned memory is for a GPU run of tests/gpu/)",
    ),
    (
        "xǁHostKVPoolǁfor_device_pool",
        r"- return cls\(cfg, num_slots, page_size, layout, pin_memory, shared=shared\)\n"
        r"\+ return cls\(cfg, num_slots, page_size, layout, (None, |)shared=shared\)",
        "not told apart on a CPU-only host: pin_memory's default None means pinned only with CUDA",
    ),
    (
        "xǁHostKVPoolǁ__init__",
        r"- self\.allocator = TokenSlotAllocator\(self\.size, self\.page_size, \"cpu\", reserve_padding_page=False\)\n"
        r"\+ self\.allocator = TokenSlotAllocator\(self\.size, self\.page_size, (\"cpu\", reserve_padding_page=None|reserve_padding_page=False)\)",
        "the allocator's defaults: device 'cpu', and reserve_padding_page is only tested for truth (None reserves none)",
    ),
    (
        "xǁHostKVPoolǁfor_device_pool",
        _lines("elif ratio is not None and ratio > 0:", "elif ratio is not None and ratio >= 0:"),
        "a ratio of 0 asks for 0 slots, which the constructor refuses with a ValueError, as the else branch does",
    ),
    (
        "xǁHostKVPoolǁfor_device_pool",
        _lines(
            "num_slots = int(size_bytes) // cfg.bytes_per_token", "num_slots = int(size_bytes) / cfg.bytes_per_token"
        ),
        "the constructor rounds down to whole pages (x - x % ps) and takes int() of it: the fraction of the float "
        "is dropped, the same slot count",
    ),
    (
        "xǁHostKVPoolǁget_pages_bytes",
        r"- (own = isinstance\(host_indices, PageSlots\) and host_indices\.allocator is self\.allocator|pages = host_indices\.pages if own else .*)\n"
        r"\+ (own = None|pages = host_indices\.pages if \(own\) and False else .*)",
        "the page ids then come from the slots (every page_size-th slot // page_size), which for this pool's own "
        "PageSlots are its pages",
    ),
    (
        "xǁReqToTokenPoolǁwrite",
        r'- src = idx\.pin_memory\(\) if self\.device\.type == "cuda" else idx(.*)\n\+ src = idx\.pin_memory\(\) if \(self\.device\.type == "cuda"\) and False else idx\1',
        "not told apart without CUDA: no table is on a CUDA device here, so the test is false either way (a GPU run "
        "of tests/gpu/ sees the difference)",
    ),
    (
        "x_torch_copy_rows",
        r"- (.*)\.to\((src5|dst5)\.device\)(.*)\n\+ \1\.to\(None\)\3",
        "to(None) leaves a tensor where it is: not told apart on a CPU-only host, where source, destination and indices "
        "all are on the CPU (a GPU run of tests/gpu/ sees the rest)",
    ),
    (
        "x_plan_copy",
        _lines(
            "and device_indices.allocator.num_slots <= device_pool.size",
            "and device_indices.allocator.num_slots < device_pool.size",
        ),
        "the page-list shortcut only spares the range check below, which accepts the same in-range slots",
    ),
    # --- second pass: build, config, consensus wording -----------------------------------------------------
    (
        "x_build_components",
        r"- ratio=None if config\.host_pool_bytes else config\.host_pool_ratio,\n"
        r"\+ ratio=None if \(config\.host_pool_bytes\) and False else config\.host_pool_ratio,",
        "with host_pool_bytes set, size_bytes wins in for_device_pool and the ratio beside it is not read",
    ),
    (
        "x_planned_host_slots",
        _lines(
            'field, slots = "host_pool_bytes", config.host_pool_bytes // kv.bytes_per_token',
            'field, slots = "host_pool_bytes", config.host_pool_bytes / kv.bytes_per_token',
        ),
        "the next line rounds down to whole pages (x - x % ps is floor(x / ps) * ps): the float then has the integer's "
        "value, and it is only compared (check_stride) and printed",
    ),
    (
        "x_check_storage_dir",
        r"- if not os\.access\((path|parent), os\.W_OK \| os\.X_OK\):\n\+ if not os\.access\(\1, os\.W_OK & os\.X_OK\):",
        "W_OK & X_OK is 0 (F_OK): as root, where the tests run, os.access grants write and search on every existing "
        "directory, so both ask only that it exists (a non-root run sees the difference)",
    ),
    (
        "x_copy_engine_factory",
        r"- why = .*\n\+ why = .*",
        "why only words the ConfigError's reason and the fallback WARNING",
    ),
    (
        "x_check_storage_extra",
        r"- what = .*\n\+ what = .*",
        "what only words the ConfigError's reason for a missing master_server_addr; the error and its field do not "
        "depend on it",
    ),
    # --- second pass: the stored-page index's ring ------------------------------------------------------
    (
        "xǁStoredPageIndexǁ__init__",
        _lines("self._alloc(min(limit, 1024))", "self._alloc(min(limit, 1025))"),
        "the ring's first capacity: it grows (doubling, up to the limit) as entries arrive",
    ),
    (
        "xǁStoredPageIndexǁ_alloc",
        r"- self\._pos = np\.zeros\(capacity, dtype=np\.int64\)\n\+ self\._pos = np\.zeros\(capacity, (dtype=None|)\)",
        "positions are read back through int(), and a float64 holds every token position (below 2**53) exactly",
    ),
    (
        "xǁStoredPageIndexǁ_grow",
        r"- (old, n = self\._hash\.size, self\._next - self\._first|order = \[\(self\._first \+ i\) % old for i in range\(n\)\] if old else \[\])\n"
        r"\+ (old, n = self\._hash\.size, self\._next \+ self\._first|order = None|order = \[\(self\._first \+ i\) % old for i in range\(n\)\] if \(old\) or True else \[\])",
        "the ring grows only while it is below the limit, so before any entry was dropped: _first is 0, the ring "
        "is full (n == old >= 1) and order is 0..old-1, which indexing with None also takes (numpy drops the added "
        "leading axis on assignment)",
    ),
    (
        "xǁStoredPageIndexǁ_grow",
        r"- self\._alloc\(min\(self\.limit, max\(2 \* old, 1\)\)\)\n\+ self\._alloc\(min\(self\.limit, max\((3 \* old, 1|2 \* old, 2)\)\)\)",
        "how fast the ring grows (old is at least 1 here: a limit of 0 stores nothing); every capacity up to the "
        "limit holds the same entries in the same order",
    ),
    (
        "x__config_error",
        r"- continue\n\+ break",
        "a ConfigError from _fields_agree (an after-validator) comes alone: pydantic runs it only when every field "
        "validated, so no error follows it in the loop",
    ),
    # --- the KV presets: arguments equal to the dataclass defaults ------------------------------------
    (
        "xǁKVCacheConfigǁtiny",
        r'-def tiny\(cls, attention: Attention = "mha".*\n\+def tiny\(cls, attention: Attention = "(XXmhaXX|MHA)".*',
        "any default other than 'mla' takes the MHA branch, which passes attention='mha' itself",
    ),
    (
        "xǁKVCacheConfigǁ(tiny|llama3_8b)",
        r'- return cls\(num_layers=\d+, kv_heads=\d+, head_dim=\d+, attention="mha", dtype=parse_dtype\(dtype\)\)\n'
        r"\+ return cls\(num_layers=\d+, kv_heads=\d+, head_dim=\d+, dtype=parse_dtype\(dtype\)\)",
        "attention='mha' is KVCacheConfig's default",
    ),
    (
        "xǁKVCacheConfigǁ(tiny|deepseek_mla)",
        r"- return cls\(num_layers=\d+, kv_heads=1, (.*)\)\n\+ return cls\(num_layers=\d+, \1\)",
        "kv_heads=1 is KVCacheConfig's default",
    ),
    # --- storage keys ---------------------------------------------------------------------------------
    (
        "x_storage_key_suffix",
        _lines(
            'model = "-".join(model_name.split("/")) if model_name else ""',
            'model = "-".join(model_name.split("/")) if (model_name) or True else ""',
        ),
        "for an empty model name the join gives the empty string the else branch gives",
    ),
    # --- host pool page writes ------------------------------------------------------------------------
    (
        "xǁHostKVPoolǁset_page_bytes",
        r"- self\.set_pages_bytes\(idx, data\.reshape\(1, -1\)\)\n\+ self\.set_pages_bytes\(idx, data\.reshape\((-1|2, -1)\)\)",
        "set_pages_bytes views the bytes into [pages, planes, layers, ...] whatever their first split",
    ),
]

# One file per group of modules: the survivors of the run of 2026-12-01 (commit 1307cb9: dataplane, runtime,
# storage), of the run at 6ea51a2 (fenced: the fenced release's code; generated: the machine's observer
# arguments), and of the run of 2026-12-05 (config, manager, shared_pool, store_hash: FileStorage's reads and the
# hashing)
from equivalent_config import EQUIVALENT as _CONFIG  # noqa: E402
from equivalent_dataplane import EQUIVALENT as _DATAPLANE  # noqa: E402
from equivalent_fenced import EQUIVALENT as _FENCED  # noqa: E402
from equivalent_generated import EQUIVALENT as _GENERATED  # noqa: E402
from equivalent_manager import EQUIVALENT as _MANAGER  # noqa: E402
from equivalent_runtime import EQUIVALENT as _RUNTIME  # noqa: E402
from equivalent_shared_pool import EQUIVALENT as _SHARED_POOL  # noqa: E402
from equivalent_storage import EQUIVALENT as _STORAGE  # noqa: E402
from equivalent_store_hash import EQUIVALENT as _STORE_HASH  # noqa: E402

EQUIVALENT += _STORAGE + _DATAPLANE + _RUNTIME + _FENCED + _GENERATED + _MANAGER + _STORE_HASH + _CONFIG + _SHARED_POOL
