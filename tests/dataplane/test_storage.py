"""Storage backends: atomic FileStorage (raw page files + checksum sidecars, SGLang HiCacheFile compatible);
prefix existence; per-page failure; unverified foreign pages; FaultyStorage."""

from __future__ import annotations

import errno
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvfsm.dataplane import FaultyStorage, FileStorage, MemoryStorage, StorageBackend, page_hashes, storage_key_suffix
from kvfsm.dataplane.storage import file as storage_mod


def pages(n: int, size: int = 1000, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]


def keys(n: int) -> list[str]:
    return page_hashes(list(range(4 * n)), 4)


def test_protocol_and_suffix(tmp_path: Path) -> None:
    for backend in (FileStorage(tmp_path), MemoryStorage(), FaultyStorage(MemoryStorage())):
        assert isinstance(backend, StorageBackend)
    assert storage_key_suffix("meta-llama/Llama-3-8B", 1, 4) == "_meta-llama-Llama-3-8B_1_4"
    assert storage_key_suffix("deepseek-ai/DeepSeek-V3", 1, 4, is_mla=True) == "_deepseek-ai-DeepSeek-V3"
    fs = FileStorage(tmp_path, model_name="m/x", tp_rank=0, tp_size=2)
    k = keys(1)[0]
    assert fs.path_of(k) == os.path.join(str(tmp_path), f"{k}_m-x_0_2.bin")
    with pytest.raises(ValueError):
        fs.path_of("../etc/passwd")


@pytest.mark.parametrize("backend_name", ["file", "memory"])
def test_round_trip_and_prefix(tmp_path: Path, backend_name: str) -> None:
    b: StorageBackend = FileStorage(tmp_path, "m") if backend_name == "file" else MemoryStorage()
    ks, ps = keys(5), pages(5)
    assert b.batch_exists(ks) == 0
    assert b.batch_set(ks[:3], ps[:3]) == [True] * 3
    assert b.batch_exists(ks) == 3
    assert b.batch_set([ks[4]], [ps[4]]) == [True]
    assert b.batch_exists(ks) == 3  # a hole at 3: only the prefix counts
    got = b.batch_get(ks)
    assert got[3] is None
    for i in (0, 1, 2, 4):
        assert got[i] is not None and torch.equal(got[i], ps[i])  # type: ignore[arg-type]
    assert b.batch_exists([]) == 0
    assert b.batch_set(ks[:1], ps[:1]) == [True]  # already stored: content-addressed, still a success


def test_atomic_writes_leave_no_temp_files(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path, "m", fsync=True)
    ks = keys(4)
    assert fs.batch_set(ks, pages(4)) == [True] * 4
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 8 and sorted(n for n in names if n.endswith("_m_0_1.bin")) == sorted(
        os.path.basename(fs.path_of(k)) for k in ks
    )
    assert sorted(n for n in names if n.endswith("_m_0_1.kvfsm")) == sorted(f"{k}_m_0_1.kvfsm" for k in ks)
    assert fs.stats.writes_ok == 4


def test_torn_write_is_never_returned(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path, "m")
    ks, ps = keys(2), pages(2)
    fs.batch_set(ks, ps)
    path = fs.path_of(ks[0])
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    got = fs.batch_get(ks)
    assert got[0] is None and got[1] is not None and torch.equal(got[1], ps[1])
    assert fs.stats.reads_corrupt == 1
    assert os.path.exists(path + ".corrupt") and fs.batch_exists(ks) == 0  # moved aside, not counted
    with open(fs.path_of(ks[1]), "r+b") as f:
        f.truncate(10)  # not even a header
    assert fs.batch_get(ks[1:]) == [None]


