"""The object keys a page is stored under: SGLang 0.5.23 MooncakeStore's, so a kvfsm decode and an SGLang prefill
of one deployment read each other's pages."""

from __future__ import annotations

from collections.abc import Sequence


def sglang_mooncake_prefix(model_name: str = "", backend_tag: str | None = None) -> str | None:
    """SGLang 0.5.23 MooncakeStore's `config_prefix`: `{extra_backend_tag}_{model}` ("/" -> "-"), either
    part left out when unset; None when both are."""
    parts = [] if backend_tag is None else [str(backend_tag)]
    if model_name:
        parts.append("-".join(model_name.split("/")))
    return "_".join(parts) if parts else None


def sglang_mooncake_keys(
    page_hash: str, *, model_name: str = "", tp_rank: int = 0, is_mla: bool = False, backend_tag: str | None = None
) -> list[str]:
    """The object keys SGLang 0.5.23's MooncakeStore (`batch_set_v1`: `_tag_keys`, `_get_mha_buffer_meta` /
    `_get_mla_buffer_meta`) stores one KV page under, without pipeline, decode-context parallelism or
    split heads: `{prefix}_{hash}_{tp_rank}_k` and `..._v` for MHA (K and V are separate objects; no TP
    size in the key), `{prefix}_{hash}__k` for MLA (one latent object, shared by every rank)."""
    prefix = sglang_mooncake_prefix(model_name, backend_tag)
    tagged = page_hash if prefix is None else f"{prefix}_{page_hash}"
    if is_mla:
        return [f"{tagged}__k"]
    return [f"{tagged}_{tp_rank}_k", f"{tagged}_{tp_rank}_v"]


class ObjectKeys:
    """`sglang_mooncake_keys` for one store's model, rank and tag, precomputed: the hot path builds a batch's
    keys with one comprehension."""

    def __init__(
        self, *, model_name: str = "", tp_rank: int = 0, is_mla: bool = False, backend_tag: str | None = None
    ) -> None:
        prefix = sglang_mooncake_prefix(model_name, backend_tag)
        self.prefix = "" if prefix is None else prefix + "_"
        self.suffixes = ["__k"] if is_mla else [f"_{tp_rank}_k", f"_{tp_rank}_v"]

    def of(self, key: str) -> list[str]:
        """The object keys of page hash `key`: K then V for MHA, one for MLA."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"storage key must be a non-empty string, got {key!r}")
        return [self.prefix + key + sfx for sfx in self.suffixes]

    def of_pages(self, keys: Sequence[str]) -> list[str]:
        """The object keys of pages `keys`, page by page (K, V per MHA page)."""
        prefix, sfx = self.prefix, self.suffixes
        try:
            mkeys = [prefix + k + s for k in keys for s in sfx]
        except TypeError:
            mkeys = []
        if len(mkeys) != len(keys) * len(sfx) or not all(keys):
            bad = next(k for k in keys if not isinstance(k, str) or not k)
            raise ValueError(f"storage key must be a non-empty string, got {bad!r}")
        return mkeys
