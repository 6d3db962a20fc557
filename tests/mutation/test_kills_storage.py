"""Tests written to kill survivors of `make mutate` in the storage modules (docs/mutation.md)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataplane.helpers import fill_random, make_host_pool  # noqa: E402

from timing import scaled  # noqa: E402

from kvfsm.dataplane import FileStorage, KVCacheConfig, page_hashes  # noqa: E402
from kvfsm.dataplane.storage import file as storage_mod  # noqa: E402
from kvfsm.dataplane.storage.file import _SIDECAR, _SIDECAR_MAX  # noqa: E402


def _pages(n: int, size: int = 1000, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]


def _keys(n: int) -> list[str]:
    return page_hashes(list(range(4 * n)), 4)


def _dead_pid() -> int:
    pid = 2**22 + 12345  # above any pid_max here: no such process
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except OSError:
            pass
        pid += 1


def _rewrite_sidecar(fs: FileStorage, key: str, page: torch.Tensor, fmt: bytes) -> str:
    """Replace `key`'s sidecar with a well-formed one (right crcs and lengths) recording `fmt`."""
    side = fs.sidecar_of(fs.path_of(key))
    Path(side).write_bytes(FileStorage._sidecar((key + fs.suffix).encode(), page.numpy(), fmt))
    return side


# --- construction ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dims", [(2, 4), (2, 4, 4, 4), (2, 3.0, 4), (2, 0, 4), (3, 2, 4), (0, 2, 4)])
def test_page_dims_must_be_three_positive_ints_with_one_or_two_planes(tmp_path: Path, dims: tuple) -> None:
    """page_dims reorders and is recorded in every sidecar: a wrong geometry must be refused at construction."""
    with pytest.raises(ValueError, match="page_dims"):
        FileStorage(tmp_path, page_dims=dims)  # type: ignore[arg-type]


def test_the_smallest_page_dims_and_page_size_are_accepted_and_round_trip(tmp_path: Path) -> None:
    """One plane (MLA), one layer and one token, and a one-byte page, are legal geometries."""
    (k,) = _keys(1)
    fs = FileStorage(tmp_path / "a", "m", layout="page_first", page_dims=(1, 1, 1))
    assert fs.page_dims == (1, 1, 1)
    (p,) = _pages(1, size=8)
    assert fs.batch_set([k], [p]) == [True]
    (got,) = fs.batch_get([k])
    assert got is not None and torch.equal(got, p)
    one = FileStorage(tmp_path / "b", "m", page_nbytes=1)
    assert one.page_nbytes == 1
    Path(one.path_of(k)).write_bytes(b"\x07")  # an SGLang page of one byte, no sidecar
    (got,) = one.batch_get([k])
    assert got is not None and got.tolist() == [7] and one.unverified_reads == 1


@pytest.mark.parametrize("nbytes", [0, -1, 1.5])
def test_page_nbytes_must_be_a_positive_int(tmp_path: Path, nbytes: object) -> None:
    """A page size of zero (or not an int) would accept or refuse foreign pages for no reason."""
    with pytest.raises(ValueError, match="page_nbytes"):
        FileStorage(tmp_path, page_nbytes=nbytes)  # type: ignore[arg-type]


def test_a_torch_dtype_is_recorded_by_its_bare_name_and_agrees_with_the_string(tmp_path: Path) -> None:
    """dtype=torch.bfloat16 and dtype="bfloat16" are one format: the stores read each other's pages."""
    a = FileStorage(tmp_path, "m", dtype=torch.bfloat16)
    assert a.dtype == "bfloat16" and a.format == "layout=layer_first;dtype=bfloat16"
    ks, ps = _keys(2), _pages(2)
    assert a.batch_set(ks, ps) == [True, True]
    b = FileStorage(tmp_path, "m", dtype="bfloat16")
    got = b.batch_get(ks)
    assert all(g is not None and torch.equal(g, p) for g, p in zip(got, ps)) and b.stats.reads_ok == 2


