"""A page and its Mooncake objects: an MHA page is two objects (its K and V halves), an MLA page one, each in
the byte order of the deployment's `--hicache-mem-layout`. Pure tensor work, no client."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

LAYOUTS = ("layer_first", "page_first")


class PageObjects:
    """How one store splits a canonical page into objects and joins them back.

    layout: "layer_first" (each plane's (layers, tokens) in kvfsm's canonical order; SGLang's page_first_direct,
        and its layer_first for MLA) or "page_first" (SGLang's default: tokens before layers; needs `page_dims`).
    page_dims: (planes, layers, page_size), to reorder "page_first" objects (planes: 2 MHA, 1 MLA).
    """

    def __init__(self, layout: str, is_mla: bool, page_dims: tuple[int, int, int] | None) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.planes = 1 if is_mla else 2
        if page_dims is not None:
            page_dims = tuple(page_dims)  # type: ignore[assignment]
            if (
                len(page_dims) != 3
                or not all(isinstance(d, int) and d > 0 for d in page_dims)
                or page_dims[0] != self.planes
            ):
                raise ValueError(
                    f"page_dims must be ({self.planes}, layers, page_size) positive ints, got {page_dims!r}"
                )
        elif layout == "page_first":
            raise ValueError("layout='page_first' needs page_dims=(planes, layers, page_size) to reorder objects")
        self.layout, self.page_dims = layout, page_dims

    def split(self, page: torch.Tensor) -> list[torch.Tensor]:
        """A canonical page's objects in the store's byte order (views for layer_first, copies otherwise)."""
        flat = page.reshape(-1)
        if self.layout == "layer_first":
            return list(flat.view(self.planes, -1)) if self.planes > 1 else [flat]
        p, l, t = self.page_dims  # type: ignore[misc]
        if flat.numel() % (p * l * t):
            raise ValueError(f"a {flat.numel()}-byte page does not split into page_dims {self.page_dims}")
        return list(flat.view(p, l, t, -1).transpose(1, 2).contiguous().view(p, -1))

    def join(self, objs: list[torch.Tensor]) -> torch.Tensor:
        """A page's objects back to canonical bytes. layer_first: the object itself (MLA), or, for K and V
        read into adjacent buffers (the common case: one read-pool run per batch), one view over both, so
        the page aliases the read buffer; else a copy."""
        if self.layout == "layer_first":
            if len(objs) == 1:
                return objs[0]
            k, v = objs
            if (
                v.data_ptr() == k.data_ptr() + k.numel()
                and k.is_contiguous()
                and v.is_contiguous()
                and k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
            ):
                return torch.as_strided(k, (k.numel() + v.numel(),), (1,), k.storage_offset())
            return torch.cat(objs)
        p, l, t = self.page_dims  # type: ignore[misc]
        return torch.stack(objs).view(p, t, l, -1).transpose(1, 2).contiguous().view(-1)

    def pages_ok(self, codes: Sequence[Any], ok_object: Callable[[Any], bool]) -> list[bool]:
        """Per page, whether every one of its objects' codes is good: a page is stored or read only whole."""
        k = self.planes
        return [all(ok_object(c) for c in codes[i : i + k]) for i in range(0, len(codes), k)]
