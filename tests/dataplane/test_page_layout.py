"""The byte layout of a page, checked against docs/page-layout.md and not against the code that wrote it.

Every element of a request's KV gets a distinct, finite bit pattern that encodes (plane, layer, position,
head, dim). The pages go through the real path: the CPU copy engine (device pool -> host pool, both host
layouts), then FileStorage (`batch_set_from_host`, the backup worker's call). The test then reads raw
bytes, a numpy/bytes view of the host buffer and the page files parsed with `struct`, and compares them
with buffers it builds itself from the doc's offset formulas. The load-back path is checked the same way:
payload bytes the test parsed itself go into a host pool of the *other* layout (raw bytes checked) and
through the copy engine into a fresh device pool (raw bytes checked).

Layouts that are wrong the same way on write and on read (the mutants: a page_first pool built as
layer_first; canonical page bytes with layers and tokens, K and V, or heads and dims swapped) pass a round
trip, and must fail here.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from kvfsm.dataplane import CpuCopyEngine, DeviceKVPool, FileStorage, HostKVPool, KVCacheConfig, page_hashes

MODEL = "layout/test"
DEVICE_SLOTS = 64
HOST_PAGES = 6
CHUNK_PAGES = 3  # the request's pages, stored at host pages 4, 1, 3 (out of order on purpose)
HOST_PAGE_IDS = [4, 1, 3]
RELOAD_PAGE_IDS = [2, 5, 0]
SIDECAR = struct.Struct(
    "<8sIIQII"
)  # docs/page-layout.md: magic, crc32(page file), crc32(key+format), its length, key length, format length
HOST_SENTINEL, DEVICE_SENTINEL = 0x7A, 0x00  # byte values that no element pattern has in both its bytes

# element bits: a base well inside the finite normal range of each dtype, plus a distinct code
BASE = {torch.bfloat16: 0x3C00, torch.float16: 0x3C00, torch.float32: 0x3F800000}
PACK = {2: "<H", 4: "<I"}


@dataclass(frozen=True)
class Case:
    attention: str
    dtype: torch.dtype
    layout: str
    page_size: int

    @property
    def kv(self) -> KVCacheConfig:
        return KVCacheConfig.tiny(self.attention, self.dtype)  # type: ignore[arg-type]

    @property
    def tokens(self) -> int:
        return CHUNK_PAGES * self.page_size

    def code(self, p: int, l: int, pos: int, h: int, d: int) -> int:
        """The bit pattern of the element (plane p, layer l, request position pos, head h, dim d)."""
        c = self.kv
        return BASE[c.dtype] + ((((p * c.num_layers + l) * self.tokens + pos) * c.kv_heads + h) * c.head_dim + d)

    def __str__(self) -> str:
        return f"{self.attention}-{str(self.dtype).removeprefix('torch.')}-{self.layout}-page{self.page_size}"


CASES = [
    Case(a, dt, lay, ps)
    for a in ("mha", "mla")
    for dt in (torch.bfloat16, torch.float16, torch.float32)
    for lay in ("layer_first", "page_first")
    for ps in (1, 4)
]


def other_layout(layout: str) -> str:
    return "page_first" if layout == "layer_first" else "layer_first"


# ---- the definitions, from docs/page-layout.md ------------------------------------------------------


def elements(c: KVCacheConfig):  # (p, l, h, d) of one token
    for p in range(c.num_planes):
        for l in range(c.num_layers):
            for h in range(c.kv_heads):
                for d in range(c.head_dim):
                    yield p, l, h, d


def device_offset(c: KVCacheConfig, slots: int, p: int, l: int, slot: int, h: int, d: int) -> int:
    return c.element_size * ((((p * c.num_layers + l) * slots + slot) * c.kv_heads + h) * c.head_dim + d)


def host_offset(c: KVCacheConfig, layout: str, size: int, p: int, l: int, s: int, h: int, d: int) -> int:
    """Byte offset of (plane, layer, slot, head, dim) in HostKVPool.kv_buffer (the doc's host table)."""
    L, H, D, E = c.num_layers, c.kv_heads, c.head_dim, c.element_size
    if c.is_mla:
        assert p == 0 and h == 0
        return E * ((l * size + s) * D + d) if layout == "layer_first" else E * ((s * L + l) * D + d)
    if layout == "layer_first":
        return E * ((((p * L + l) * size + s) * H + h) * D + d)
    return E * ((((p * size + s) * L + l) * H + h) * D + d)


def payload_offset(c: KVCacheConfig, page_size: int, p: int, l: int, t: int, h: int, d: int) -> int:
    """Byte offset of (plane, layer, token of the page, head, dim) in a canonical page (either layout)."""
    return c.element_size * ((((p * c.num_layers + l) * page_size + t) * c.kv_heads + h) * c.head_dim + d)


def expected_host(case: Case, layout: str, size: int, page_ids: list[int]) -> bytes:
    c, fmt = case.kv, PACK[case.kv.element_size]
    buf = bytearray([HOST_SENTINEL]) * (size * c.bytes_per_token)
    for j, page in enumerate(page_ids):
        for t in range(case.page_size):
            for p, l, h, d in elements(c):
                struct.pack_into(
                    fmt,
                    buf,
                    host_offset(c, layout, size, p, l, page * case.page_size + t, h, d),
                    case.code(p, l, j * case.page_size + t, h, d),
                )
    return bytes(buf)


def expected_payload(case: Case, j: int) -> bytes:
    c, fmt = case.kv, PACK[case.kv.element_size]
    buf = bytearray(case.page_size * c.bytes_per_token)
    for t in range(case.page_size):
        for p, l, h, d in elements(c):
            struct.pack_into(
                fmt,
                buf,
                payload_offset(c, case.page_size, p, l, t, h, d),
                case.code(p, l, j * case.page_size + t, h, d),
            )
    return bytes(buf)


def parse_page_file(raw: bytes, sidecar: bytes, layout: str = "layer_first") -> tuple[str, bytes]:
    """(key, payload) of a FileStorage page: the page file is the payload and nothing else (what SGLang's
    HiCacheFile reads from offset 0); the sidecar's table (the doc's) vouches for it."""
    magic, crc, side_crc, plen, klen, flen = SIDECAR.unpack_from(sidecar, 0)
    assert magic == b"KVFSSC01"
    assert len(sidecar) == 32 + klen + flen and len(raw) == plen
    assert zlib.crc32(sidecar[32:]) & 0xFFFFFFFF == side_crc
    key, fmt = sidecar[32 : 32 + klen].decode("ascii"), sidecar[32 + klen :].decode("ascii")
    assert fmt.split(";")[0] == f"layout={layout}"
    assert zlib.crc32(raw) & 0xFFFFFFFF == crc
    return key, raw


def read_page(directory: Path, name: str, layout: str = "layer_first") -> tuple[str, bytes]:
    return parse_page_file((directory / f"{name}.bin").read_bytes(), (directory / f"{name}.kvfsm").read_bytes(), layout)


def unravel(index: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(shape):
        out.append(index % n)
        index //= n
    return tuple(reversed(out))


def name_of(case: Case, word: int) -> str:
    """What element a bit pattern encodes: (plane, layer, position, head, dim), or a sentinel."""
    c = case.kv
    code = word - BASE[c.dtype]
    if 0 <= code < c.num_planes * c.num_layers * case.tokens * c.kv_heads * c.head_dim:
        return f"(p, l, pos, h, d)={unravel(code, (c.num_planes, c.num_layers, case.tokens, c.kv_heads, c.head_dim))}"
    return f"{word:#x} (no element)"


def first_difference(case: Case, got: bytes, want: bytes, where: Callable[[int], str]) -> str:
    """The first element that differs: where it is (per the doc) and what each side holds there."""
    if len(got) != len(want):
        return f"{len(got)} bytes where the doc has {len(want)}"
    E, fmt = case.kv.element_size, PACK[case.kv.element_size]
    i = next(i for i in range(len(got)) if got[i] != want[i]) // E * E
    return (
        f"at byte {i}, {where(i // E)}: holds {name_of(case, struct.unpack_from(fmt, got, i)[0])}, "
        f"the doc says {name_of(case, struct.unpack_from(fmt, want, i)[0])}"
    )


def host_where(case: Case, layout: str, size: int) -> Callable[[int], str]:
    c = case.kv
    if c.is_mla:
        shape, names = (
            ((c.num_layers, size, 1, c.head_dim), "(l, s, 0, d)")
            if layout == "layer_first"
            else ((size, c.num_layers, 1, c.head_dim), "(s, l, 0, d)")
        )
    else:
        shape, names = (
            ((2, c.num_layers, size, c.kv_heads, c.head_dim), "(p, l, s, h, d)")
            if layout == "layer_first"
            else ((2, size, c.num_layers, c.kv_heads, c.head_dim), "(p, s, l, h, d)")
        )
    return lambda e: f"{layout} {names}={unravel(e, shape)}"


def page_where(case: Case) -> Callable[[int], str]:
    c = case.kv
    shape = (c.num_planes, c.num_layers, case.page_size, c.kv_heads, c.head_dim)
    return lambda e: f"page (p, l, t, h, d)={unravel(e, shape)}"


def device_where(case: Case) -> Callable[[int], str]:
    c = case.kv
    shape = (c.num_planes, c.num_layers, DEVICE_SLOTS, c.kv_heads, c.head_dim)
    return lambda e: f"device (p, l, slot, h, d)={unravel(e, shape)}"


# ---- the path under test ------------------------------------------------------------------------------


@dataclass
class Run:
    case: Case
    device: DeviceKVPool
    host: HostKVPool
    store: FileStorage
    keys: list[str]
    device_slots: list[int]
    host_slots: torch.Tensor


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def offload(case: Case, directory: Path) -> Run:
    """Write the known KV into the device pool, copy it to host pages with the CPU engine, store them."""
    c = case.kv
    device = DeviceKVPool.create(c, DEVICE_SLOTS)
    dev_slots = [int(s) for s in np.random.default_rng(7).permutation(DEVICE_SLOTS)[: case.tokens]]
    word = {2: np.uint16, 4: np.uint32}[c.element_size]
    dev_bits = device.storage.view({2: torch.int16, 4: torch.int32}[c.element_size]).numpy().view(word)
    dev_bits[...] = DEVICE_SENTINEL
    for pos, slot in enumerate(dev_slots):  # the engine's KV, by the device pool's (P, L, slots, H, D)
        for p, l, h, d in elements(c):
            dev_bits[p, l, slot, h, d] = case.code(p, l, pos, h, d)
    host = HostKVPool(c, HOST_PAGES * case.page_size, case.page_size, case.layout)  # type: ignore[arg-type]
    host.kv_buffer.view(torch.uint8).fill_(HOST_SENTINEL)
    assert sorted(host.alloc_pages(HOST_PAGES)) == list(range(HOST_PAGES))  # type: ignore[arg-type]
    host_slots = host.slots_of(HOST_PAGE_IDS)
    CpuCopyEngine().submit_d2h(device, torch.tensor(dev_slots), host, host_slots).wait()
    keys = page_hashes(list(range(case.tokens)), case.page_size)
    store = FileStorage(directory, model_name=MODEL, tp_rank=0, tp_size=1, is_mla=c.is_mla)
    assert store.batch_set_from_host(keys, host, host_slots) == [True] * CHUNK_PAGES
    return Run(case, device, host, store, keys, dev_slots, host_slots)


def host_problem(run: Run) -> str | None:
    case = run.case
    want = expected_host(case, case.layout, run.host.size, HOST_PAGE_IDS)
    got = raw(run.host.kv_buffer)
    if got == want:
        return None
    return f"{case} host buffer: " + first_difference(case, got, want, host_where(case, case.layout, run.host.size))


def file_problems(run: Run, directory: Path) -> list[str]:
    case, problems = run.case, []
    suffix = f"_{MODEL.replace('/', '-')}" + ("" if case.kv.is_mla else "_0_1")
    for j, key in enumerate(run.keys):
        path = directory / f"{key}{suffix}.bin"
        if not path.exists():
            problems.append(f"{case} page {j}: no file {path.name}")
            continue
        stored_key, payload = read_page(directory, f"{key}{suffix}")
        if stored_key != key + suffix:
            problems.append(f"{case} page {j}: the file holds key {stored_key}")
        want = expected_payload(case, j)
        if payload != want:
            problems.append(f"{case} page {j} payload: " + first_difference(case, payload, want, page_where(case)))
    return problems


def reload_problems(run: Run, directory: Path) -> list[str]:
    """The payloads (parsed here) into a host pool of the other layout, then into a fresh device pool."""
    case, c, problems = run.case, run.case.kv, []
    layout = other_layout(case.layout)
    host = HostKVPool(c, HOST_PAGES * case.page_size, case.page_size, layout)  # type: ignore[arg-type]
    host.kv_buffer.view(torch.uint8).fill_(HOST_SENTINEL)
    host.alloc_pages(HOST_PAGES)
    suffix = f"_{MODEL.replace('/', '-')}" + ("" if c.is_mla else "_0_1")
    payloads = [read_page(directory, f"{k}{suffix}")[1] for k in run.keys]
    slots = host.slots_of(RELOAD_PAGE_IDS)
    host.set_pages_bytes(slots, torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8))
    want = expected_host(case, layout, host.size, RELOAD_PAGE_IDS)
    if raw(host.kv_buffer) != want:
        problems.append(
            f"{case} reloaded into {layout}: "
            + first_difference(case, raw(host.kv_buffer), want, host_where(case, layout, host.size))
        )
    device = DeviceKVPool.create(c, DEVICE_SLOTS)  # zeros
    back = list(reversed(range(DEVICE_SLOTS)))[: case.tokens]
    CpuCopyEngine().submit_h2d(host, slots, device, torch.tensor(back)).wait()
    buf = bytearray(DEVICE_SLOTS * c.bytes_per_token)
    for pos, slot in enumerate(back):
        for p, l, h, d in elements(c):
            struct.pack_into(
                PACK[c.element_size], buf, device_offset(c, DEVICE_SLOTS, p, l, slot, h, d), case.code(p, l, pos, h, d)
            )
    if raw(device.storage) != bytes(buf):
        problems.append(
            f"{case} loaded back to the device: "
            + first_difference(case, raw(device.storage), bytes(buf), device_where(case))
        )
    got = run.store.batch_get(run.keys)  # the store's own reader agrees with the parsed payloads
    if any(g is None or g.numpy().tobytes() != p for g, p in zip(got, payloads)):
        problems.append(f"{case}: FileStorage.batch_get differs from the payload in the file")
    return problems


def round_trip_ok(run: Run) -> bool:
    """What every other test checks: the store's pages, loaded back through the same code, equal the KV."""
    host = HostKVPool(run.case.kv, HOST_PAGES * run.case.page_size, run.case.page_size, run.case.layout)  # type: ignore[arg-type]
    host.alloc_pages(HOST_PAGES)
    got = run.store.batch_get(run.keys)
    if any(g is None for g in got):
        return False
    slots = host.slots_of(RELOAD_PAGE_IDS)
    host.set_pages_bytes(slots, torch.cat(got))  # type: ignore[arg-type]
    device = DeviceKVPool.create(run.case.kv, DEVICE_SLOTS)
    CpuCopyEngine().submit_h2d(host, slots, device, torch.tensor(run.device_slots)).wait()
    idx = torch.tensor(run.device_slots)
    return raw(device.storage[:, :, idx]) == raw(run.device.storage[:, :, idx])


# ---- the tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=str)
def test_page_bytes_match_the_documented_layout(case: Case, tmp_path: Path) -> None:
    run = offload(case, tmp_path)
    assert host_problem(run) is None, host_problem(run)
    assert file_problems(run, tmp_path) == []
    assert reload_problems(run, tmp_path) == []
    assert round_trip_ok(run)
    assert len(os.listdir(tmp_path)) == 2 * CHUNK_PAGES  # a page file and its sidecar per page


def sglang_page_first_offset(c: KVCacheConfig, page_size: int, p: int, l: int, t: int, h: int, d: int) -> int:
    """The doc's page_first page-file order: within each plane, token before layer (SGLang's default
    `--hicache-mem-layout page_first` flat page: MHA (2, T, L, H, D), MLA (T, L, 1, D))."""
    return c.element_size * ((((p * page_size + t) * c.num_layers + l) * c.kv_heads + h) * c.head_dim + d)


@pytest.mark.parametrize(
    "case",
    [
        Case("mha", torch.bfloat16, "layer_first", 4),
        Case("mha", torch.float32, "page_first", 4),
        Case("mla", torch.float16, "page_first", 4),
        Case("mla", torch.bfloat16, "layer_first", 1),
    ],
    ids=str,
)
def test_page_first_store_files_match_the_documented_order(case: Case, tmp_path: Path) -> None:
    """FileStorage(layout="page_first") writes each page in the doc's page_first order (whatever the host
    pool's layout) and reads it back as canonical bytes."""
    c, fmt = case.kv, PACK[case.kv.element_size]
    first = offload(case, tmp_path / "canonical")
    store = FileStorage(
        tmp_path,
        model_name=MODEL,
        is_mla=c.is_mla,
        layout="page_first",
        page_dims=(c.num_planes, c.num_layers, case.page_size),
    )
    assert store.batch_set_from_host(first.keys, first.host, first.host_slots) == [True] * CHUNK_PAGES
    suffix = f"_{MODEL.replace('/', '-')}" + ("" if c.is_mla else "_0_1")
    for j, key in enumerate(first.keys):
        buf = bytearray(case.page_size * c.bytes_per_token)
        for t in range(case.page_size):
            for p, l, h, d in elements(c):
                struct.pack_into(
                    fmt,
                    buf,
                    sglang_page_first_offset(c, case.page_size, p, l, t, h, d),
                    case.code(p, l, j * case.page_size + t, h, d),
                )
        _, on_disk = read_page(tmp_path, f"{key}{suffix}", "page_first")
        assert on_disk == bytes(buf), f"page {j}"
        got = store.batch_get([key])[0]
        assert got is not None and got.numpy().tobytes() == expected_payload(case, j)


def test_codes_are_distinct_and_finite() -> None:
    """The encoding can tell every element apart, and every pattern is a finite number of its dtype."""
    for case in CASES:
        c = case.kv
        codes = [case.code(p, l, pos, h, d) for pos in range(case.tokens) for p, l, h, d in elements(c)]
        assert len(set(codes)) == len(codes)
        word = {2: torch.int16, 4: torch.int32}[c.element_size]
        signed = [x - (1 << 8 * c.element_size) if x >= 1 << (8 * c.element_size - 1) else x for x in codes]
        values = torch.tensor(signed, dtype=word).view(c.dtype).float()
        assert bool(torch.isfinite(values).all()) and bool((values > 0).all()), case
        for b in (HOST_SENTINEL, DEVICE_SENTINEL):  # a sentinel word is no element's pattern
            assert int.from_bytes(bytes([b]) * c.element_size, "little") not in set(codes)


# ---- the mutants: wrong the same way on write and on read -----------------------------------------


def _page_first_built_as_layer_first(monkeypatch: pytest.MonkeyPatch) -> None:
    real_shape = HostKVPool._shape

    def shape(self: HostKVPool) -> tuple[int, ...]:
        layout, self.layout = self.layout, "layer_first"
        try:
            return real_shape(self)
        finally:
            self.layout = layout

    def token_view(self: HostKVPool) -> torch.Tensor:
        b = self.kv_buffer
        return b.unsqueeze(0) if self.config.is_mla else b

    monkeypatch.setattr(HostKVPool, "_shape", shape)
    monkeypatch.setattr(HostKVPool, "token_view", token_view)


def _canonical_order_permuted(perm: Callable[[np.ndarray], np.ndarray], inverse: Callable[[np.ndarray], np.ndarray]):
    def inject(monkeypatch: pytest.MonkeyPatch) -> None:
        real_get, real_set = HostKVPool.get_pages_bytes, HostKVPool.set_pages_bytes

        def page_shape(self: HostKVPool, n: int) -> tuple[int, ...]:  # (pages, P, L, T, H, D, bytes of one element)
            c = self.config
            return (n, c.num_planes, c.num_layers, self.page_size, c.kv_heads, c.head_dim, c.element_size)

        def get(self: HostKVPool, idx):  # type: ignore[no-untyped-def]
            rows = real_get(self, idx).numpy()
            pages = rows.reshape(page_shape(self, rows.shape[0]))
            return torch.from_numpy(np.ascontiguousarray(perm(pages)).reshape(rows.shape[0], -1))

        def put(self: HostKVPool, idx, data: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
            n = data.numel() // self.page_nbytes
            pages = data.contiguous().numpy().reshape(perm(np.empty(page_shape(self, n), np.uint8)).shape)
            real_set(self, idx, torch.from_numpy(np.ascontiguousarray(inverse(pages)).reshape(n, -1)))

        monkeypatch.setattr(HostKVPool, "get_pages_bytes", get)
        monkeypatch.setattr(HostKVPool, "set_pages_bytes", put)

    return inject


MUTANTS: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], Case]] = {
    "page_first_stored_as_layer_first": (
        _page_first_built_as_layer_first,
        Case("mha", torch.bfloat16, "page_first", 4),
    ),
    "mla_page_first_stored_as_layer_first": (
        _page_first_built_as_layer_first,
        Case("mla", torch.float16, "page_first", 4),
    ),
    "layers_and_tokens_swapped_in_pages": (
        _canonical_order_permuted(lambda a: a.swapaxes(2, 3), lambda a: a.swapaxes(2, 3)),
        Case("mha", torch.bfloat16, "layer_first", 4),
    ),
    "k_and_v_swapped_in_pages": (
        _canonical_order_permuted(lambda a: a[:, ::-1], lambda a: a[:, ::-1]),
        Case("mha", torch.float16, "page_first", 1),
    ),
    "heads_and_dims_swapped_in_pages": (
        _canonical_order_permuted(lambda a: a.swapaxes(4, 5), lambda a: a.swapaxes(4, 5)),
        Case("mha", torch.float32, "page_first", 4),
    ),
    "mla_tokens_reversed_in_pages": (
        _canonical_order_permuted(lambda a: a[:, :, :, ::-1], lambda a: a[:, :, :, ::-1]),
        Case("mla", torch.bfloat16, "layer_first", 4),
    ),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_layout_wrong_on_both_sides_is_caught(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inject, case = MUTANTS[name]
    inject(monkeypatch)
    run = offload(case, tmp_path)
    assert round_trip_ok(run), "the mutant should survive a round trip (that is the point)"
    found = [p for p in [host_problem(run)] + file_problems(run, tmp_path) if p]
    assert found, f"{name} was not caught"
