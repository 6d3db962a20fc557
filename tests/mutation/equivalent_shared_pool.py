"""Survivors of `make mutate` in shared_memory.py that no CPU test kills: one equivalent, and the pinning
mutants only a CUDA host tells apart (their reasons say so: the GPU pass runs them). Merged into
equivalent.EQUIVALENT."""

from __future__ import annotations

from equivalent_helpers import _lines  # noqa: F401

EQUIVALENT: list[tuple[str, str, str]] = [
    (
        "x_shared_buffer",
        _lines('fd = os.memfd_create("kvfsm-host-pool", os.MFD_CLOEXEC)', 'fd = os.memfd_create("kvfsm-host-pool", )'),
        "os.memfd_create's flags default to os.MFD_CLOEXEC (memfd_create(name, flags=1)): the same call",
    ),
]

# NOT equivalent: told apart only on a CUDA host (pinning). Reasons match mutate.NEEDS_CUDA, so the CPU run marks
# them for the GPU pass. Killed on an H200 by
# tests/mutation/test_kills_shared_pool.py::test_asking_for_a_pinned_shared_pool_gives_pinned_memory_or_an_error_naming_cuda
# (26-35) and ::test_dropped_pinned_shared_pools_give_their_page_locks_back (36-40, _unregister 1); 26-35 also by
# tests/dataplane/test_process_storage.py::test_a_shared_pinned_pool_takes_cuda_copies_and_the_child_stores_them.
# Both files are in tests/mutation/gpu_pass.py's SUITES.
NEEDS_CUDA: list[tuple[str, str, str]] = [
    (
        "x_shared_buffer",
        r"- rc = torch\.cuda\.cudart\(\)\.cudaHostRegister\(buf\.data_ptr\(\), nbytes, _CUDA_HOST_REGISTER_PORTABLE_MAPPED\)\n"
        r"\+ rc = torch\.cuda\.cudart\(\)\.cudaHostRegister\((None, nbytes, _CUDA_HOST_REGISTER_PORTABLE_MAPPED|"
        r"buf\.data_ptr\(\), None, _CUDA_HOST_REGISTER_PORTABLE_MAPPED|buf\.data_ptr\(\), nbytes, None|"
        r"nbytes, _CUDA_HOST_REGISTER_PORTABLE_MAPPED|buf\.data_ptr\(\), _CUDA_HOST_REGISTER_PORTABLE_MAPPED|"
        r"buf\.data_ptr\(\), nbytes, )\)",
        "needs CUDA: on a host without CUDA torch.cuda.cudart() raises before the arguments matter; on a CUDA host "
        "the call is refused (TypeError) and no pinned shared pool can be made (test_kills_shared_pool.py, GPU run)",
    ),
    (
        "x_shared_buffer",
        r"- if int\(rc\) != 0:\n\+ if (int\(None\) != 0|int\(rc\) == 0|int\(rc\) != 1):",
        "needs CUDA: reached only after cudaHostRegister ran, which on a host without CUDA raises first; on a CUDA "
        "host a successful registration is refused or TypeError (test_kills_shared_pool.py, GPU run)",
    ),
    (
        "x_shared_buffer",
        r"- weakref\.finalize\(mapping, _unregister, buf\.data_ptr\(\)\) # last registered, first run: before the close\n"
        r"\+ weakref\.finalize\((None, _unregister, buf\.data_ptr\(\)|mapping, None, buf\.data_ptr\(\)|"
        r"mapping, _unregister, None|_unregister, buf\.data_ptr\(\)|mapping, buf\.data_ptr\(\)|"
        r"mapping, _unregister, )\) # last registered, first run: before the close",
        "needs CUDA: the unregistering finalizer is set only for a pinned pool; on a CUDA host finalize(None, ...) fails "
        "the pool at once, and the others leave a dropped pool's pages registered and the next pinned shared pool at that address fails with error 712 "
        "(test_dropped_pinned_shared_pools_give_their_page_locks_back, GPU run)",
    ),
    (
        "x__unregister",
        _lines("torch.cuda.cudart().cudaHostUnregister(ptr)", "torch.cuda.cudart().cudaHostUnregister(None)"),
        "needs CUDA: runs only as the finalizer of a pinned pool; on a CUDA host the pages stay registered and the next "
        "pinned shared pool at that address fails with error 712 (test_dropped_pinned_shared_pools_give_their_page_locks_back)",
    ),
]

EQUIVALENT += NEEDS_CUDA
