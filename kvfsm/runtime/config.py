"""Manager configuration: one validated pydantic model, from code, a YAML/JSON file, or KVFSM_* variables.

Validation happens before any memory is allocated, and a bad value names its field.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ENV_PREFIX = "KVFSM_"


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the source."""


class OffloadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    page_size: int = Field(1, ge=1, description="Tokens per KV page.")
    offload_stride: int = Field(0, ge=0, description="Tokens per offloaded chunk; <= 0 means one page.")
    host_pool_ratio: Optional[float] = Field(2.0, gt=0, description="Host pool size as a multiple of the device pool.")
    host_pool_bytes: Optional[int] = Field(None, gt=0, description="Host pool size in bytes (wins over the ratio).")
    host_layout: Literal["layer_first", "page_first"] = "layer_first"
    copy_backend: Literal["auto", "cpu", "cuda", "deferred"] = "auto"
    storage_backend: Literal["file", "none"] = "file"
    storage_dir: Path = Path("kvfsm-store")
    storage_extra: dict[str, Any] = Field(default_factory=dict, description="Backend-specific settings.")
    model_name: str = Field("model", min_length=1)
    backup_queue_size: int = Field(64, ge=1, description="Backups queued or running at once; beyond it chunks park.")
    stored_index_pages: int = Field(1 << 20, ge=0, description=(
        "Pages the manager's stored-page index (hash -> request, position) keeps, oldest dropped first; "
        "0 keeps none. Bounded so a long-running server does not grow without limit; storage stays the "
        "authority on what it holds."))
    checked: bool = Field(False, description="Keep the slot ownership ledger and check invariants every transition.")
    trace_path: Optional[Path] = Field(None, description="Write one JSON line per transition here.")

    @model_validator(mode="after")
    def _sizes(self) -> "OffloadConfig":
        if self.host_pool_ratio is None and self.host_pool_bytes is None:
            raise ValueError("set host_pool_ratio or host_pool_bytes")
        return self

    @property
    def stride(self) -> int:
        """The seed's offload stride: a page, or the configured stride rounded down to whole pages."""
        if self.offload_stride <= 0:
            return self.page_size
        return max(self.page_size, self.offload_stride // self.page_size * self.page_size)

    @classmethod
    def load(cls, source: str = "<code>", **values: Any) -> "OffloadConfig":
        try:
            return cls(**values)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<config>'}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"{source}: invalid offload config: {problems}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "OffloadConfig":
        """YAML or JSON mapping of field names to values."""
        path = Path(path)
        try:
            text = path.read_text()
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise ConfigError(f"{path}: cannot read offload config: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: offload config must be a mapping of field names to values")
        return cls.load(str(path), **data)

    @classmethod
    def from_env(cls, environ: Optional[dict[str, str]] = None, **overrides: Any) -> "OffloadConfig":
        """Fields from KVFSM_<FIELD> variables (JSON values where they parse, else strings)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is None:
                continue
            try:
                values[name] = json.loads(raw)
            except ValueError:
                values[name] = raw
        values.update(overrides)
        return cls.load("environment", **values)