# --- the pool's geometry and dtype, learned from a host write ------------------------------------------


def _bf16_pool():  # type: ignore[no-untyped-def]
    pool = make_host_pool(
        KVCacheConfig(num_layers=3, head_dim=4, kv_heads=1, dtype=torch.bfloat16), slots=8, page_size=2
    )
    fill_random(pool.kv_buffer, seed=3)
    assert pool.alloc_pages(3) == [0, 1, 2]
    return pool


def test_a_host_write_records_the_pools_geometry_and_dtype_so_other_formats_do_not_read_it(tmp_path: Path) -> None:
    """A store without page_dims or dtype learns both from the pool it backs up, records them in the sidecar,
    and a store of another geometry or dtype (same page size) does not take those pages."""
    pool = _bf16_pool()
    (k,) = _keys(1)
    w = FileStorage(tmp_path, "m")
    assert w.batch_set_from_host([k], pool, pool.slots_of([1])) == [True]
    assert w.page_dims == (2, 3, 2) and w.dtype == "bfloat16"
    want = pool.get_pages_bytes(pool.slots_of([1]))[0]
    same = FileStorage(tmp_path, "m", page_dims=(2, 3, 2), dtype=torch.bfloat16)
    (got,) = same.batch_get([k])
    assert got is not None and torch.equal(got, want)
    assert FileStorage(tmp_path, "m", page_dims=(2, 3, 2), dtype=torch.float16).batch_get([k]) == [None]
    assert FileStorage(tmp_path, "m", page_dims=(2, 2, 3), dtype=torch.bfloat16).batch_get([k]) == [None]


def test_a_host_write_into_a_store_of_the_pools_page_dims_is_accepted(tmp_path: Path) -> None:
    """A store built with the pool's page_dims backs the pool up (only a disagreeing geometry is refused)."""
    pool = _bf16_pool()
    ks = _keys(2)
    fs = FileStorage(tmp_path, "m", page_dims=(2, 3, 2), dtype="bfloat16")
    assert fs.batch_set_from_host(ks, pool, pool.slots_of([0, 2])) == [True, True]
    assert fs.page_dims == (2, 3, 2) and fs.dtype == "bfloat16"
    with pytest.raises(ValueError, match="page_dims"):
        FileStorage(tmp_path / "o", "m", page_dims=(2, 2, 3)).batch_set_from_host(ks[:1], pool, pool.slots_of([0]))


def test_a_released_host_pool_keeps_its_kv_dtype() -> None:
    """release() drops the buffer's memory, not its type: what asks the pool's buffer dtype afterwards still
    sees the configured KV dtype."""
    pool = make_host_pool(KVCacheConfig(num_layers=1, head_dim=4, dtype=torch.bfloat16), slots=4, page_size=2)
    pool.release()
    assert pool.released and pool.kv_buffer.numel() == 0 and pool.kv_buffer.dtype == torch.bfloat16


def test_an_mla_config_must_have_one_kv_head() -> None:
    """MLA keeps one latent per token: a second head would mis-size every page."""
    with pytest.raises(ValueError, match="kv_heads must be 1"):
        KVCacheConfig(num_layers=2, head_dim=8, kv_heads=2, attention="mla")
    assert KVCacheConfig(num_layers=2, head_dim=8, kv_heads=2, attention="mha").kv_heads == 2


# --- formats -------------------------------------------------------------------------------------------


def test_a_format_without_a_layout_means_layer_first_on_either_side() -> None:
    """A format string that names no layout (an older or minimal writer) is layer_first, whichever side of
    the comparison it is on."""
    agree = storage_mod._formats_agree
    assert agree("dims=2x3x4", "layout=layer_first;dims=2x3x4")
    assert agree("layout=layer_first;dims=2x3x4", "dims=2x3x4")
    assert agree("", "") and agree("", "layout=layer_first") and agree("layout=layer_first", "")
    assert not agree("", "layout=page_first") and not agree("layout=page_first", "")


