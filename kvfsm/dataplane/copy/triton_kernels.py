"""Triton kernel that copies KV token rows between two pools, gathering and scattering in one pass.

Both pools are presented as `(planes, layers, slots, row)` with the row (heads x head_dim) contiguous.
One program moves TOKENS token rows of one (plane, layer): it loads the slot indices, then copies each
row as 32-bit words; when a row is a multiple of 16 bytes the offsets are hinted as multiples of 4 words
so loads and stores are 16 bytes wide. The source or the destination may be pinned host memory: its
pointer is valid on the device through unified virtual addressing, so device pages go straight into
scattered host slots (and back) with no staging buffer and no host-side scatter.

The import of triton is guarded: on machines without it (CI, this project's CPU hosts) the module loads
and `HAVE_TRITON` is False. With TRITON_INTERPRET=1 the same kernel runs on CPU tensors (tests).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:  # pragma: no cover - depends on the machine
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # ImportError, or a broken install: fall back to the torch path
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAVE_TRITON = False


def triton_usable() -> bool:
    """True when the Triton path can run here: triton imports and either CUDA or the interpreter is on."""
    return HAVE_TRITON and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape. tokens: rows per program; layer_fastest: consecutive programs walk (plane, layer)
    of one token block, which keeps page_first host writes sequential."""

    tokens: int = 4
    num_warps: int = 4
    layer_fastest: bool = False


def default_config(host_layout: str) -> KernelConfig:
    return KernelConfig(tokens=4, num_warps=4, layer_fastest=host_layout == "page_first")


