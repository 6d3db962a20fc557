"""Configuration errors are ConfigErrors naming the field, raised before anything is allocated.

Each test pins a first-use trap that was silent, raw or late before: the constructor's raw pydantic
error, a file as storage_dir found only after the host pool was allocated, copy_backend="cuda" quietly
running on the CPU, silent stride rounding, a stride no host pool could take, mistyped KVFSM_* variables,
and storage_backend="mooncake", which the config refused although the docs name it.
"""

from __future__ import annotations

import functools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from timing import TimedOut, tree_cpu, wait_for

from kvfsm.dataplane import CpuCopyEngine, DeviceKVPool, HostKVPool, KVCacheConfig, ReqToTokenPool, TokenSlotAllocator
from kvfsm.dataplane.storage.process import CHILD_FILE_WRITERS
from kvfsm.errors import ConfigError
from kvfsm.runtime import DecodeOffloadManager, OffloadConfig, SimplePrefixCache

KV = KVCacheConfig(num_layers=2, kv_heads=1, head_dim=4, attention="mha", dtype=torch.float32)


class Pools:
    """An engine's own pools, small, on the CPU."""

    def __init__(self, slots: int = 64, page: int = 4, rows: int = 4) -> None:
        self.device_pool = DeviceKVPool.create(KV, slots)
        self.allocator = TokenSlotAllocator(slots, page)
        self.table = ReqToTokenPool(rows, 64)
        self.protected = SimplePrefixCache()

    def manager(self, config: OffloadConfig, **kw: Any) -> DecodeOffloadManager:
        return DecodeOffloadManager(
            config,
            device_pool=self.device_pool,
            allocator=self.allocator,
            req_to_token=self.table,
            prefix_cache=self.protected,
            **kw,
        )


