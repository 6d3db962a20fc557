"""Storage backends: atomic, checksummed FileStorage; prefix existence; per-page failure; FaultyStorage."""

from __future__ import annotations

import errno
import os
from pathlib import Path

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
    assert len(names) == 4 and all(n.endswith("_m_0_1.bin") for n in names)
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


@pytest.mark.parametrize("where", ["payload", "header", "key"])
def test_flipped_byte_is_never_returned(tmp_path: Path, where: str) -> None:
    fs = FileStorage(tmp_path, "m")
    ks, ps = keys(1), pages(1)
    fs.batch_set(ks, ps)
    path = fs.path_of(ks[0])
    offset = {"payload": os.path.getsize(path) - 7, "header": 2, "key": storage_mod._HEADER.size + 3}[where]
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    assert fs.batch_get(ks) == [None]
    assert fs.stats.reads_corrupt == 1
    assert fs.batch_set(ks, ps) == [True]  # rewritable after being moved aside
    got = fs.batch_get(ks)[0]
    assert got is not None and torch.equal(got, ps[0])


def test_failed_writes_reported_per_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fs = FileStorage(tmp_path, "m")
    ks, ps = keys(3), pages(3)
    real_replace = os.replace

    def flaky_replace(src: str, dst: str) -> None:
        if dst == fs.path_of(ks[1]):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(storage_mod.os, "replace", flaky_replace)
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
    f = FaultyStorage(FileStorage(tmp_path, "m"), fail_writes={ks[1]}, fail_write_ordinals={4},
                      corrupt_reads=[ks[2]], drop_reads=lambda k: k == ks[3])
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

    def writer_threads() -> int:
        return sum(t.name.startswith("kvfsm-file-store") for t in threading.enumerate())

    fs = FileStorage(tmp_path, model_name="m", writers=3)
    pages = list(torch.arange(4 * 8, dtype=torch.uint8).reshape(4, 8))
    assert fs.batch_set([f"{i:064x}" for i in range(4)], pages) == [True] * 4
    assert writer_threads() > 0
    fs.close()
    assert writer_threads() == 0
    assert fs.batch_set([f"{i:064x}" for i in range(4, 8)], pages) == [True] * 4
    fs.close()
    assert writer_threads() == 0
