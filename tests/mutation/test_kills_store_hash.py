"""Tests written to kill survivors of `make mutate` in the file storage and hashing modules (docs/mutation.md)."""

from __future__ import annotations

import logging
import os
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from kvfsm.dataplane import FileStorage, page_hashes
from kvfsm.dataplane.hashing import PageRun
from kvfsm.dataplane.storage import file as storage_mod


def _page(size: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


def _key() -> str:
    return page_hashes([1, 2, 3, 4], 4)[0]


def _with_crc_zero(prefix: bytes) -> bytes:
    """`prefix` and four more bytes chosen so that the whole has crc32 0 (crc32 is affine in those bytes)."""
    base = zlib.crc32(prefix + bytes(4))
    cols = [zlib.crc32(prefix + (1 << i).to_bytes(4, "little")) ^ base for i in range(32)]
    # solve xor of cols[i] over the chosen bits == base, by Gaussian elimination over GF(2)
    rows = [(c, 1 << i) for i, c in enumerate(cols)]
    target, chosen = base, 0
    for bit in range(31, -1, -1):
        pivot = next((r for r in rows if r[0] >> bit & 1), None)
        if pivot is None:
            continue
        rows.remove(pivot)
        rows = [(c ^ pivot[0], m ^ pivot[1]) if c >> bit & 1 else (c, m) for c, m in rows]
        if target >> bit & 1:
            target ^= pivot[0]
            chosen ^= pivot[1]
    out = prefix + chosen.to_bytes(4, "little")
    assert zlib.crc32(out) == 0
    return out


# --- FileStorage reads: what is not a whole, checked page is never returned -------------------------------


def test_a_fifo_under_a_page_files_name_is_a_counted_miss_and_the_warning_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A FIFO where a page file should be is never waited on: the read is a miss, counted as one, and the
    warning tells the operator the page file is not a regular file."""
    fs = FileStorage(tmp_path, "m", page_nbytes=8)
    os.mkfifo(fs.path_of(_key()))
    with caplog.at_level(logging.WARNING, logger="kvfsm"):
        assert fs.batch_get([_key()]) == [None]
    assert (fs.stats.reads_missing, fs.stats.reads_corrupt, fs.stats.reads_ok) == (1, 0, 0)
    assert "page file is not a regular file" in caplog.text


def test_a_fifo_under_a_sidecars_name_is_a_counted_miss_and_the_warning_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A FIFO where a sidecar should be is never waited on: the page is a counted miss, and the warning tells
    the operator the sidecar is not a regular file."""
    fs = FileStorage(tmp_path, "m")
    assert fs.batch_set([_key()], [_page(8)]) == [True]
    side = fs.sidecar_of(fs.path_of(_key()))
    os.unlink(side)
    os.mkfifo(side)
    reader = FileStorage(tmp_path, "m")
    with caplog.at_level(logging.WARNING, logger="kvfsm"):
        assert reader.batch_get([_key()]) == [None]
    assert (reader.stats.reads_missing, reader.stats.reads_corrupt, reader.stats.reads_ok) == (1, 0, 0)
    assert "sidecar is not a regular file" in caplog.text


@pytest.mark.parametrize(("cap", "readable"), [(999, False), (1000, True)])
def test_a_page_longer_than_the_largest_readable_page_is_refused_and_one_of_exactly_that_size_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap: int, readable: bool
) -> None:
    """MAX_PAGE_BYTES bounds what a read takes into memory, inclusive: a page past it is never returned
    (even with a matching sidecar), a page of exactly that size reads back whole."""
    p = _page(1000)
    assert FileStorage(tmp_path, "m").batch_set([_key()], [p]) == [True]
    monkeypatch.setattr(storage_mod, "MAX_PAGE_BYTES", cap)
    reader = FileStorage(tmp_path, "m")
    (got,) = reader.batch_get([_key()])
    if readable:
        assert got is not None and torch.equal(got, p) and reader.stats.reads_ok == 1
    else:
        assert got is None and reader.stats.reads_ok == 0 and reader.stats.reads_corrupt == 1