@pytest.mark.parametrize(
    "where", ["payload", "sidecar magic", "sidecar crc", "sidecar own crc", "sidecar key", "sidecar format"]
)
def test_flipped_byte_is_never_returned(tmp_path: Path, where: str) -> None:
    fs = FileStorage(tmp_path, "m")
    ks, ps = keys(1), pages(1)
    fs.batch_set(ks, ps)
    path = fs.path_of(ks[0])
    side = fs.sidecar_of(path)
    hdr = storage_mod._SIDECAR.size
    target, offset = {
        "payload": (path, os.path.getsize(path) - 7),
        "sidecar magic": (side, 2),
        "sidecar crc": (side, 9),
        "sidecar key": (side, hdr + 3),
        "sidecar own crc": (side, 13),
        "sidecar format": (side, os.path.getsize(side) - 1),
    }[where]
    with open(target, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    assert fs.batch_get(ks) == [None]
    assert fs.stats.reads_corrupt == 1
    assert os.path.exists(path + ".corrupt") and os.path.exists(side + ".corrupt")  # both moved aside
    assert fs.batch_set(ks, ps) == [True]  # rewritable after being moved aside
    got = fs.batch_get(ks)[0]
    assert got is not None and torch.equal(got, ps[0])


def test_page_file_is_the_raw_page_and_the_sidecar_is_documented(tmp_path: Path) -> None:
    """What an SGLang HiCacheFile reader opens is the payload and nothing else; the check is beside it."""
    import struct
    import zlib

    fs = FileStorage(tmp_path, "org/model", tp_rank=1, tp_size=2, stale_temp_age_s=None)
    (k,), (p,) = keys(1), pages(1)
    assert fs.batch_set([k], [p]) == [True]
    path = fs.path_of(k)
    assert os.path.basename(path) == f"{k}_org-model_1_2.bin"
    assert Path(path).read_bytes() == p.numpy().tobytes()
    side = Path(fs.sidecar_of(path)).read_bytes()
    name = f"{k}_org-model_1_2".encode()
    fmt = b"layout=layer_first"
    assert (
        side
        == struct.pack(
            "<8sIIQII",
            b"KVFSSC01",
            zlib.crc32(p.numpy().tobytes()),
            zlib.crc32(name + fmt),
            p.numel(),
            len(name),
            len(fmt),
        )
        + name
        + fmt
    )


def test_pages_without_a_sidecar_are_length_checked_and_counted_unverified(tmp_path: Path) -> None:
    """SGLang's HiCacheFile writes only `{key}.bin`: kvfsm returns it when its length is a page's, counts it
    unverified, and leaves any other length where it is (not a miss it may move)."""
    ks, ps = keys(3), pages(3)
    unknown = FileStorage(tmp_path, "m")
    for k, p in zip(ks, ps):
        Path(unknown.path_of(k)).write_bytes(p.numpy().tobytes())
    assert unknown.batch_get(ks[:1]) == [None]  # page size unknown: nothing to check the length against
    assert unknown.stats.reads_missing == 1 and unknown.unverified_reads == 0
    fs = FileStorage(tmp_path, "m", page_nbytes=1000)
    Path(fs.path_of(ks[2])).write_bytes(ps[2].numpy().tobytes()[:999])
    got = fs.batch_get(ks)
    assert got[0] is not None and torch.equal(got[0], ps[0]) and torch.equal(got[1], ps[1])  # type: ignore[arg-type]
    assert got[2] is None and os.path.exists(fs.path_of(ks[2]))  # short: refused, not moved
    assert fs.unverified_reads == 2 and fs.stats.reads_ok == 2 and fs.stats.reads_corrupt == 1
    assert fs.batch_exists(ks) == 3
    assert fs.batch_set(ks[:1], ps[:1]) == [True] and fs.stats.writes_skipped == 1  # its key is stored already
    learned = FileStorage(tmp_path / "other", "m")
    learned.batch_set(keys(4)[3:], pages(4)[3:])  # a write teaches the page size
    Path(learned.path_of(ks[0])).write_bytes(ps[0].numpy().tobytes())
    assert learned.batch_get(ks[:1])[0] is not None and learned.unverified_reads == 1


def test_sidecar_without_its_page_is_a_miss_and_is_rewritten(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path, "m")
    ks, ps = keys(1), pages(1)
    fs.batch_set(ks, ps)
    os.unlink(fs.path_of(ks[0]))  # a writer killed between its two publishes (or SGLang's evictor)
    assert fs.batch_get(ks) == [None] and fs.batch_exists(ks) == 0
    assert fs.batch_set(ks, ps) == [True] and torch.equal(fs.batch_get(ks)[0], ps[0])  # type: ignore[arg-type]


def test_page_first_layout_reorders_the_file_and_round_trips(tmp_path: Path) -> None:
    """layout="page_first": the file holds SGLang's page_first flat page (plane, token, layer, row) and reads
    back in kvfsm's canonical (plane, layer, token, row) order; a store of another layout refuses it."""
    P, L, T, R = 2, 3, 4, 10
    canon = torch.arange(P * L * T * R, dtype=torch.int64).remainder(251).to(torch.uint8)
    fs = FileStorage(tmp_path, "m", layout="page_first", page_dims=(P, L, T))
    (k,) = keys(1)
    assert fs.batch_set([k], [canon]) == [True]
    on_disk = np.frombuffer(Path(fs.path_of(k)).read_bytes(), dtype=np.uint8)
    assert np.array_equal(on_disk, canon.numpy().reshape(P, L, T, R).transpose(0, 2, 1, 3).reshape(-1))
    got = fs.batch_get([k])[0]
    assert got is not None and torch.equal(got, canon)
    other = FileStorage(tmp_path, "m")  # layer_first: the sidecar's format disagrees, the page stays
    assert other.batch_get([k]) == [None] and other.stats.reads_missing == 1 and other.stats.reads_corrupt == 0
    assert fs.batch_get([k])[0] is not None
    with pytest.raises(ValueError, match="page_dims"):
        FileStorage(tmp_path, "m", layout="page_first")
    with pytest.raises(ValueError, match="layout"):
        FileStorage(tmp_path, "m", layout="page_head")
    with pytest.raises(ValueError, match="page_dims"):
        FileStorage(tmp_path, "m", page_dims=(3, 1, 1))
    with pytest.raises(ValueError, match="page_dims"):
        FileStorage(tmp_path, "m", layout="page_first", page_dims=(2, 3, 4)).batch_set(
            [k], [torch.zeros(7, dtype=torch.uint8)]
        )


def test_failed_writes_reported_per_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fs = FileStorage(tmp_path, "m")
    ks, ps = keys(3), pages(3)
    real_link = os.link

    def flaky_link(src: str, dst: str) -> None:  # the page's publish (its sidecar went first)
        if dst == fs.path_of(ks[1]):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_link(src, dst)

    monkeypatch.setattr(storage_mod.os, "link", flaky_link)
    assert fs.batch_set(ks, ps) == [True, False, True]
    assert fs.stats.writes_failed == 1
    assert fs.batch_exists(ks) == 1
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]  # the failed temp file is gone
    assert fs.batch_get(ks)[1] is None