def test_fields_only_one_side_records_are_not_compared(tmp_path: Path) -> None:
    """A store that knows its dtype reads pages whose sidecar records none (and the reverse), and a sidecar
    without a layout is read as layer_first."""
    assert storage_mod._formats_agree("layout=layer_first;dtype=bfloat16", "layout=layer_first")
    assert storage_mod._formats_agree("layout=layer_first", "layout=layer_first;dtype=bfloat16")
    ks, ps = _keys(2), _pages(2)
    plain = FileStorage(tmp_path, "m")
    assert plain.batch_set(ks, ps) == [True, True]
    typed = FileStorage(tmp_path, "m", dtype="bfloat16")
    got = typed.batch_get(ks[:1])
    assert got[0] is not None and torch.equal(got[0], ps[0])
    _rewrite_sidecar(plain, ks[1], ps[1], b"")  # a sidecar that records no format at all
    got = FileStorage(tmp_path, "m").batch_get(ks[1:])
    assert got[0] is not None and torch.equal(got[0], ps[1])
    assert FileStorage(tmp_path, "m", layout="page_first", page_dims=(2, 5, 4)).batch_get(ks[1:]) == [None]


def test_a_sidecar_format_with_bytes_outside_ascii_is_compared_not_raised(tmp_path: Path) -> None:
    """A sidecar's format is decoded leniently: a field of non-ASCII bytes it alone records does not stop
    the page from reading back (a read never raises for what is in a file)."""
    (k,), (p,) = _keys(1), _pages(1)
    fs = FileStorage(tmp_path, "m")
    assert fs.batch_set([k], [p]) == [True]
    _rewrite_sidecar(fs, k, p, fs.format.encode() + b";note=caf\xe9")
    (got,) = FileStorage(tmp_path, "m").batch_get([k])
    assert got is not None and torch.equal(got, p)


def test_a_sidecar_of_exactly_the_largest_size_is_read_whole_and_accepted(tmp_path: Path) -> None:
    """_SIDECAR_MAX is the largest sidecar accepted, inclusive: one of exactly that many bytes checks out."""
    (k,), (p,) = _keys(1), _pages(1)
    fs = FileStorage(tmp_path, "m")
    assert fs.batch_set([k], [p]) == [True]
    base = fs.format.encode() + b";pad="
    kb = (k + fs.suffix).encode()
    pad = _SIDECAR_MAX - _SIDECAR.size - len(kb) - len(base)
    side = _rewrite_sidecar(fs, k, p, base + b"x" * pad)
    assert os.path.getsize(side) == _SIDECAR_MAX
    reader = FileStorage(tmp_path, "m")
    (got,) = reader.batch_get([k])
    assert got is not None and torch.equal(got, p) and reader.stats.reads_corrupt == 0


# --- reads -------------------------------------------------------------------------------------------


def test_a_sidecar_that_cannot_be_read_is_a_counted_miss(tmp_path: Path) -> None:
    """A sidecar open that fails with an OSError other than not-found reports the page missing and counts it."""
    (k,), (p,) = _keys(1), _pages(1)
    fs = FileStorage(tmp_path, "m")
    assert fs.batch_set([k], [p]) == [True]
    side = fs.sidecar_of(fs.path_of(k))
    os.unlink(side)
    os.mkdir(side)  # opening it raises IsADirectoryError
    reader = FileStorage(tmp_path, "m")
    assert reader.batch_get([k]) == [None]
    assert (reader.stats.reads_missing, reader.stats.reads_corrupt, reader.stats.reads_ok) == (1, 0, 0)


