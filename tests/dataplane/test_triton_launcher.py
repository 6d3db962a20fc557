"""The direct kernel's launcher (triton_kernels._Launcher), on the CPU with a stand-in kernel: which launches go
through Triton's JIT and which through the compiled handle, what keys a compiled kernel, and the fallback when a
handle refuses its arguments. The GPU tests run the real kernels through it (tests/dataplane/test_copy_engine.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvfsm.dataplane.copy.triton_kernels import _launch, _Launcher

NAMES = ["src", "dst", "n", "ROW", "VEC"]


def on() -> _Launcher:
    launch = _Launcher()
    launch.enabled = True
    return launch


def test_the_engine_s_launcher_takes_the_jit_path_until_measured_on_a_gpu() -> None:
    assert _launch.enabled is False
    k, launch = Kernel(), _Launcher()
    a = torch.zeros(8)
    for _ in range(2):
        launch(k, (1,), (a, a, 5), {"ROW": 16, "VEC": 4}, 4)
    assert [e[0] for e in k.log] == ["jit", "jit"]


class Compiled:
    """A compiled kernel's handle: `[grid]` gives a runner taking every argument in signature order."""

    function = object()

    def __init__(self, log: list, refuse: bool = False) -> None:
        self.log, self.refuse = log, refuse

    def __getitem__(self, grid: tuple) -> Any:
        def runner(*args: Any) -> None:
            if self.refuse:
                raise TypeError("this handle packs its arguments otherwise")
            self.log.append(("compiled", grid, args))

        return runner


class Kernel:
    """A JIT function: `[grid](*args, **constexprs, num_warps=)` launches and returns its compiled handle."""

    arg_names = NAMES

    def __init__(self, refuse: bool = False) -> None:
        self.log: list = []
        self.refuse = refuse

    def __getitem__(self, grid: tuple) -> Any:
        def run(*args: Any, num_warps: int, **constexprs: Any) -> Compiled:
            self.log.append(("jit", grid, args, tuple(constexprs.items()), num_warps))
            return Compiled(self.log, self.refuse)

        return run


def test_a_key_compiles_once_and_later_launches_take_the_handle_with_every_argument_in_order() -> None:
    k, launch = Kernel(), on()
    a, b = torch.zeros(8), torch.zeros(8)
    launch(k, (3,), (a, b, 5), {"ROW": 16, "VEC": 4}, 4)
    launch(k, (7,), (a, b, 9), {"ROW": 16, "VEC": 4}, 4)  # another count: the same compiled kernel
    assert [e[0] for e in k.log] == ["jit", "compiled"]
    assert k.log[1] == ("compiled", (7, 1, 1), (a, b, 9, 16, 4))  # a three-dimensional grid, constexprs last


@pytest.mark.parametrize("change", ["constexpr", "warps", "alignment", "dtype", "int width"])
def test_anything_the_compile_depends_on_compiles_again(change: str) -> None:
    k, launch = Kernel(), on()
    a, b = torch.zeros(8), torch.zeros(8)
    launch(k, (1,), (a, b, 5), {"ROW": 16, "VEC": 4}, 4)
    args: tuple = (a, b, 5)
    constexprs, warps = {"ROW": 16, "VEC": 4}, 4
    if change == "constexpr":
        constexprs = {"ROW": 32, "VEC": 4}
    elif change == "warps":
        warps = 8
    elif change == "alignment":
        args = (a[1:], b, 5)  # 4 bytes past a 16-byte boundary
    elif change == "dtype":
        args = (a.to(torch.int32), b, 5)
    else:
        args = (a, b, 2**31)  # an int64 argument, no longer an int32
    launch(k, (1,), args, constexprs, warps)
    assert [e[0] for e in k.log] == ["jit", "jit"]


def test_a_handle_that_refuses_its_arguments_turns_the_fast_path_off_and_still_launches() -> None:
    k, launch = Kernel(refuse=True), on()
    a = torch.zeros(8)
    launch(k, (1,), (a, a, 5), {"ROW": 16, "VEC": 4}, 4)
    launch(k, (1,), (a, a, 5), {"ROW": 16, "VEC": 4}, 4)  # the handle refuses: launched through the JIT instead
    launch(k, (1,), (a, a, 5), {"ROW": 16, "VEC": 4}, 4)
    assert [e[0] for e in k.log] == ["jit", "jit", "jit"] and not launch.enabled


def test_constexprs_out_of_signature_order_are_never_launched_through_a_handle() -> None:
    k, launch = Kernel(), on()
    a = torch.zeros(8)
    for _ in range(2):
        launch(k, (1,), (a, a, 5), {"VEC": 4, "ROW": 16}, 4)
    assert [e[0] for e in k.log] == ["jit", "jit"]


def test_a_launch_that_returns_no_handle_is_not_kept() -> None:
    """The Triton interpreter's launch returns None: every launch goes through it."""

    class Interpreted(Kernel):
        def __getitem__(self, grid: tuple) -> Any:
            def run(*args: Any, num_warps: int, **constexprs: Any) -> None:
                self.log.append(("jit",))

            return run

    k, launch = Interpreted(), on()
    a = torch.zeros(8)
    for _ in range(2):
        launch(k, (1,), (a, a, 5), {"ROW": 16, "VEC": 4}, 4)
    assert len(k.log) == 2