def test_unwritable_directory_reports_false(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path / "d", "m")
    os.rmdir(tmp_path / "d")
    (tmp_path / "d").write_text("a file where the directory was")
    assert fs.batch_set(keys(2), pages(2)) == [False, False]
    assert fs.batch_get(keys(2)) == [None, None]


def test_batch_checks() -> None:
    with pytest.raises(ValueError):
        MemoryStorage().batch_set(keys(2), pages(1))
    with pytest.raises(ValueError):
        MemoryStorage().batch_set(keys(1), [torch.zeros(3)])


def test_faulty_storage_is_deterministic(tmp_path: Path) -> None:
    ks, ps = keys(6), pages(6)
    f = FaultyStorage(
        FileStorage(tmp_path, "m"),
        fail_writes={ks[1]},
        fail_write_ordinals={4},
        corrupt_reads=[ks[2]],
        drop_reads=lambda k: k == ks[3],
    )
    assert f.batch_set(ks[:3], ps[:3]) == [True, False, True]
    assert f.batch_set(ks[3:], ps[3:]) == [True, False, True]  # ordinal 4 == ks[4]
    assert f.failed_writes == [ks[1], ks[4]]
    assert f.batch_exists(ks) == 1
    got = f.batch_get(ks)
    assert got[1] is None and got[4] is None and got[3] is None
    assert torch.equal(got[0], ps[0]) and torch.equal(got[5], ps[5])  # type: ignore[arg-type]
    assert got[2] is not None and not torch.equal(got[2], ps[2]) and got[2][1:].equal(ps[2][1:])
    assert f.corrupted_reads == [ks[2]] and f.dropped_reads == [ks[3]]


def test_close_stops_the_writer_threads_and_a_later_write_restarts_them(tmp_path: Path) -> None:
    import threading

    others = {t.ident for t in threading.enumerate()}  # other tests' stores may still run their writers

    def writer_threads() -> int:
        return sum(t.name.startswith("kvfsm-file-store") and t.ident not in others for t in threading.enumerate())

    fs = FileStorage(tmp_path, model_name="m", writers=3)
    pages = list(torch.arange(4 * 8, dtype=torch.uint8).reshape(4, 8))
    assert fs.batch_set([f"{i:064x}" for i in range(4)], pages) == [True] * 4
    assert writer_threads() > 0
    fs.close()
    assert writer_threads() == 0
    assert fs.batch_set([f"{i:064x}" for i in range(4, 8)], pages) == [True] * 4
    fs.close()
    assert writer_threads() == 0