def test_a_checked_read_teaches_an_unknown_page_size_but_never_overrides_a_known_one(tmp_path: Path) -> None:
    """A store that does not know the page size learns it from its first checked read (so SGLang's pages are
    then length-checked against it); one told the size keeps it whatever size a checked page has."""
    ks = _keys(3)
    writer = FileStorage(tmp_path, "m")
    p_big, p_small = _pages(1, size=1000)[0], _pages(1, size=500, seed=1)[0]
    assert writer.batch_set(ks[:1], [p_big]) == [True]
    assert FileStorage(tmp_path, "m").batch_set(ks[1:2], [p_small]) == [True]
    foreign = _pages(1, size=1000, seed=2)[0]
    Path(writer.path_of(ks[2])).write_bytes(foreign.numpy().tobytes())  # SGLang's: no sidecar
    learner = FileStorage(tmp_path, "m")
    assert learner.batch_get(ks[:1])[0] is not None and learner.page_nbytes == 1000
    (got,) = learner.batch_get(ks[2:])
    assert got is not None and torch.equal(got, foreign) and learner.unverified_reads == 1
    told = FileStorage(tmp_path, "m", page_nbytes=1000)
    assert told.batch_get(ks[1:2])[0] is not None and told.page_nbytes == 1000
    (got,) = told.batch_get(ks[2:])
    assert got is not None and torch.equal(got, foreign)


def test_a_foreign_page_that_reads_short_of_its_stat_size_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page without a sidecar whose read comes up shorter than its size at open (being rewritten) is
    refused even when the bytes read are a page's worth."""
    (k,), (p,) = _keys(1), _pages(1)
    fs = FileStorage(tmp_path, "m", page_nbytes=1000)
    Path(fs.path_of(k)).write_bytes(p.numpy().tobytes())
    real_fstat = os.fstat
    monkeypatch.setattr(storage_mod.os, "fstat", lambda fd: types.SimpleNamespace(st_size=real_fstat(fd).st_size + 4))
    got = fs.batch_get([k])
    monkeypatch.undo()
    assert got == [None] and fs.stats.reads_ok == 0 and fs.stats.reads_corrupt == 1


def test_a_layer_first_stores_file_order_is_the_canonical_order(tmp_path: Path) -> None:
    """For layer_first the page file holds the canonical bytes as they are, even when page_dims are known."""
    fs = FileStorage(tmp_path, "m", page_dims=(2, 3, 4))
    payload = _pages(1, size=2 * 3 * 4 * 5)[0].numpy()
    out = fs._to_file_order(payload)
    assert out.shape == payload.shape and (out == payload).all()


def test_a_page_first_stores_file_order_is_a_flat_byte_array(tmp_path: Path) -> None:
    """The reordered page is handed on as flat bytes, as the canonical page is (one byte string per file)."""
    fs = FileStorage(tmp_path, "m", layout="page_first", page_dims=(2, 3, 4))
    payload = _pages(1, size=2 * 3 * 4 * 5)[0].numpy()
    out = fs._to_file_order(payload)
    assert out.shape == payload.shape
    assert (out.reshape(2, 4, 3, 5) == payload.reshape(2, 3, 4, 5).transpose(0, 2, 1, 3)).all()


def test_a_page_first_page_of_three_tokens_splits_exactly(tmp_path: Path) -> None:
    """The page-size check is integer arithmetic: a page of three tokens (1/3 not exact in floating point) is
    not refused as a size that does not split."""
    (k,) = _keys(1)
    fs = FileStorage(tmp_path, "m", layout="page_first", page_dims=(1, 1, 3))
    (p,) = _pages(1, size=6)
    assert fs.batch_set([k], [p]) == [True]
    (got,) = fs.batch_get([k])
    assert got is not None and torch.equal(got, p)


# --- writes where hard links are not supported ---------------------------------------------------------