@pytest.mark.parametrize("size", [0, 1, 1000])
def test_a_page_file_grown_past_the_length_its_sidecar_records_is_corrupt(tmp_path: Path, size: int) -> None:
    """A page file with bytes past the length its sidecar records (an append, another writer's bytes) is
    not the stored page: reported None, counted corrupt and moved aside, whatever the page's size."""
    fs = FileStorage(tmp_path, "m")
    assert fs.batch_set([_key()], [_page(size)]) == [True]
    path = fs.path_of(_key())
    with open(path, "ab") as f:
        f.write(b"\x01\x02\x03")
    reader = FileStorage(tmp_path, "m")
    assert reader.batch_get([_key()]) == [None]
    assert (reader.stats.reads_corrupt, reader.stats.reads_ok) == (1, 0)
    assert os.path.exists(path + ".corrupt") and not os.path.exists(path)


def test_an_empty_page_file_without_a_sidecar_is_not_a_page(tmp_path: Path) -> None:
    """A foreign page file truncated to nothing is never returned as a page of a store that knows its page
    size: reported None and counted corrupt."""
    fs = FileStorage(tmp_path, "m", page_nbytes=8)
    Path(fs.path_of(_key())).write_bytes(b"")
    assert fs.batch_get([_key()]) == [None]
    assert (fs.stats.reads_corrupt, fs.stats.reads_ok, fs.unverified_reads) == (1, 0, 0)


def test_a_page_file_truncated_to_nothing_is_corrupt_even_when_its_checksum_is_that_of_no_bytes(tmp_path: Path) -> None:
    """A torn page file of 0 bytes is never returned, even for a page whose crc32 happens to be 0 (the crc32
    of no bytes): the length its sidecar records is checked first."""
    page = torch.frombuffer(bytearray(_with_crc_zero(_page(60).numpy().tobytes())), dtype=torch.uint8)
    fs = FileStorage(tmp_path, "m")
    assert fs.batch_set([_key()], [page]) == [True]
    assert torch.equal(FileStorage(tmp_path, "m").batch_get([_key()])[0], page)  # type: ignore[arg-type]
    os.truncate(fs.path_of(_key()), 0)
    reader = FileStorage(tmp_path, "m")
    assert reader.batch_get([_key()]) == [None]
    assert (reader.stats.reads_corrupt, reader.stats.reads_ok) == (1, 0)


# --- PageRun: chains of lazily hashed runs -------------------------------------------------------------


def test_a_long_chain_of_unhashed_runs_hashes_like_one_call_over_all_tokens() -> None:
    """A request's chain may hold thousands of unhashed runs: asking the last one hashes them all, oldest
    first, without recursing per run, and gives the keys page_hashes gives over all the tokens."""
    runs: list[PageRun] = []
    prior: PageRun | None = None
    tokens = list(range(2 * 3000))
    for i in range(3000):
        prior = PageRun(tokens[2 * i : 2 * i + 2], 2, prior)
        runs.append(prior)
    expected = page_hashes(tokens, 2)
    assert runs[-1].hashes == expected[-1:]
    assert [r.hashes[0] for r in runs] == expected


class _GatedTokens:
    """Token ids whose first conversion to an array waits until `go` is set (another thread runs meanwhile)."""

    def __init__(self, ids: list[int], started: threading.Event, go: threading.Event) -> None:
        self.ids, self.started, self.go, self.calls = ids, started, go, 0

    def __len__(self) -> int:
        return len(self.ids)

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        self.calls += 1
        if self.calls == 1:
            self.started.set()
            assert self.go.wait(30)
        return np.asarray(self.ids, dtype=np.int64)


def test_a_run_hashed_by_another_thread_meanwhile_does_not_stop_the_rest_of_the_chain() -> None:
    """Two threads may hash one chain at once: when another thread hashes a run this one was about to hash,
    this one still hashes the runs after it and returns the right keys (the backup worker and the scheduler
    both ask for keys)."""
    started, go = threading.Event(), threading.Event()
    ids = list(range(12))
    r0 = PageRun(_GatedTokens(ids[:4], started, go), 2)
    r1 = PageRun(ids[4:8], 2, r0)
    r2 = PageRun(ids[8:], 2, r1)
    out: dict[str, object] = {}

    def last_run() -> None:
        try:
            out["hashes"] = r2.hashes
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            out["error"] = e

    t = threading.Thread(target=last_run)
    t.start()
    try:
        assert started.wait(30)  # the thread is hashing r0 and will go on to r1, r2
        mid = r1.hashes  # meanwhile this thread hashes r0 and r1
    finally:
        go.set()
        t.join(30)
    expected = page_hashes(ids, 2)
    assert mid == expected[2:4]
    assert out == {"hashes": expected[4:]}
    assert r0.hashes == expected[:2]
