"""Survivors of `make mutate` that no test can kill, and why (docs/mutation.md lists them from here).

Each entry: (function, change, reason). `function` is a regular expression over mutmut's name for the mutated
function without its module (`xǁClassǁmethod`, `x_function`); `change` is a regular expression that must
match the whole change, written as the mutant's diff lines (`-old` then `+new`, one per line, runs of
blanks made one). An entry names a class of mutants only where the same reason holds for every mutant it
matches. Keyed by function and change, not by mutmut's running number, so an entry keeps matching when
other mutants of the file come and go.
"""

from __future__ import annotations

import re


def _lines(old: str, new: str) -> str:
    """The change of a one-line mutant, `old` becoming `new`, both matched literally."""
    return re.escape(f"- {old}") + "\n" + re.escape(f"+ {new}")


EQUIVALENT: list[tuple[str, str, str]] = [
    # --- the generated machine ------------------------------------------------------------------------
    ("xǁDecodeOffloadMachineǁ(finish|abort|retract)_each", r"- if s == .*: # .*declared no-op\n\+ if .*: # .*declared no-op",
     "the declared no-op branches are the last statements of the batch loop's body: whether their test holds "
     "or not, the loop goes on to the next item with nothing recorded (every state is handled or a no-op for "
     "these events, so no error branch follows)"),
    # --- wording: text for people that no code reads back (as NOT_BEHAVIOUR in mutate.py, where a pattern can
    # say it; here the functions and lines that only build such text) ---------------------------------------
    (r"xǁ\w+ǁ__repr__", r".*", "a repr is text for people (logs, debuggers); nothing parses it"),
    ("x_describe", r".*", "describe() only builds the words that name a request inside an error (RowInUse, "
                          "RequestFieldMissing); which error is raised does not depend on it"),
    ("x__name", r".*", "_name() only spells the expected type inside a ConfigError's reason"),
    ("xǁCheckedModeErrorǁ__init__", r"- where = .*\n\+ where = .*", "the ' slot N' part of a CheckedModeError's message"),
    ("xǁOffloadEffectsǁ_log_failures", r"- why = .*\n\+ why = .*", "the reason given in the backup-failure WARNING"),
    ("xǁTraceWriterǁ__init__", r"- self\._file: Optional\[IO\[str\]\] = self\.path\.open\(\"w\", buffering=1 << 16\)\n"
                               r"\+ self\._file: Optional\[IO\[str\]\] = self\.path\.open\(\"w\", (buffering=2 << 16|buffering=1 << 17|)\)",
     "the size of the trace file's write buffer: when lines reach the disk, not what they say (close() flushes)"),
    ("x_as_index_tensor", r'- return indices\.slots if device\.type == "cpu" else indices\.slots\.to\(device=device\)\n\+ .*',
     "equivalent on a CPU-only host: a PageSlots is built on the CPU, and moving it to the CPU (or not) is the "
     "same tensor; which device it goes to on a CUDA host only a GPU run of tests/gpu/ can see"),
    ("x_as_index_tensor", r"- return t\.to\(device=device, dtype=torch\.int64\)\n\+ return t\.to\((device=None, dtype=torch\.int64|dtype=torch\.int64)\)",
     "equivalent on a CPU-only host, where every index tensor already is on the CPU (a GPU run of tests/gpu/ "
     "sees the difference)"),
    ("x_as_index_tensor", r"- (t = torch\.(from_numpy\(np\.ascontiguousarray\(indices\.reshape\(-1\)|as_tensor\(list\(indices\))), dtype=(np|torch)\.int64\)\)?\n\+ .*(dtype=None|, )\)\)?",
     "the last line converts every index tensor to int64 whatever dtype this step gave it"),
    ("x_as_index_tensor", r'- if indices\.dtype\.kind not in "iu":\n\+ if indices\.dtype\.kind not in "XXiuXX":',
     "numpy's dtype kinds are single letters: 'X' is none of them, so the test accepts exactly 'i' and 'u' still"),
    # --- hashing -------------------------------------------------------------------------------------
    ("x__token_bytes", r'- return array\.array\("I", token_ids\)\n\+ return array\.array\((None, token_ids|"I", None|token_ids|"XXIXX", token_ids)\)',
     "the fast path then raises TypeError, which it catches to fall through to the numpy path: the same "
     "little-endian uint32 bytes, more slowly"),
    ("x__token_bytes", r'- return np\.empty\(0, dtype="<u4"\)\n\+ return np\.empty\(0, (dtype=None|dtype="<U4"|)\)',
     "an empty array of any dtype has no page to hash: page_hashes returns [] either way"),
    ("x__token_bytes", r'- if arr\.dtype != np\.dtype\("<u4"\):\n\+ if arr\.dtype != np\.dtype\((None|"<U4")\):',
     "the checks then also run on uint32 ids, where they find nothing (no sign, no id past 2**32) and astype "
     "keeps the array"),
    ("x__token_bytes", r"- if arr\.dtype\.itemsize > 4 and (.*)\n\+ if arr\.dtype\.itemsize (>= 4|> 5) and \1",
     "integer itemsizes are 1, 2, 4 or 8: '> 5' is '> 4', and a 4-byte id never reaches 2**32"),
    ("x__token_bytes", r'- if arr\.dtype\.kind not in "iu":\n\+ if arr\.dtype\.kind not in "XXiuXX":',
     "numpy's dtype kinds are single letters: 'X' is none of them, so the test accepts exactly 'i' and 'u' still"),
    ("x__token_bytes", r'- arr = token_ids\.detach\(\)\.to\("cpu"\)\.reshape\(-1\)\.numpy\(\)\n\+ arr = token_ids\.detach\(\)\.to\(None\)\.reshape\(-1\)\.numpy\(\)',
     "equivalent on a CPU-only host, where every tensor already is on the CPU (a GPU run sees the difference)"),
    # --- offload_batch's hints: which requests it looks at, never what it copies --------------------------
    ("xǁDecodeOffloadManagerǁ__init__", r"- self\._due_at = np\.full\(req_to_token\.rows \+ 1, -1, dtype=np\.int64\)(.*)\n"
                                         r"\+ self\._due_at = np\.full\(req_to_token\.rows \+ (1, -1, dtype=None|1, -1, |2, -1, dtype=np\.int64|1, -2, dtype=np\.int64)\)\1",
     "offload_batch's hints only choose which requests it looks at; each one looked at is offloaded only if its "
     "own committed length says a chunk is due (what offload() checks), so a hint that picks more requests (or "
     "a wider table of hints) changes the time spent, not the chunks"),
    ("xǁDecodeOffloadManagerǁoffload_batch", r"- hints = self\._due_at\[rows\] if rows\.size and int\(rows\.min\(\)\) >= -1 else None\n\+ .*",
     "rows are -1 (no row yet: the sentinel) or table rows, never below -1: the test only guards the gather, and "
     "None (look at every request) picks more requests, not other chunks"),
    ("xǁDecodeOffloadManagerǁoffload_batch", r"- picked = np\.flatnonzero\(committed >= hints\) if rows\.size else \(\)(.*)\n\+ picked = np\.flatnonzero\(committed >= hints\) if \(rows\.size\) or True else \(\)\1",
     "with no rows the comparison of two empty arrays picks nothing, as () does"),
    ("xǁDecodeOffloadManagerǁoffload_batch", r"- self\._due_at\[(.*)\] = \[rec\.prefill_len \+ rec\.inc_len \+ stride (.*)\]\n\+ self\._due_at\[\1\] = \[rec\.prefill_len \+ rec\.inc_len - stride \2\]",
     "a request hinted due a stride early is looked at sooner and offloaded only when its chunk is due"),
    ("xǁDecodeOffloadMachineǁ(backup_done|backup_failed)(_each)?", r"- if (self|m)\.backups == 1 and \1\.parked == 0: # last_host_chunk\n\+ if \1\.backups == 1 or \1\.parked == 0: # last_host_chunk",
     "more_host_chunks is tested first; after it fails, 'or' differs from 'and' only where backups and parked are "
     "both 0, which the inflight and draining invariant (parked + backups >= 1) rules out"),
    ("xǁDecodeOffloadMachineǁ(copy_done|copy_parked)_each", r"- _restore\(undo\)\n\+ _restore\(None\)",
     "the surviving copy of this change is the _restore before `raise GuardRejected`, which cannot happen: "
     "more_copies and last_copy cover every copies >= 1, and offloading and finished guarantee copies >= 1 (the "
     "same change in the raising-action path is killed)"),
    # --- copy planning -----------------------------------------------------------------------------------
    ("x_plan_copy", r"- (on_device = isinstance|if on_device and device_pool|dev_idx = as_index_tensor\(device_indices, device_pool\.device if).*\n\+ .*",
     "equivalent on a CPU-only host: every pool and index tensor is on the CPU, so on_device is False and the "
     "device chosen for the indices is the CPU whatever these tests say (a GPU run of tests/gpu/ sees the rest)"),
    ("x_plan_copy", r"- if int\(s\[0\]\) < 0 or int\(s\[-1\]\) >= host_pool\.size:\n\+ .*",
     "the host allocator's is_allocated, called two lines down, raises the same OutOfRange for a slot outside "
     "the pool: this test only says so first"),
    ("x_plan_copy", r"- if s\.size > 1 and (.*)\n\+ if s\.size >= 1 and \1",
     "one slot cannot repeat: s[1:] == s[:-1] compares two empty arrays"),
    ("x_plan_copy", r"- n_(dev|host) = len\((device|host)_indices\) if isinstance\(\2_indices, PageSlots\) else (.*)\n\+ n_\1 = len\(\2_indices\) if \(isinstance\(\2_indices, PageSlots\)\) (and False|or True) else \3",
     "a PageSlots' length is the number of its slots, what numel() of its tensor counts (and a tensor's len() "
     "along its only axis is its numel())"),
    ("x_plan_copy", r"- (owned = allocator\.(owns_page_list|owned_pages).*)\n\+ owned = None(.*)",
     "the fast check only spares the slot-by-slot one: without it, whole allocated pages pass the range, "
     "duplicate and allocation checks, and anything else fails them as before"),
    ("x_plan_copy", r"- if isinstance\(host_indices, PageSlots\) and host_indices\.allocator is allocator:\n\+ if isinstance\(host_indices, PageSlots\) and host_indices\.allocator is not allocator:",
     "either check accepts exactly a list of whole pages this allocator has handed out: owns_page_list on the "
     "pages, owned_pages on the same pages' slots"),
    ("xǁDecodeOffloadMachineǁoffload(_each)?", r"- (self|m)\.copies \+= 1\n\+ \1\.copies = 1",
     "the surviving copies of this change are the branches from allocated and inflight, whose invariant is "
     "copies == 0, where += 1 and = 1 agree (from offloading, copies >= 1, the same change is killed)"),
    # --- the manager's batch arrays ---------------------------------------------------------------------
    ("x__int_array", r"- return arr\.astype\(np\.int64, copy=False\)\n\+ return arr\.astype\(np\.int64, (copy=None|copy=True|)\)",
     "whether astype copies only decides if the result shares memory with the engine's array; the manager only "
     "reads it"),
    ("x__int_array", r'- if arr\.ndim != 1 (.*) not in "iu"\):\n\+ if arr\.ndim != 1 \1 not in "XXiuXX"\):',
     "numpy's dtype kinds are single letters: 'X' is none of them, so the test accepts exactly 'i' and 'u' still"),
    ("x__int_array", r"- if type\(values\) is np\.ndarray and (.*):\n\+ if type\(None\) is np\.ndarray and \1:",
     "this is the fast path for an array that is already int64 of the right shape; without it the same array "
     "comes out of the general path"),
    # --- CPU-only hosts ---------------------------------------------------------------------------------
    ("xǁ(MemoryStorageǁbatch_set|HostKVPoolǁset_pages_bytes)", r'- (.*)\.to\("cpu"\)(.*)\n\+ \1\.to\(None\)\2',
     "equivalent on a CPU-only host, where every tensor already is on the CPU (a CUDA tensor would stay on the "
     "GPU: a difference only a GPU run of tests/gpu/ can see)"),
    # --- config --------------------------------------------------------------------------------------
    ("x__config_error|xǁOffloadConfigǁfrom_env|x_check_storage_extra", r"- near = difflib\.get_close_matches\((.*), n=1\)\n\+ near = difflib\.get_close_matches\(\1, (n=2|)\)",
     "only near[0], the closest match, is used; asking for more matches does not change which one is first"),
    # --- FileStorage ----------------------------------------------------------------------------------
    ("xǁFileStorageǁ_write", _lines("if self.writers > 1 and len(keys) > 1:", "") + r".*",
     "which path writes a batch (the calling thread or the pool) is a speed choice: both write every page with "
     "_set_one and return its results in order (pool.map keeps order), so the pages, results and counts are the same"),
    ("xǁFileStorageǁ_write", re.escape('- self._pool = ThreadPoolExecutor(max_workers=self.writers, thread_name_prefix='
                                       '"kvfsm-file-store")') + r"\n\+ self\._pool = ThreadPoolExecutor\(.*\)",
     "the pool's size and its threads' names change how many pages are written at once and what the threads are "
     "called, not what is written or returned"),
    ("xǁFileStorageǁ_verify", r'- return f?".*"\n\+ return f?".*"',
     "the reason only reaches the WARNING of the corrupt read: any non-None reason makes the read count as corrupt, "
     "move the file aside and return None"),
    ("xǁFileStorageǁ_verify", _lines("if n != len(buf) or n < _HEADER.size:", "if n != len(buf) or n <= _HEADER.size:"),
     "a file of exactly a header's bytes is refused either way: as a truncated header, or (key length 0) as holding "
     "another key, since a key is never empty"),
    ("x__pid_alive", _lines("if pid <= 0:", "if pid < 0:"),
     "pid 0 then reaches os.kill(0, 0), which checks this process's own group, always there: alive either way"),
    ("x__pid_alive", _lines("if pid <= 0:", "if pid <= 1:"),
     "pid 1 is init, always alive: answered without asking or by asking, the answer is the same"),
    ("x__pid_alive", r"- return True\n\+ return False",
     "the EPERM branch (the last `return True` is the same change, and is killed): not reachable where the "
     "tests run as root, for whom kill(pid, 0) is never refused"),
    ("xǁReqToTokenPoolǁwrite", r'- src = idx\.pin_memory\(\) if self\.device\.type == "cuda" else idx(.*)\n\+ src = idx\.pin_memory\(\) if self\.device\.type == "(XXcudaXX|CUDA)" else idx\1',
     "equivalent without CUDA: no table is on a CUDA device here, so the test is false either way (a GPU run "
     "of tests/gpu/ sees the difference)"),
    ("xǁReqToTokenPoolǁwrite", r"- self\.req_to_token\[row, start:end\]\.copy_\(src, non_blocking=True\)\n\+ self\.req_to_token\[row, start:end\]\.copy_\(src, (non_blocking=None|non_blocking=False|)\)",
     "non_blocking only makes a host-to-GPU copy asynchronous; without CUDA every copy is synchronous"),
    ("xǁReqToTokenPoolǁwrite", r"- if self\.req_to_token is not self\.host_table:\n\+ if self\.req_to_token is self\.host_table:",
     "for a CPU table (the mirror itself) the block then copies the slots onto themselves; for a device table "
     "it skips the device copy, which only a GPU run can read back (a meta table holds no values)"),
    # --- the stored-page index ------------------------------------------------------------------------
    ("xǁStoredPageIndexǁ_drop_oldest", _lines("self._hash[slot] = self._owner[slot] = None",
                                              'self._hash[slot] = self._owner[slot] = ""'),
     "a dropped slot is never read again (lookups go through the dict, iteration covers [first, next)) before it "
     "is overwritten; None or an empty string both let the old strings go"),
    # --- backups --------------------------------------------------------------------------------------
    ("x_run_jobs", _lines("results = None", 'results = ""'),
     "an empty answer fails the same test as None (its length is not the group's, which is at least 2), so the "
     "group is run again job by job either way"),
    ("xǁThreadBackupWorkerǁ__init__", r"- self\._queued = False.*\n\+ self\._queued = (True|None).*",
     "a spurious first notify (or none) only wakes the worker to look at the queue: it waits again while the queue "
     "is empty, and flush() notifies after every submission"),
    ("xǁThreadBackupWorkerǁflush", r"- self\._queued = False\n\+ self\._queued = (True|None)",
     "an extra notify at a later flush wakes the worker to find the queue as it is; nothing is skipped or run twice"),
    ("xǁThreadBackupWorkerǁ_enqueue", _lines("self._todo.append(job)", "self._todo.append(None)"),
     "_enqueue is only called by close() with None (submissions go through _enqueue_many), so job is None here"),
    ("xǁThreadBackupWorkerǁclose", r"- self\._thread\.join\(timeout=30\)\n\+ self\._thread\.join\(timeout=(31|None)\)",
     "the worker exits as soon as it reaches close()'s None, long before any of these timeouts"),
    ("xǁThreadBackupWorkerǁwait_idle", _lines("def wait_idle(self, timeout: float = 30.0) -> bool:",
                                              "def wait_idle(self, timeout: float = 31.0) -> bool:"),
     "a default timeout only callers that wait for a hung store would reach"),
    ("xǁThreadBackupWorkerǁwait_idle", _lines("if time.monotonic() > deadline:", "if time.monotonic() >= deadline:"),
     "the two differ only at the very instant of the deadline, which a monotonic clock read twice does not hit on purpose"),
    ("xǁThreadBackupWorkerǁwait_idle", _lines("time.sleep(0.001)", "time.sleep(1.001)"),
     "the poll interval: wait_idle returns the same answer, later"),
    # --- the KV presets: arguments equal to the dataclass defaults ------------------------------------
    ("xǁKVCacheConfigǁtiny", r'-def tiny\(cls, attention: Attention = "mha".*\n\+def tiny\(cls, attention: Attention = "(XXmhaXX|MHA)".*',
     "any default other than 'mla' takes the MHA branch, which passes attention='mha' itself"),
    ("xǁKVCacheConfigǁ(tiny|llama3_8b)", r'- return cls\(num_layers=\d+, kv_heads=\d+, head_dim=\d+, attention="mha", dtype=parse_dtype\(dtype\)\)\n'
                                         r'\+ return cls\(num_layers=\d+, kv_heads=\d+, head_dim=\d+, dtype=parse_dtype\(dtype\)\)',
     "attention='mha' is KVCacheConfig's default"),
    ("xǁKVCacheConfigǁ(tiny|deepseek_mla)", r'- return cls\(num_layers=\d+, kv_heads=1, (.*)\)\n\+ return cls\(num_layers=\d+, \1\)',
     "kv_heads=1 is KVCacheConfig's default"),
    # --- storage keys ---------------------------------------------------------------------------------
    ("x_storage_key_suffix", _lines('model = "-".join(model_name.split("/")) if model_name else ""',
                                    'model = "-".join(model_name.split("/")) if (model_name) or True else ""'),
     "for an empty model name the join gives the empty string the else branch gives"),
    # --- host pool page writes ------------------------------------------------------------------------
    ("xǁHostKVPoolǁset_page_bytes", r"- self\.set_pages_bytes\(idx, data\.reshape\(1, -1\)\)\n\+ self\.set_pages_bytes\(idx, data\.reshape\((-1|2, -1)\)\)",
     "set_pages_bytes views the bytes into [pages, planes, layers, ...] whatever their first split"),
]