def test_a_write_on_a_file_system_without_hard_links_publishes_by_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where os.link is not supported the page is published with os.replace, counted as written, and reads
    back verified with no temp file left."""

    def no_links(src: str, dst: str) -> None:
        raise OSError(errno.EPERM, "hard links not supported here")

    ks, ps = _keys(2), _pages(2)
    fs = FileStorage(tmp_path, "m")
    monkeypatch.setattr(storage_mod.os, "link", no_links)
    assert fs.batch_set(ks, ps) == [True, True]
    monkeypatch.undo()
    assert (fs.stats.writes_ok, fs.stats.writes_skipped, fs.stats.writes_failed) == (2, 0, 0)
    assert fs.page_nbytes == 1000
    assert sorted(os.listdir(tmp_path)) == sorted(
        os.path.basename(x) for k in ks for x in (fs.path_of(k), fs.sidecar_of(fs.path_of(k)))
    )
    got = FileStorage(tmp_path, "m").batch_get(ks)
    assert all(g is not None and torch.equal(g, p) for g, p in zip(got, ps))


# --- the start-up sweep --------------------------------------------------------------------------------


class _Listing:
    """os.scandir's result, with its entries in a chosen order."""

    def __init__(self, entries: list[os.DirEntry], reverse: bool) -> None:
        self._entries = sorted(entries, key=lambda e: e.name, reverse=reverse)

    def __enter__(self) -> _Listing:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._entries)


@pytest.mark.parametrize("reverse", [False, True])
def test_the_sweep_goes_on_past_temp_files_that_are_not_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reverse: bool
) -> None:
    """SGLang's temp files and this process's own are skipped, not an end of the sweep: every stale temp of a
    dead writer goes, in whatever order the directory lists its entries."""
    dead, old = _dead_pid(), time.time() - 3600
    names = {
        "stale": f".k.bin.{dead}.0123456789ab.0.tmp",
        "sglang_a": ".0-sglang.tmp",
        "sglang_z": ".z-sglang.tmp",
        "own": f".m.bin.{os.getpid()}.0123456789ab.0.tmp",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (old, old))
    real_scandir = os.scandir

    def listing(path: str) -> _Listing:
        with real_scandir(path) as it:
            return _Listing(list(it), reverse)

    monkeypatch.setattr(storage_mod.os, "scandir", listing)
    assert FileStorage(tmp_path).swept_temps == 1
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == sorted(v for k, v in names.items() if k != "stale")


def _live_child() -> subprocess.Popen[bytes]:
    """A child that a signal would end: its handlers are the defaults (a shell's nohup, or a runner that ignores
    SIGHUP, passes the ignoring on to its children), set before it says it is ready."""
    child = subprocess.Popen([sys.executable, "-c", READY_CHILD], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    return child


READY_CHILD = (
    "import signal, sys, time\n"
    "for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM): signal.signal(s, signal.SIG_DFL)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_the_sweep_asks_whether_a_writer_lives_without_signalling_it(tmp_path: Path) -> None:
    """The liveness probe is signal 0: a live writer (here a child of ours) is left running, and its stale
    temp file stays."""
    writer = _live_child()
    try:
        name = f".k.bin.{writer.pid}.0123456789ab.0.tmp"
        (tmp_path / name).write_bytes(b"x")
        old = time.time() - 3600
        os.utime(tmp_path / name, (old, old))
        assert FileStorage(tmp_path).swept_temps == 0
        with pytest.raises(subprocess.TimeoutExpired):
            writer.wait(timeout=scaled(0.3))  # a signal that ends it would have ended it by now
        assert os.listdir(tmp_path) == [name]
    finally:
        writer.kill()
        writer.wait()


def test_a_live_process_is_only_asked_whether_it_lives() -> None:
    """_pid_alive sends signal 0, which checks the pid and delivers nothing: the process it asks about lives on."""
    from kvfsm.dataplane.storage.file import _pid_alive

    child = _live_child()
    try:
        assert _pid_alive(child.pid)
        with pytest.raises(subprocess.TimeoutExpired):  # any signal it was sent would end it within this wait
            child.wait(timeout=scaled(0.3))
    finally:
        child.kill()
        child.wait()