def test_the_sidecar_format_string_is_pinned() -> None:
    """The format a sidecar records is on disk: two deployments compare it, so its spelling is the format."""
    assert storage_mod.page_format("layer_first") == "layout=layer_first"
    assert (
        storage_mod.page_format("page_first", (2, 3, 4), torch.bfloat16)
        == "layout=page_first;dims=2x3x4;dtype=bfloat16"
    )


@pytest.mark.parametrize(
    "damage,reason",
    [
        ("truncated sidecar", r"truncated sidecar"),
        ("sidecar magic", r"bad sidecar magic"),
        ("payload byte", r"checksum mismatch"),
        ("torn page", r"length \d+ != \d+ \(torn write\?\)"),
    ],
)
def test_the_warning_names_what_is_wrong_with_a_page(
    tmp_path: Path, damage: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    """What an operator reads when a page is moved aside says why."""
    fs = FileStorage(tmp_path, "m")
    ks, ps = keys(1), pages(1)
    fs.batch_set(ks, ps)
    path = fs.path_of(ks[0])
    side = fs.sidecar_of(path)
    if damage == "truncated sidecar":
        with open(side, "r+b") as f:
            f.truncate(storage_mod._SIDECAR.size - 1)
    elif damage == "torn page":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 3)
    else:
        target, offset = (side, 2) if damage == "sidecar magic" else (path, 5)
        with open(target, "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0x01]))
    with caplog.at_level("WARNING", logger="kvfsm"):
        assert fs.batch_get(ks) == [None]
    assert any(re.search(rf"is corrupt \({reason}\); moved aside", r.getMessage()) for r in caplog.records), caplog.text


def test_faulty_write_ordinals_count_every_page_ever_passed() -> None:
    f = FaultyStorage(MemoryStorage(), fail_write_ordinals={5})
    ks, ps = keys(6), pages(6)
    assert f.batch_set(ks[:2], ps[:2]) == [True, True]
    assert f.batch_set(ks[2:4], ps[2:4]) == [True, True]
    assert f.batch_set(ks[4:], ps[4:]) == [True, False]  # the sixth page ever passed, in the third batch
    assert f.pages_written == 6 and f.failed_writes == [ks[5]]


def test_the_write_counters_add_up_over_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fs = FileStorage(tmp_path, "m")
    ks, ps = keys(4), pages(4)
    failing = {fs.path_of(ks[2]), fs.path_of(ks[3])}
    real_link = os.link

    def flaky_link(src: str, dst: str) -> None:
        if dst in failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_link(src, dst)

    monkeypatch.setattr(storage_mod.os, "link", flaky_link)
    assert fs.batch_set(ks[:2], ps[:2]) == [True, True]
    assert fs.batch_set([ks[0], ks[2]], [ps[0], ps[2]]) == [True, False]  # one skipped, one failed
    assert fs.batch_set([ks[1], ks[3]], [ps[1], ps[3]]) == [True, False]  # and again
    assert (fs.stats.writes_ok, fs.stats.writes_skipped, fs.stats.writes_failed) == (2, 2, 2)


def test_a_default_store_names_pages_without_a_model_and_writes_on_the_calling_thread(tmp_path: Path) -> None:
    """The defaults: model name "" (file names `{key}__0_1.bin`) and one writer, the caller's own thread (no
    writer threads: see FileStorage._write for why)."""
    import threading

    fs = FileStorage(tmp_path)
    ks = keys(3)
    assert os.path.basename(fs.path_of(ks[0])) == f"{ks[0]}__0_1.bin"
    before = {t.ident for t in threading.enumerate()}
    assert fs.batch_set(ks, pages(3)) == [True] * 3
    assert not [t for t in threading.enumerate() if t.name.startswith("kvfsm-file-store") and t.ident not in before]
    assert sorted(os.listdir(tmp_path)) == sorted(f"{k}__0_1{ext}" for k in ks for ext in (".bin", ".kvfsm"))


def test_keys_a_file_name_cannot_carry_safely_are_refused(tmp_path: Path) -> None:
    fs = FileStorage(tmp_path, "m")
    for bad in ("a/b", "a..b", ".hidden", "a b", "x" * 200):
        with pytest.raises(ValueError):
            fs.path_of(bad)
    with pytest.raises(ValueError):
        FileStorage(tmp_path, "org..x").path_of("k")  # the model name is part of the file name too
    assert fs.path_of("a.b-c_d") == os.path.join(str(tmp_path), "a.b-c_d_m_0_1.bin")


# ---- a killed writer's temp files and the start-up sweep -----------------------------------------------


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


class _Killed(BaseException):
    """The writer stops dead where it is (what a SIGKILL leaves, in this process): nothing is cleaned up."""


def test_a_killed_writers_temp_files_are_in_its_directory_and_the_next_start_up_sweeps_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = tmp_path / "store"
    monkeypatch.chdir(tmp_path)  # not the store: a temp file written elsewhere would be missed below
    dead = _dead_pid()
    with monkeypatch.context() as m:
        m.setattr(storage_mod.os, "getpid", lambda: dead)  # the writer was a process that is gone now
        writer = FileStorage(store, "m", stale_temp_age_s=None)

    def killed(*args: object, **kwargs: object) -> None:
        raise _Killed

    (k,) = keys(1)
    with monkeypatch.context() as m:
        m.setattr(storage_mod.os, "replace", killed)  # killed before its first publish
        with pytest.raises(_Killed):
            writer.batch_set([k], pages(1))
    temps = sorted(os.listdir(store))
    assert len(temps) == 2, temps
    for name in temps:  # `.{final name}.{pid}.{12 hex}.{serial}.tmp`, as the module doc says
        assert re.fullmatch(rf"\.{k}_m_0_1\.(bin|kvfsm)\.{dead}\.[0-9a-f]{{12}}\.\d+\.tmp", name), name
    assert FileStorage(store, "m").swept_temps == 0  # fresh: its writer might be alive on another host
    old = time.time() - 3600
    for name in temps:
        os.utime(store / name, (old, old))
    assert FileStorage(store, "m").swept_temps == 2
    assert os.listdir(store) == [] and sorted(os.listdir(tmp_path)) == ["store"]


def test_the_start_up_sweep_takes_temps_more_than_600_s_old(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default stale_temp_age_s is 600 s, and "older than" is strict: a temp exactly that old stays."""
    dead, now = _dead_pid(), 2_000_000_000
    names = {}
    for i, age in enumerate((599.5, 600.0, 600.5)):
        names[age] = f".k{i}.bin.{dead}.0123456789ab.{i}.tmp"
        path = tmp_path / names[age]
        path.write_bytes(b"x")
        ns = int((now - age) * 10**9)  # whole and half seconds: exact in st_mtime
        os.utime(path, ns=(ns, ns))
    with monkeypatch.context() as m:
        m.setattr(storage_mod.time, "time", lambda: float(now))
        assert FileStorage(tmp_path).swept_temps == 1
    assert sorted(os.listdir(tmp_path)) == sorted((names[599.5], names[600.0]))


def test_the_sweep_judges_a_link_by_its_own_age_and_never_touches_its_target(tmp_path: Path) -> None:
    store, elsewhere = tmp_path / "store", tmp_path / "elsewhere"
    store.mkdir()
    elsewhere.write_bytes(b"not the store's")  # fresh
    link = store / f".k.bin.{_dead_pid()}.0123456789ab.0.tmp"
    link.symlink_to(elsewhere)
    old = time.time() - 3600
    os.utime(link, (old, old), follow_symlinks=False)
    assert FileStorage(store).swept_temps == 1
    assert not os.path.lexists(link) and elsewhere.read_bytes() == b"not the store's"


def test_the_sweep_goes_on_past_temps_it_keeps_or_cannot_remove(tmp_path: Path) -> None:
    """Fresh temps, temps of a live pid and entries that cannot be removed (here directories) are skipped, and
    the sweep goes on: every stale temp of a dead pid goes, whatever order the directory lists them in."""
    import subprocess

    dead, old, kept = _dead_pid(), time.time() - 3600, []
    writer = subprocess.Popen(["sleep", "60"])  # the live pid: a process of ours (never signal another's)
    try:
        for i in range(8):  # interleaved, so that a sweep that stopped at the first one it skips misses some
            for kind, pid in (("dead", dead), ("fresh", dead), ("alive", writer.pid), ("undeletable", dead)):
                path = tmp_path / f".k{i}{kind}.bin.{pid}.0123456789ab.{i}.tmp"
                if kind == "undeletable":
                    path.mkdir()  # os.unlink refuses a directory, even to root
                else:
                    path.write_bytes(b"x")
                if kind != "fresh":
                    os.utime(path, (old, old))
                if kind != "dead":
                    kept.append(path.name)
        assert FileStorage(tmp_path).swept_temps == 8
        assert sorted(os.listdir(tmp_path)) == sorted(kept)
        assert writer.poll() is None, "the sweep signalled a live writer"
    finally:
        writer.kill()
        writer.wait()


def test_a_store_whose_directory_is_gone_sweeps_nothing(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "d", stale_temp_age_s=None)
    os.rmdir(tmp_path / "d")
    assert store.sweep_stale_temps(0.0) == 0
    (tmp_path / "d").write_text("a file where the directory was")
    assert store.sweep_stale_temps(0.0) == 0


# ---- two writers of one key: the loser's sidecar ends up describing the winner's page ----------------


@pytest.mark.parametrize("same_bytes", [True, False])
def test_a_writer_that_loses_the_publish_race_leaves_a_sidecar_that_checks_the_winners_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, same_bytes: bool
) -> None:
    """Writer A is about to publish its sidecar when writer B publishes the key (sidecar and page) first; A's
    sidecar replaces B's, and A's page loses to B's. The sidecar must end up describing B's page: A's is
    already right when the bytes are the same, and is rewritten from B's page when they differ, so the
    page reads back verified either way."""
    a, b = FileStorage(tmp_path, "m"), FileStorage(tmp_path, "m")
    (k,) = keys(1)
    ours, theirs = pages(1, seed=1)[0], pages(1, seed=1 if same_bytes else 2)[0]
    path = a.path_of(k)
    side_path = a.sidecar_of(path)
    real_replace = storage_mod.os.replace
    b_side: list[bytes] = []

    def racing_replace(src: str, dst: str) -> None:
        if dst == side_path and not b_side:
            b_side.append(b"")  # B's own replace below goes straight through
            assert b.batch_set([k], [theirs]) == [True]
            b_side[0] = Path(side_path).read_bytes()
        real_replace(src, dst)

    monkeypatch.setattr(storage_mod.os, "replace", racing_replace)
    assert a.batch_set([k], [ours]) == [True]  # the key's page is there: a skip, not a failure
    assert (a.stats.writes_ok, a.stats.writes_skipped, a.stats.writes_failed) == (0, 1, 0)
    assert b.stats.writes_ok == 1
    assert Path(path).read_bytes() == theirs.numpy().tobytes()
    assert Path(side_path).read_bytes() == b_side[0]  # byte for byte B's sidecar, in both cases
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(p) for p in (path, side_path))  # no temps left
    reader = FileStorage(tmp_path, "m")
    (got,) = reader.batch_get([k])
    assert got is not None and torch.equal(got, theirs)
    assert (reader.stats.reads_ok, reader.stats.reads_corrupt, reader.stats.reads_unverified) == (1, 0, 0)


def test_a_format_field_whose_value_holds_an_equals_sign_still_compares(tmp_path: Path) -> None:
    """A field's value is everything after its first "=": a dtype whose name holds "=" (a custom one) is
    recorded as it is, its own pages read back verified, and a store of another such dtype does not read them."""
    fs = FileStorage(tmp_path, "m", dtype="custom=a=b")
    assert fs.format == "layout=layer_first;dtype=custom=a=b"
    ks, ps = keys(2), pages(2)
    assert fs.batch_set(ks, ps) == [True, True]
    got = fs.batch_get(ks)
    assert all(g is not None and torch.equal(g, p) for g, p in zip(got, ps))
    assert (fs.stats.reads_ok, fs.stats.reads_corrupt, fs.stats.reads_unverified) == (2, 0, 0)
    other = FileStorage(tmp_path, "m", dtype="custom=a=c")
    assert other.batch_get(ks) == [None, None]
    assert (other.stats.reads_missing, other.stats.reads_corrupt) == (2, 0)  # another format: left in place
    assert all(os.path.exists(fs.path_of(k)) for k in ks)
    assert storage_mod._formats_agree("layout=layer_first;x=a=b", "layout=layer_first;x=a=b")
    assert not storage_mod._formats_agree("layout=layer_first;x=a=b", "layout=layer_first;x=a=c")