@pytest.fixture
def no_host_pool(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Fails the test if a host pool is allocated; lists the sizes asked for otherwise (none)."""
    asked: list[int] = []

    def refuse(self: HostKVPool, config: KVCacheConfig, num_slots: int, *args: Any, **kwargs: Any) -> None:
        asked.append(num_slots)
        raise AssertionError(f"a host pool of {num_slots} slots was allocated before the config error")

    monkeypatch.setattr(HostKVPool, "__init__", refuse)
    return asked


# --- the model itself -----------------------------------------------------------------------------------


def test_the_constructor_raises_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError) as exc:
        OffloadConfig(page_size=0, offload_stride=8)
    err = exc.value
    assert type(err) is ConfigError and isinstance(err, ValueError)
    assert err.field == "page_size" and "greater than or equal to 1" in err.reason
    assert isinstance(err.__cause__, ValidationError) and str(err).startswith("OffloadConfig: page_size: ")
    with pytest.raises(ConfigError) as exc:
        OffloadConfig.model_validate({"page_size": 4, "backup_queue_size": 0})
    assert exc.value.field == "backup_queue_size"


def test_the_backup_queue_holds_what_the_host_pool_holds_unless_sized() -> None:
    """Unsized, the backup queue takes every chunk the host pool can hold (its slots over the stride), so a
    progress check queues every acknowledged copy's backup and none parks while the pool has room; its room
    comes back once a check, so a fixed size passes at most that many chunks an iteration to the store."""
    pools = Pools(slots=64, page=4)
    config = dict(page_size=4, offload_stride=8, host_pool_bytes=None, host_pool_ratio=2.0, copy_backend="cpu")
    unsized = pools.manager(OffloadConfig(**config, storage_backend="none"))
    assert unsized.fx.worker.capacity == unsized.host_pool.capacity // 8 == 16
    sized = Pools(slots=64, page=4).manager(OffloadConfig(**config, storage_backend="none", backup_queue_size=3))
    assert sized.fx.worker.capacity == 3
    # whole chunks only (a pool of 10.7 strides queues 10), and at least one (a pool of under two strides)
    odd = [
        Pools(slots=64, page=4).manager(OffloadConfig(**{**config, "offload_stride": s}, storage_backend="none"))
        for s in (12, 96)
    ]
    assert [type(m.fx.worker.capacity) for m in odd] == [int, int]
    assert (
        [m.fx.worker.capacity for m in odd]
        == [128 // 12, 1]
        == [m.host_pool.capacity // s for m, s in zip(odd, (12, 96))]
    )
    for m in (unsized, sized, *odd):
        m.close()


def test_every_problem_is_listed_and_unknown_fields_get_a_suggestion() -> None:
    with pytest.raises(ConfigError) as exc:
        OffloadConfig(page_size=0, offload_stride=-1)
    assert exc.value.field == "page_size" and [f for f, _ in exc.value.problems] == ["page_size", "offload_stride"]
    with pytest.raises(ConfigError, match=r"page_sise: unknown field; did you mean 'page_size'\?") as exc:
        OffloadConfig(page_sise=4)
    assert exc.value.field == "page_sise"
    with pytest.raises(ConfigError) as exc:
        OffloadConfig(host_pool_ratio=None, host_pool_bytes=None)
    assert exc.value.field == "host_pool_bytes" and "host_pool_ratio" in exc.value.reason


def test_a_config_file_past_a_bound_is_named_with_its_line_and_the_bound(tmp_path: Path) -> None:
    """A YAML config file nested past CONFIG_LIMITS is refused as the offload config it is, at its line."""
    cfg = tmp_path / "offload.yaml"
    cfg.write_text("page_size: 4\noffload_stride: " + "[" * 20 + "]" * 20 + "\n")
    with pytest.raises(ConfigError, match=r":2: offload config nests deeper than 16 levels") as exc:
        OffloadConfig.from_file(cfg)
    assert exc.value.source == f"{cfg}:2"


def test_config_errors_pickle_with_their_fields() -> None:
    try:
        OffloadConfig(page_size=0, offload_stride=-1)
    except ConfigError as exc:
        back = pickle.loads(pickle.dumps(exc))
        assert (back.field, back.reason, back.source, back.problems, str(back)) == (
            exc.field,
            exc.reason,
            exc.source,
            exc.problems,
            str(exc),
        )


def test_stride_rounding_is_logged_as_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """The seed rounds the stride down to whole pages, and configs written for it (and the verifier's
    bounds) rely on that: rounding stays, but never silently."""
    caplog.set_level(logging.WARNING, logger="kvfsm")
    assert OffloadConfig(page_size=4, offload_stride=10).stride == 8
    (rec,) = caplog.records
    assert rec.levelno == logging.WARNING and rec.name == "kvfsm.runtime.config"
    assert (
        "offload_stride=10" in rec.getMessage() and "page_size=4" in rec.getMessage() and "8 tokens" in rec.getMessage()
    )
    caplog.clear()
    OffloadConfig(page_size=4, offload_stride=8)
    OffloadConfig(page_size=4)  # 0: one page, as documented
    assert caplog.records == []


# --- what is checked when the manager is built, before it allocates --------------------------------------


def test_a_file_as_storage_dir_is_refused_before_the_host_pool(tmp_path: Path, no_host_pool: list[int]) -> None:
    blocker = tmp_path / "store"
    blocker.write_text("not a directory")
    config = OffloadConfig(page_size=4, offload_stride=8, host_pool_bytes=1 << 30, storage_dir=blocker)
    with pytest.raises(ConfigError) as exc:
        Pools().manager(config, copy_engine=CpuCopyEngine())
    assert exc.value.field == "storage_dir" and "not a directory" in exc.value.reason and str(blocker) in str(exc.value)
    inside = OffloadConfig(page_size=4, offload_stride=8, storage_dir=blocker / "deeper" / "store")
    with pytest.raises(ConfigError, match="cannot be created") as exc:
        Pools().manager(inside, copy_engine=CpuCopyEngine())
    assert exc.value.field == "storage_dir" and no_host_pool == []


def test_copy_backend_cuda_without_a_cuda_pool_is_refused(tmp_path: Path, no_host_pool: list[int]) -> None:
    config = OffloadConfig(page_size=4, copy_backend="cuda", storage_dir=tmp_path)
    with pytest.raises(ConfigError) as exc:
        Pools().manager(config)  # the device pool is on the CPU (and, on this machine, maybe CUDA is absent)
    assert exc.value.field == "copy_backend" and "'cuda' needs a device pool on a CUDA device" in exc.value.reason
    assert no_host_pool == []


def test_copy_backend_auto_on_the_cpu_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvfsm")
    manager = Pools().manager(OffloadConfig(page_size=4, copy_backend="auto", storage_dir=tmp_path))
    assert type(manager.fx.copy_engine) is CpuCopyEngine
    (rec,) = [r for r in caplog.records if r.name == "kvfsm.runtime.build"]
    assert rec.levelno == logging.WARNING and "copy_backend='auto'" in rec.getMessage()
    manager.close()
    caplog.clear()
    manager = Pools().manager(OffloadConfig(page_size=4, copy_backend="cpu", storage_dir=tmp_path))
    assert type(manager.fx.copy_engine) is CpuCopyEngine and caplog.records == []  # chosen: nothing to say
    manager.close()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "cuda"])
def test_a_cuda_device_pool_gets_the_cuda_engine_without_a_warning(
    backend: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvfsm.dataplane import CudaCopyEngine

    caplog.set_level(logging.WARNING, logger="kvfsm")
    pools = Pools()
    pools.device_pool = DeviceKVPool.create(KV, 64, "cuda")
    manager = pools.manager(OffloadConfig(page_size=4, copy_backend=backend, storage_dir=tmp_path))
    assert type(manager.fx.copy_engine) is CudaCopyEngine and manager.fx.copy_engine.device == pools.device_pool.device
    assert caplog.records == []
    manager.close()


@pytest.mark.gpu
def test_copy_backend_cuda_with_a_cpu_device_pool_names_the_pool(tmp_path: Path, no_host_pool: list[int]) -> None:
    with pytest.raises(ConfigError, match="the device pool is on cpu") as exc:
        Pools().manager(OffloadConfig(page_size=4, copy_backend="cuda", storage_dir=tmp_path))
    assert exc.value.field == "copy_backend"


@pytest.mark.parametrize("given_pool", [False, True])
def test_a_stride_larger_than_the_host_pool_is_refused(tmp_path: Path, given_pool: bool) -> None:
    pools = Pools(slots=64, page=4)
    kw: dict[str, Any] = {"copy_engine": CpuCopyEngine()}
    if given_pool:
        kw["host_pool"] = HostKVPool(KV, 16, 4)
        config = OffloadConfig(page_size=4, offload_stride=32, storage_dir=tmp_path)
    else:
        config = OffloadConfig(page_size=4, offload_stride=64, host_pool_ratio=0.5, storage_dir=tmp_path)  # 32 slots
    with pytest.raises(ConfigError) as exc:
        pools.manager(config, **kw)
    assert exc.value.field == "offload_stride" and "does not fit the host pool" in exc.value.reason


def test_a_host_pool_smaller_than_a_page_is_refused(tmp_path: Path, no_host_pool: list[int]) -> None:
    config = OffloadConfig(page_size=4, host_pool_bytes=KV.bytes_per_token * 3, storage_dir=tmp_path)
    with pytest.raises(ConfigError) as exc:
        Pools().manager(config, copy_engine=CpuCopyEngine())
    assert exc.value.field == "host_pool_bytes" and "less than one page" in exc.value.reason


def test_storage_dir_default_and_none_backend_are_warned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvfsm")
    monkeypatch.chdir(tmp_path)
    manager = Pools().manager(OffloadConfig(page_size=4), copy_engine=CpuCopyEngine())
    (rec,) = caplog.records
    assert "storage_dir is not set" in rec.getMessage() and str(tmp_path / "kvfsm-store") in rec.getMessage()
    manager.close()
    caplog.clear()
    manager = Pools().manager(OffloadConfig(page_size=4, storage_backend="none"), copy_engine=CpuCopyEngine())
    (rec,) = caplog.records
    assert "storage_backend='none'" in rec.getMessage() and manager.fx.storage is None
    manager.close()


def test_file_storage_options_are_checked_and_passed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as exc:
        OffloadConfig(storage_extra={"writers": 0})
    assert exc.value.field == "storage_extra.writers" and "positive" in exc.value.reason
    with pytest.raises(ConfigError, match="did you mean 'fsync'") as exc:
        OffloadConfig(storage_extra={"fsnyc": True})
    with pytest.raises(ConfigError, match="expected bool"):
        OffloadConfig(storage_extra={"fsync": 1})
    with pytest.raises(ConfigError, match="set by the manager") as exc:
        OffloadConfig(storage_extra={"directory": "/tmp/x"})
    assert exc.value.field == "storage_extra.directory"
    manager = Pools().manager(
        OffloadConfig(page_size=4, storage_dir=tmp_path, storage_extra={"fsync": True, "writers": 2}),
        copy_engine=CpuCopyEngine(),
    )
    assert manager.fx.storage.fsync is True and manager.fx.storage.writers == 2
    manager.close()


@pytest.mark.parametrize("backend", ["none", "mooncake"])
def test_storage_process_needs_the_file_backend(backend: str) -> None:
    extra = {"master_server_addr": "127.0.0.1:50051"} if backend == "mooncake" else {}
    with pytest.raises(ConfigError) as exc:
        OffloadConfig(storage_backend=backend, storage_extra=extra, storage_process=True)
    assert exc.value.field == "storage_process" and repr(backend) in exc.value.reason


@pytest.mark.parametrize(
    "process, extra, writers",
    [(True, {}, CHILD_FILE_WRITERS), (True, {"writers": 2}, 2), (False, {}, None), (False, {"writers": 3}, 3)],
)
def test_the_child_file_store_runs_its_writers_unless_storage_extra_sets_them(
    tmp_path: Path, process: bool, extra: dict[str, int], writers: int | None
) -> None:
    """In a child process the file store's writers take none of the scheduler's interpreter time, so it gets
    CHILD_FILE_WRITERS; in process FileStorage keeps its own default (one); `storage_extra`'s count wins in both."""
    from kvfsm.runtime.build import storage_factory

    config = OffloadConfig(page_size=8, storage_dir=tmp_path, storage_process=process, storage_extra=extra)
    device_pool = DeviceKVPool(KVCacheConfig(num_layers=3, head_dim=8, kv_heads=2), 64, torch.device("cpu"))  # type: ignore[arg-type]
    make = storage_factory(config, device_pool, tp_rank=0, tp_size=1)
    assert isinstance(make, functools.partial)
    store = make.args[0] if process else make  # the child's factory, inside ProcessStorage's
    assert isinstance(store, functools.partial) and store.keywords.get("writers") == writers


# --- KVFSM_* variables ------------------------------------------------------------------------------------


def test_mistyped_environment_variables_are_warned_with_the_closest_name(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvfsm")
    env = {
        "KVFSM_PAGE_SIZ": "4",
        "KVFSM_OFFLOAD_STRIDE": "8",
        "KVFSM_FUZZ": "deep",
        "KVFSM_REQUIRE_MOONCAKE": "1",
        "KVFSM_CU_BATCH": "off",
        "KVFSM_ZZZ": "1",
        "PATH": "/bin",
    }
    config = OffloadConfig.from_env(env)
    assert config.page_size == 1 and config.offload_stride == 8  # the typo set nothing
    messages = sorted(r.getMessage() for r in caplog.records)
    assert len(messages) == 2, messages  # kvfsm's own non-config variables are known
    assert "KVFSM_PAGE_SIZ" in messages[0] and "did you mean KVFSM_PAGE_SIZE?" in messages[0]
    assert "KVFSM_ZZZ" in messages[1] and "did you mean" not in messages[1]


def test_environment_text_fields_stay_text() -> None:
    config = OffloadConfig.from_env(
        {
            "KVFSM_MODEL_NAME": "1234",
            "KVFSM_STORAGE_DIR": "123",
            "KVFSM_PAGE_SIZE": "4",
            "KVFSM_STORAGE_EXTRA": '{"writers": 2}',
        }
    )
    assert config.model_name == "1234" and config.storage_dir == Path("123") and config.page_size == 4
    assert config.storage_extra == {"writers": 2}
    with pytest.raises(ConfigError, match=r"^environment \(KVFSM_\*\): page_size: ") as exc:
        OffloadConfig.from_env({"KVFSM_PAGE_SIZE": "four"})
    assert exc.value.source == "environment (KVFSM_*)"


# --- storage_backend="mooncake" ---------------------------------------------------------------------------


def test_mooncake_is_a_backend_and_its_options_are_checked() -> None:
    with pytest.raises(ConfigError) as exc:
        OffloadConfig(storage_backend="mooncake")
    assert exc.value.field == "storage_extra.master_server_addr" and "required" in exc.value.reason
    with pytest.raises(ConfigError, match="did you mean 'master_server_addr'"):
        OffloadConfig(storage_backend="mooncake", storage_extra={"master_server": "127.0.0.1:50051"})
    with pytest.raises(ConfigError, match="not a port number") as exc:
        OffloadConfig(storage_backend="mooncake", storage_extra={"master_server_addr": "127.0.0.1:rpc"})
    with pytest.raises(ConfigError, match="must be positive") as exc:
        OffloadConfig(storage_backend="mooncake", storage_extra={"master_server_addr": "h:1", "op_timeout_s": 0})
    assert exc.value.field == "storage_extra.op_timeout_s"
    with pytest.raises(ConfigError, match="from model_name"):
        OffloadConfig(storage_backend="mooncake", storage_extra={"master_server_addr": "h:1", "model_name": "m"})
    config = OffloadConfig(
        storage_backend="mooncake",
        storage_extra={"master_server_addr": "127.0.0.1:50051", "op_timeout_s": 2, "protocol": "tcp"},
    )
    assert config.storage_backend == "mooncake"


def test_mooncake_not_installed_is_a_config_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, no_host_pool: list[int]
) -> None:
    for name in ("mooncake", "mooncake.store"):
        monkeypatch.setitem(sys.modules, name, None)  # what an environment without the wheel imports
    config = OffloadConfig(page_size=4, storage_backend="mooncake", storage_extra={"master_server_addr": "127.0.0.1:1"})
    with pytest.raises(ConfigError) as exc:
        Pools().manager(config, copy_engine=CpuCopyEngine())
    assert exc.value.field == "storage_backend" and "kvfsm[mooncake]" in exc.value.reason
    assert no_host_pool == []


REQUIRED = os.environ.get("KVFSM_REQUIRE_MOONCAKE") == "1"


def _unavailable(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"{reason} (KVFSM_REQUIRE_MOONCAKE=1)")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(RPC address, metadata URL) of a mooncake_master on loopback, stopped by its pid; skipped (failed
    under KVFSM_REQUIRE_MOONCAKE=1) without the wheel, as tests/mooncake does."""
    from kvfsm.dataplane.storage.mooncake import (
        LOOPBACK_ENV,
        MooncakeUnavailable,
        import_store_class,
        master_binary,
        master_command,
    )

    try:
        import_store_class()
    except MooncakeUnavailable as exc:
        _unavailable(str(exc))
    binary = master_binary()
    if binary is None:
        _unavailable("mooncake_master binary not found in the mooncake wheel")
    logs = tmp_path_factory.mktemp("mooncake")
    for attempt in range(3):  # a picked port can be taken (by another test process, say) before the master binds it
        rpc, http, metrics = _free_port(), _free_port(), _free_port()
        log = logs / f"master-{attempt}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                master_command(binary, rpc, http, metrics),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:  # a hang guard on the master's progress (tests/timing.py), not a fixed timeout
            wait_for(
                lambda: proc.poll() is not None or (_accepts(rpc) and _accepts(http)),
                f"mooncake_master (pid {proc.pid}) to listen on {rpc} and {http}",
                20,
                progress=lambda: tree_cpu(proc.pid),
                ceiling_s=300,
            )
        except TimedOut as exc:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            why = str(exc)
        else:
            if proc.poll() is None:
                break
            why = "it exited"
        if attempt == 2:
            _unavailable(f"mooncake_master did not come up ({why}): {log.read_text(errors='replace')[-500:]}")
    try:
        with pytest.MonkeyPatch.context() as mp:  # loopback only, bounded setup (read when a client sets up)
            for key, value in {
                **LOOPBACK_ENV,
                "MC_RPC_TIMEOUT_MS": "3000",
                "MC_RPC_CONNECT_TIMEOUT_MS": "1000",
                "MC_STORE_CLIENT_SETUP_RETRIES": "2",
            }.items():
                mp.setenv(key, value)
            yield f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)


class Req:
    """An OffloadRequest, as the integration example of docs/integrations.md writes one."""

    def __init__(self, rid: str, prompt: list[int], row: int) -> None:
        self.rid, self.origin_input_ids, self.output_ids = rid, prompt, []
        self.req_pool_idx, self.kv_committed_len, self.kv_allocated_len, self.prefix_len = row, 0, 0, 0

    def finished(self) -> bool:
        return False


def test_a_manager_built_from_a_mooncake_config_stores_and_reads_back(mooncake_master: tuple[str, str]) -> None:
    addr, metadata = mooncake_master
    config = OffloadConfig(
        page_size=4,
        offload_stride=8,
        copy_backend="cpu",
        storage_backend="mooncake",
        model_name=f"test/{uuid.uuid4().hex[:8]}",
        checked=True,
        storage_extra={
            "master_server_addr": addr,
            "metadata_server": metadata,
            "global_segment_size": 32 << 20,
            "local_buffer_size": 16 << 20,
            "op_timeout_s": 5.0,
            "setup_timeout_s": 15.0,
            "close_timeout_s": 3.0,
            "read_pool_bytes": 16 << 20,
        },
    )
    pools = Pools(slots=128, page=4)
    pools.device_pool.token_view().copy_(torch.randn_like(pools.device_pool.token_view()))
    manager = pools.manager(config)
    storage = manager.fx.storage
    m = config.model_name.replace("/", "-")
    assert type(storage).__name__ == "MooncakeStorage" and storage.key_of("h") == [f"{m}_h_0_k", f"{m}_h_0_v"]
    req = Req("r", list(range(10)), pools.table.alloc())
    for step in range(20):
        length = len(req.origin_input_ids) + len(req.output_ids)
        while req.kv_allocated_len < length:
            pools.table.write(req.req_pool_idx, req.kv_allocated_len, pools.allocator.alloc(4))
            req.kv_allocated_len += 4
        req.kv_committed_len = length
        req.output_ids.append(step)
        manager.offload(req)
        manager.check_progress()
    manager.drain()
    assert manager.metrics.backup_failures == 0 and manager.metrics.stored_pages == 4  # [8, 24) of 29 committed
    hashes = list(manager.fx.stored)
    pages = storage.batch_get(hashes)
    dev = pools.device_pool.token_view()
    for h, page in zip(hashes, pages):
        _, pos = manager.fx.stored[h]
        slots = pools.table.read_host(req.req_pool_idx, pos, pos + 4)
        want = dev.index_select(2, slots).contiguous().view(torch.uint8).reshape(-1)
        assert page is not None and torch.equal(page, want), (h, pos)
    manager.finalize(req)
    manager.drain()
    manager.close()  # closes the store it built
    assert storage._closed and pools.allocator.free_slots == pools.allocator.capacity