if HAVE_TRITON:

    @triton.jit
    def _program_rows(
        n_tokens, num_rows_pl, NUM_LAYERS: tl.constexpr, TOKENS: tl.constexpr, LAYER_FASTEST: tl.constexpr
    ):
        """This program's (plane x layer) index, plane, layer, TOKENS token positions and their mask."""
        pid = tl.program_id(0)
        if LAYER_FASTEST:
            pl = pid % num_rows_pl
            tb = pid // num_rows_pl
        else:
            n_tb = tl.cdiv(n_tokens, TOKENS)
            pl = pid // n_tb
            tb = pid % n_tb
        toks = tb * TOKENS + tl.arange(0, TOKENS)
        return pl, (pl // NUM_LAYERS).to(tl.int64), (pl % NUM_LAYERS).to(tl.int64), toks, toks < n_tokens

    @triton.jit
    def _copy_rows(src_ptr, so, dst_ptr, do, tmask, ROW: tl.constexpr, BLOCK: tl.constexpr, MASK_COLS: tl.constexpr):
        """Rows of ROW words from src_ptr + so[t] to dst_ptr + do[t], BLOCK words at a time."""
        cols = tl.arange(0, BLOCK)
        for w in tl.static_range(0, ROW, BLOCK):
            c = w + cols
            if MASK_COLS:
                m = tmask[:, None] & (c < ROW)[None, :]
            else:
                m = tmask[:, None]
            x = tl.load(src_ptr + so[:, None] + c[None, :], mask=m)
            tl.store(dst_ptr + do[:, None] + c[None, :], x, mask=m)

    # Integer arguments are not specialised on their values (divisible by 16, equal to 1): a compiled kernel
    # then depends only on what `_Launcher` keys it by, the pointers' dtypes and 16-byte alignment, each
    # integer's width and the constexprs.
    _INTS_ROWS = [
        "n_tokens",
        "src_s_plane",
        "src_s_layer",
        "src_s_tok",
        "dst_s_plane",
        "dst_s_layer",
        "dst_s_tok",
        "num_rows_pl",
    ]
    _INTS_LAYERS = ["n_tokens", "dev_s_tok", "host_s_plane", "host_s_layer", "host_s_tok", "num_rows_pl"]

    @triton.jit(do_not_specialize=_INTS_ROWS)
    def _kv_rows_copy_kernel(
        src_ptr,
        dst_ptr,
        src_idx_ptr,
        dst_idx_ptr,
        n_tokens,
        src_s_plane,
        src_s_layer,
        src_s_tok,
        dst_s_plane,
        dst_s_layer,
        dst_s_tok,
        num_rows_pl,
        NUM_LAYERS: tl.constexpr,
        ROW: tl.constexpr,
        BLOCK: tl.constexpr,
        TOKENS: tl.constexpr,
        VEC: tl.constexpr,
        MASK_COLS: tl.constexpr,
        LAYER_FASTEST: tl.constexpr,
    ):
        _, plane, layer, toks, tmask = _program_rows(n_tokens, num_rows_pl, NUM_LAYERS, TOKENS, LAYER_FASTEST)
        s = tl.load(src_idx_ptr + toks, mask=tmask, other=0).to(tl.int64)
        d = tl.load(dst_idx_ptr + toks, mask=tmask, other=0).to(tl.int64)
        so = tl.multiple_of(plane * src_s_plane + layer * src_s_layer + s * src_s_tok, VEC)
        do = tl.multiple_of(plane * dst_s_plane + layer * dst_s_layer + d * dst_s_tok, VEC)
        _copy_rows(src_ptr, so, dst_ptr, do, tmask, ROW, BLOCK, MASK_COLS)

    @triton.jit(do_not_specialize=_INTS_LAYERS)
    def _kv_layer_rows_copy_kernel(
        layer_ptrs,
        host_ptr,
        dev_idx_ptr,
        host_idx_ptr,
        n_tokens,
        dev_s_tok,
        host_s_plane,
        host_s_layer,
        host_s_tok,
        num_rows_pl,
        NUM_LAYERS: tl.constexpr,
        ROW: tl.constexpr,
        BLOCK: tl.constexpr,
        TOKENS: tl.constexpr,
        VEC: tl.constexpr,
        MASK_COLS: tl.constexpr,
        LAYER_FASTEST: tl.constexpr,
        TO_HOST: tl.constexpr,
    ):
        # The device side of (plane, layer) is its own buffer, whose base address is entry
        # plane * NUM_LAYERS + layer of the pointer table.
        pl, plane, layer, toks, tmask = _program_rows(n_tokens, num_rows_pl, NUM_LAYERS, TOKENS, LAYER_FASTEST)
        dev_ptr = tl.load(layer_ptrs + pl).to(host_ptr.dtype)  # int64 address -> pointer of the host's word
        s = tl.load(dev_idx_ptr + toks, mask=tmask, other=0).to(tl.int64)
        h = tl.load(host_idx_ptr + toks, mask=tmask, other=0).to(tl.int64)
        do = tl.multiple_of(s * dev_s_tok, VEC)
        ho = tl.multiple_of(plane * host_s_plane + layer * host_s_layer + h * host_s_tok, VEC)
        if TO_HOST:
            _copy_rows(dev_ptr, do, host_ptr, ho, tmask, ROW, BLOCK, MASK_COLS)
        else:
            _copy_rows(host_ptr, ho, dev_ptr, do, tmask, ROW, BLOCK, MASK_COLS)


class _Launcher:
    """Launches a kernel compiled once per key through its compiled handle, not through `JITFunction.run`.

    `kernel[grid](...)` binds and specialises every argument and hashes a cache key on each launch before
    the driver call. The first launch of a key goes that way and keeps the compiled kernel it returns; later
    ones call it directly (`CompiledKernel[grid]`). The key is everything the compile depends on for these
    kernels: the device, the warps, the constexprs, each pointer's dtype and 16-byte alignment, and each
    integer's width (their values are not specialised: `do_not_specialize`). Under the Triton interpreter,
    or a Triton whose launch returns no compiled kernel, every launch takes `kernel[grid]`.
    It is off (`enabled = False`) until bench/probes/launch_probe.py has measured on the H200 what it saves and
    checked every copy it launched; the probe turns it on for its own launches."""

    def __init__(self) -> None:
        self._compiled: dict[tuple, object] = {}
        # False: every launch is kernel[grid] (also set once a compiled handle refused its arguments)
        self.enabled = False

    def __call__(self, kernel: object, grid: tuple[int], args: tuple, constexprs: dict, num_warps: int) -> None:
        if not self.enabled:  # no key to build: the launch is kernel[grid]'s
            kernel[grid](*args, **constexprs, num_warps=num_warps)  # type: ignore[index]
            return
        key = (
            kernel,
            num_warps,
            *constexprs.values(),
            *[
                (a.dtype, a.device, a.data_ptr() % 16 == 0)
                if isinstance(a, torch.Tensor)
                else (type(a), -(2**31) <= a < 2**31)
                for a in args
            ],
        )
        compiled = self._compiled.get(key)
        if compiled is not None:
            try:  # its runner reads all three grid dimensions
                compiled[(grid[0], 1, 1)](*args, *constexprs.values())  # type: ignore[index]
                return
            except (TypeError, ValueError, IndexError):  # raised packing the arguments, before any launch:
                self._compiled.clear()  # this Triton's handle takes them otherwise; launch as it wants
                self.enabled = False
        compiled = kernel[grid](*args, **constexprs, num_warps=num_warps)  # type: ignore[index]
        if (
            self.enabled
            and hasattr(compiled, "function")
            and hasattr(compiled, "__getitem__")
            and list(constexprs) == kernel.arg_names[len(args) :]  # type: ignore[attr-defined]
        ):
            self._compiled[key] = compiled


_launch = _Launcher()


def _word_dtype(row_bytes: int) -> tuple[torch.dtype, int]:
    """Widest word that divides a row, and the vector hint (in words) that makes accesses 16 bytes."""
    if row_bytes % 16 == 0:
        return torch.int32, 4
    if row_bytes % 4 == 0:
        return torch.int32, 1
    if row_bytes % 2 == 0:
        return torch.int16, 1
    return torch.uint8, 1


def _as_rows(view5: torch.Tensor, word: torch.dtype) -> torch.Tensor:
    """`(P, L, S, H, D)` element view → `(P, L, S, row_words)` word view of the same memory."""
    if view5.stride(-1) != 1 or view5.stride(-2) != view5.shape[-1]:
        raise ValueError("token rows must be contiguous (heads x head_dim)")
    rows = view5.view(view5.shape[0], view5.shape[1], view5.shape[2], -1)  # a view, never a silent copy
    return rows.view(word) if word != rows.dtype else rows


def _launch_walk(view5: torch.Tensor, n: int, cfg: KernelConfig) -> tuple[torch.Tensor, int, tuple[int], dict]:
    """What both kernels' launches share for n token rows of `view5`'s shape: its word view, the 16-byte
    vector hint, the grid, and the walk's constants (programs of TOKENS rows per (plane, layer))."""
    word, vec = _word_dtype(view5.shape[3] * view5.shape[4] * view5.element_size())
    rows = _as_rows(view5, word)
    planes, layers, row = rows.shape[0], rows.shape[1], rows.shape[3]
    block = min(triton.next_power_of_2(row), 1024)
    walk = dict(
        NUM_LAYERS=layers,
        ROW=row,
        BLOCK=block,
        TOKENS=cfg.tokens,
        MASK_COLS=row % block != 0,
        LAYER_FASTEST=cfg.layer_fastest,
        num_warps=cfg.num_warps,
    )
    return rows, vec, (triton.cdiv(n, cfg.tokens) * planes * layers,), walk


def _constexprs(walk: dict, **more: object) -> dict:
    """The kernels' constexprs in their signature's order (NUM_LAYERS, ROW, BLOCK, TOKENS, VEC, MASK_COLS,
    LAYER_FASTEST, then TO_HOST for the layered kernel), as `CompiledKernel[grid]` takes them."""
    out = {k: walk[k] for k in ("NUM_LAYERS", "ROW", "BLOCK", "TOKENS")}
    out["VEC"] = more.pop("VEC")
    out.update(MASK_COLS=walk["MASK_COLS"], LAYER_FASTEST=walk["LAYER_FASTEST"], **more)
    return out


def kv_rows_copy(
    src5: torch.Tensor,
    src_idx: torch.Tensor,
    dst5: torch.Tensor,
    dst_idx: torch.Tensor,
    config: KernelConfig | None = None,
) -> None:
    """dst5[:, :, dst_idx] = src5[:, :, src_idx] for `(P, L, S, H, D)` views, on the current stream.

    Index tensors must be int64 and live where the kernel runs (the device, or CPU under the
    interpreter). Either view may be pinned host memory.
    """
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    if src5.shape[:2] != dst5.shape[:2] or src5.shape[3:] != dst5.shape[3:] or src5.dtype != dst5.dtype:
        raise ValueError(f"pool shapes differ: {tuple(src5.shape)} vs {tuple(dst5.shape)}")
    n = int(src_idx.numel())
    if n != int(dst_idx.numel()):
        raise ValueError("source and destination index counts differ")
    if n == 0:
        return
    src, vec, grid, walk = _launch_walk(src5, n, config or KernelConfig())
    dst = _as_rows(dst5, src.dtype)
    _launch(
        _kv_rows_copy_kernel,
        grid,
        (
            src,
            dst,
            src_idx,
            dst_idx,
            n,
            src.stride(0),
            src.stride(1),
            src.stride(2),
            dst.stride(0),
            dst.stride(1),
            dst.stride(2),
            src.shape[0] * src.shape[1],
        ),
        _constexprs(walk, VEC=vec),
        walk["num_warps"],
    )


def kv_layer_rows_copy(
    layer_ptrs: torch.Tensor,
    token_stride: int,
    dev_idx: torch.Tensor,
    host5: torch.Tensor,
    host_idx: torch.Tensor,
    to_host: bool,
    config: KernelConfig | None = None,
) -> None:
    """Between separate per-layer device buffers and a `(P, L, S, H, D)` host view, on the current stream:
    host5[:, :, host_idx] = layers[:, :, dev_idx] when `to_host`, else the reverse.

    `layer_ptrs`: the buffers' base addresses (int64, plane-major, where the kernel runs), each buffer
    `[slots, H, D]` of host5's dtype, contiguous, `token_stride` elements per slot
    (`LayerBufferKVPool.layer_pointers()` / `.token_stride`). One launch covers every buffer."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed")
    planes, layers = int(host5.shape[0]), int(host5.shape[1])
    if int(layer_ptrs.numel()) != planes * layers:
        raise ValueError(f"{layer_ptrs.numel()} layer buffers for {planes} x {layers} (plane, layer) host rows")
    n = int(dev_idx.numel())
    if n != int(host_idx.numel()):
        raise ValueError("device and host index counts differ")
    if n == 0:
        return
    host, vec, grid, walk = _launch_walk(host5, n, config or KernelConfig())
    stride_bytes = token_stride * host5.element_size()
    word_bytes = host.element_size()
    if stride_bytes % word_bytes:
        raise ValueError(f"a token stride of {stride_bytes} bytes is not whole {word_bytes}-byte words")
    dev_s_tok = stride_bytes // word_bytes
    if dev_s_tok % vec:
        vec = 1  # the 16-byte hint needs every device row to start on a 16-byte boundary
    _launch(
        _kv_layer_rows_copy_kernel,
        grid,
        (
            layer_ptrs,
            host,
            dev_idx,
            host_idx,
            n,
            dev_s_tok,
            host.stride(0),
            host.stride(1),
            host.stride(2),
            planes * layers,
        ),
        _constexprs(walk, VEC=vec, TO_HOST=to_host),
        walk["num_warps"],
    )
