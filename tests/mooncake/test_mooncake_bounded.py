"""MooncakeStorage's bounded calls, against a scripted stand-in client (runs without the mooncake wheel).

A call that outlives op_timeout_s is reported failed at the deadline; a put that completes after that has
its pages removed again; while every worker is stuck, calls fail at once; close never closes the client
under a running call.
"""

from __future__ import annotations

import threading
import time

import torch

from timing import scaled, wait_for

from kvfsm.dataplane.storage.mooncake import OBJECT_NOT_FOUND, RPC_FAIL, MooncakeStorage


class ScriptedClient:
    """Dict-backed stand-in for MooncakeDistributedStore's batch API; `gate` holds calls while cleared."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.calls: list[str] = []
        self.running = 0
        self.closed_while_running = False
        self.closed = False

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        self.running += 1
        self.gate.wait(30)

    def batch_put_from(self, keys, ptrs, sizes, cfg=None):  # type: ignore[no-untyped-def]
        self._enter("put")
        try:
            for k, p, n in zip(keys, ptrs, sizes):
                import ctypes

                self.objects.setdefault(k, ctypes.string_at(p, n))
            return [0] * len(keys)
        finally:
            self.running -= 1

    def batch_get_into(self, keys, ptrs, sizes):  # type: ignore[no-untyped-def]
        self._enter("get")
        try:
            import ctypes

            out = []
            for k, p, _size in zip(keys, ptrs, sizes):
                data = self.objects.get(k)
                if data is None:
                    out.append(OBJECT_NOT_FOUND)
                else:
                    ctypes.memmove(p, data, len(data))
                    out.append(len(data))
            return out
        finally:
            self.running -= 1

    def batch_is_exist(self, keys):  # type: ignore[no-untyped-def]
        self._enter("exists")
        self.running -= 1
        return [1 if k in self.objects else 0 for k in keys]

    def get_size(self, key):  # type: ignore[no-untyped-def]
        return len(self.objects[key]) if key in self.objects else OBJECT_NOT_FOUND

    def batch_remove(self, keys, force=False):  # type: ignore[no-untyped-def]
        for k in keys:
            self.objects.pop(k, None)
        return [0] * len(keys)

    def close(self) -> int:
        self.closed_while_running = self.running > 0
        self.closed = True
        return 0


def storage(client: ScriptedClient, **kw) -> MooncakeStorage:  # type: ignore[no-untyped-def]
    kw.setdefault("op_timeout_s", 0.3)
    return MooncakeStorage("127.0.0.1:1", client=client, model_name="m", **kw)


def pages(n: int) -> list[torch.Tensor]:
    return [torch.full((64,), i, dtype=torch.uint8) for i in range(n)]


def test_round_trip_through_the_call_path() -> None:
    c = ScriptedClient()
    s = storage(c)
    assert s.batch_set(["a", "b"], pages(2)) == [True, True]
    assert set(c.objects) == {"m_a_0_k", "m_a_0_v", "m_b_0_k", "m_b_0_v"}  # SGLang's keys: K and V objects
    assert bytes(c.objects["m_a_0_k"]) + bytes(c.objects["m_a_0_v"]) == pages(2)[0].numpy().tobytes()
    got = s.batch_get(["a", "b", "z"])
    assert torch.equal(got[0], pages(2)[0]) and torch.equal(got[1], pages(2)[1]) and got[2] is None
    assert s.batch_exists(["a", "z", "b"]) == 1
    s.close()
    assert c.closed


def test_timed_out_put_is_failed_and_undone_when_it_completes_late() -> None:
    c = ScriptedClient()
    s = storage(c, workers=2)
    c.gate.clear()
    t0 = time.monotonic()
    assert s.batch_set(["late"], pages(1)) == [False]
    assert time.monotonic() - t0 < s.op_timeout_s + scaled(0.7)  # at the deadline (slack in this machine's seconds)
    assert s.stats.timeouts == 1 and s.stats.writes_failed == 1
    c.gate.set()  # the put finishes after its caller was told it failed...
    wait_for(lambda: s.stats.late_removed, "the late put's pages to be removed", 2.0, poll_s=0.01)
    assert s.stats.late_removed == 2 and not c.objects  # ...so what it wrote (K and V) is removed
    s.close()


def test_stuck_workers_fail_fast_and_close_waits_for_them() -> None:
    c = ScriptedClient()
    s = storage(c, workers=2, close_timeout_s=0.2, page_nbytes=64)
    c.gate.clear()
    assert s.batch_get(["x"]) == [None] and s.batch_exists(["x"]) == 0  # two stuck calls: both workers
    assert s.stats.timeouts == 2
    assert s.batch_set(["y"], pages(1)) == [False]  # no worker left: fails at once, not after the timeout...
    assert s.batch_exists(["y"]) == 0
    assert s.stats.timeouts == 2 and s.stats.errors["WEDGED"] == 3  # ...(no call waited for its deadline)
    assert c.calls.count("put") == 0
    s.close()
    assert not c.closed  # the client is not closed under running calls...
    c.gate.set()
    wait_for(lambda: c.closed, "the client to be closed once its calls returned", 2.0, poll_s=0.01)
    assert c.closed and not c.closed_while_running  # ...but as soon as they return


def test_client_errors_are_per_page_failures() -> None:
    class Failing(ScriptedClient):
        def batch_put_from(self, keys, ptrs, sizes, cfg=None):  # type: ignore[no-untyped-def]
            return [0 if i // 2 % 2 == 0 else RPC_FAIL for i in range(len(keys))]  # per page: K and V

        def batch_is_exist(self, keys):  # type: ignore[no-untyped-def]
            raise RuntimeError("client exploded")

    s = storage(Failing())
    assert s.batch_set(["a", "b", "c"], pages(3)) == [True, False, True]
    assert s.batch_exists(["a"]) == 0  # an exception is a failure, never raised to the caller
    assert s.stats.errors["RPC_FAIL (master unreachable?)"] == 2  # both objects of the failed page
    s.close()


def test_from_config_keys_carry_model_and_rank() -> None:
    from kvfsm.runtime import OffloadConfig

    cfg = OffloadConfig(
        storage_backend="none",
        model_name="org/model",
        storage_extra={"master_server_addr": "127.0.0.1:1", "op_timeout_s": 0.5},
    )
    s = MooncakeStorage.from_config(cfg, tp_rank=1, tp_size=4, client=ScriptedClient())
    assert s.key_of("abc") == ["org-model_abc_1_k", "org-model_abc_1_v"] and s.op_timeout_s == 0.5
    s.close()
    mla = MooncakeStorage.from_config(cfg, tp_rank=1, tp_size=4, is_mla=True, client=ScriptedClient())
    assert mla.key_of("abc") == ["org-model_abc__k"]  # MLA: the latent is the same on every rank
    mla.close()
