"""Manager configuration: one validated pydantic model, from code, a YAML/JSON file, or KVFSM_* variables.

Every way of making a config (the constructor, `model_validate`, `load`, `from_file`, `from_env`) raises
`kvfsm.errors.ConfigError` naming the field and the reason (the pydantic error chained as its cause),
before any memory is allocated. What depends on the machine and on the pools the manager is given (is
CUDA there, does the stride fit the host pool, is Mooncake installed, is `storage_dir` usable) is checked
when the manager is built, still before it allocates anything (`kvfsm.runtime.build`).

Files and variables are read within bounds (`kvfsm.input_limits`: CONFIG_LIMITS for a file, ENV_VALUE_LIMITS
for each variable's value: size, nesting depth, element count and YAML aliases at their expanded size); a
breach is a ConfigError whose source names the file and line (or the variable) and whose reason names the bound.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvfsm.errors import ConfigError, InputRejected
from kvfsm.input_limits import (
    CONFIG_LIMITS,
    ENV_VALUE_LIMITS,
    InputLimits,
    check_json_nesting,
    count_elements,
    decode_utf8,
    load_yaml_data,
    read_bounded,
)
from kvfsm.runtime.storage_options import check_storage_extra

logger = logging.getLogger(__name__)

ENV_PREFIX = "KVFSM_"
# KVFSM_* variables that are not config fields: read by the data plane (KVFSM_CU_BATCH), the command line
# (KVFSM_TRACEBACK) and kvfsm's own test and benchmark tooling. from_env does not warn about these.
OTHER_ENV_VARS = frozenset(
    {
        "KVFSM_CU_BATCH",
        "KVFSM_FUZZ",
        "KVFSM_TRACEBACK",
        "KVFSM_REQUIRE_MOONCAKE",
        "KVFSM_REQUIRE_TRANSFORMERS",
        "KVFSM_REQUIRE_MUTMUT",
        "KVFSM_MUTANT_REPORT",
        "KVFSM_MUTANT_SHRINK",
    }
)
# Fields whose environment value is taken as the string it is (KVFSM_MODEL_NAME=1234 is a name, not a number).
_STRING_FIELDS = frozenset({"model_name", "storage_dir", "trace_path"})


class OffloadConfig(BaseModel):
    # protected_namespaces: older pydantic (2.5) warns about any field named model_*, such as model_name
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    page_size: int = Field(1, ge=1, description="Tokens per KV page.")
    offload_stride: int = Field(
        0,
        ge=0,
        description=(
            "Tokens per offloaded chunk; 0 means one page. Not a multiple of page_size: rounded down to whole "
            "pages (at least one), with a WARNING."
        ),
    )
    host_pool_ratio: Optional[float] = Field(2.0, gt=0, description="Host pool size as a multiple of the device pool.")
    host_pool_bytes: Optional[int] = Field(None, gt=0, description="Host pool size in bytes (wins over the ratio).")
    host_layout: Literal["layer_first", "page_first"] = "layer_first"
    copy_backend: Literal["auto", "cpu", "cuda", "deferred"] = Field(
        "auto",
        description=(
            "'cuda' needs CUDA and a device pool on it (else ConfigError); 'auto' picks CUDA for a CUDA device "
            "pool and the CPU engine otherwise, with a WARNING."
        ),
    )
    storage_backend: Literal["file", "mooncake", "none"] = Field(
        "file",
        description=(
            "'file': FileStorage in storage_dir; 'mooncake': MooncakeStorage (pip install 'kvfsm[mooncake]'), "
            "its options in storage_extra, master_server_addr required; 'none': no store, unless storage= is given."
        ),
    )
    storage_dir: Path = Path("kvfsm-store")
    storage_extra: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Keyword options of the selected backend's constructor (FileStorage: fsync, writers; MooncakeStorage: "
            "master_server_addr, metadata_server, ...), checked against it."
        ),
    )
    storage_process: bool = Field(
        False,
        description=(
            "Run the file store in a child process (ProcessStorage): its page writes then take no interpreter time "
            "from the scheduler thread, however many writers keep up with decoding (4 there unless storage_extra "
            "sets `writers`). The host pool the manager builds "
            "is then shared with that process, which reads the pages in place. Needs storage_backend='file'."
        ),
    )
    storage_processes: int = Field(
        1,
        ge=1,
        description=(
            "With storage_process: how many child processes share the file store's writes, each key always in the "
            "same one (ShardedStorage). One keeps up at 64-token pages; 16-token pages write four times the files "
            "for the same bytes, and a file's cost is Python on its process's one interpreter."
        ),
    )
    model_name: str = Field("model", min_length=1)
    backup_queue_size: Optional[int] = Field(
        None,
        ge=1,
        description=(
            "Backups queued or running at once; beyond it chunks park until a progress check finds room. None: as "
            "many chunks as the host pool can hold (its tokens over the stride), so every acknowledged copy's backup "
            "is queued at that check, as SGLang's progress check queues each one. A fixed size throttles the store: "
            "its room comes back once a progress check, so it passes at most that many chunks an iteration."
        ),
    )
    stored_index_pages: int = Field(
        1 << 20,
        ge=0,
        description=(
            "Pages the manager's stored-page index (hash -> request, position) keeps, oldest dropped first; "
            "0 keeps none. Bounded so a long-running server does not grow without limit; storage stays the "
            "authority on what it holds."
        ),
    )
    retraction: Literal["deferred", "fail_closed"] = Field(
        "deferred",
        description=(
            "The spec's `retraction` policy (spec/decode_offload.yaml, `policies`): 'deferred' retracts in every live "
            "state, deferring the release past in-flight copies; 'fail_closed' is SGLang 0.5.23's rule: "
            "drain_before_retraction() and retract() refuse while a device-to-host copy is tracked."
        ),
    )
    fenced_release: bool = Field(
        False,
        description=(
            "The spec's `fences` param: a request that ends while copies still read its device slots releases them "
            "at once, fenced (spec state `fenced`), instead of at its last copy acknowledgement (state `finished`). "
            "Needs a copy engine whose handles fence (CopyEngine.fences) and an allocator that takes fences "
            "(TokenSlotAllocator); the engine must then take slots with alloc_fenced() and make the stream that "
            "writes them wait on the fences it returns (wait_fences). Plain alloc() never hands out a fenced slot "
            "before its fence passed."
        ),
    )
    checked: bool = Field(False, description="Keep the slot ownership ledger and check invariants every transition.")
    trace_path: Optional[Path] = Field(None, description="Write one JSON line per transition here.")

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise _config_error(exc, "OffloadConfig") from exc

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> OffloadConfig:  # type: ignore[override]
        return cls._validate(obj, "OffloadConfig", **kwargs)

    @classmethod
    def _validate(cls, obj: Any, source: str, **kwargs: Any) -> OffloadConfig:
        try:
            return super().model_validate(obj, **kwargs)
        except ValidationError as exc:
            raise _config_error(exc, source) from exc
        except ConfigError as exc:
            # older pydantic (2.5) validates through the model's own __init__, whose error names the class
            if isinstance(exc.__cause__, ValidationError):
                raise _config_error(exc.__cause__, source) from exc.__cause__
            raise

    @model_validator(mode="after")
    def _fields_agree(self) -> OffloadConfig:
        # A ConfigError raised here reaches the caller as itself (see _config_error), with the field it names.
        if self.host_pool_ratio is None and self.host_pool_bytes is None:
            raise ConfigError("host_pool_bytes", "set host_pool_bytes or host_pool_ratio (both are None)")
        check_storage_extra(self.storage_backend, self.storage_extra)
        if self.storage_process and self.storage_backend != "file":
            raise ConfigError(
                "storage_process",
                f"runs the file store in a child process; storage_backend is {self.storage_backend!r}, not 'file'",
            )
        if self.storage_processes > 1 and not self.storage_process:
            raise ConfigError(
                "storage_processes", f"{self.storage_processes} store processes need storage_process=True"
            )
        if self.offload_stride > 0 and self.offload_stride % self.page_size:
            # The seed rounds, and configs written for it (and the verifier's bounds) rely on it: rounding
            # stays, but never silently.
            logger.warning(
                "offload_stride=%d is not a multiple of page_size=%d: chunks are %d tokens",
                self.offload_stride,
                self.page_size,
                self.stride,
            )
        return self

    @property
    def stride(self) -> int:
        """The seed's offload stride: a page, or the configured stride rounded down to whole pages (at least
        one page); a stride that needed rounding was logged as a WARNING when the config was made."""
        if self.offload_stride <= 0:
            return self.page_size
        return max(self.page_size, self.offload_stride // self.page_size * self.page_size)

    @classmethod
    def load(cls, source: str = "<code>", **values: Any) -> OffloadConfig:
        """A config from field values; a ConfigError names `source`, the field and the reason."""
        return cls._validate(values, source)

    @classmethod
    def from_file(cls, path: str | Path, limits: InputLimits = CONFIG_LIMITS) -> OffloadConfig:
        """YAML or JSON mapping of field names to values, read within `limits`."""
        path = Path(path)
        source = str(path)
        try:
            text = decode_utf8(read_bounded(path, limits, "offload config"), source, "offload config")
            if path.suffix == ".json":
                check_json_nesting(text, limits, source, 1, "offload config")
                data = json.loads(text)
                count_elements(data, limits, source, 1, "offload config", len(text))
            else:
                data = load_yaml_data(text, limits, source, "offload config")
        except InputRejected as exc:
            raise ConfigError(None, exc.reason, f"{exc.source}:{exc.line}" if exc.line else exc.source) from exc
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            where = f"{source}:{mark.line + 1}" if mark is not None else source
            raise ConfigError(None, f"cannot read offload config: malformed YAML: {exc.problem or exc}", where) from exc
        except (OSError, ValueError, OverflowError, yaml.YAMLError) as exc:
            raise ConfigError(None, f"cannot read offload config: {exc}", source) from exc
        if not isinstance(data, dict):
            raise ConfigError(None, "offload config must be a mapping of field names to values", str(path))
        odd = [k for k in data if not isinstance(k, str)]
        if odd:
            raise ConfigError(None, f"offload config keys must be field names, got {odd[0]!r}", str(path))
        return cls._validate(data, str(path))

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides: Any) -> OffloadConfig:
        """Fields from KVFSM_<FIELD> variables (JSON values where they parse, else strings; text fields as
        given). A KVFSM_* name that is no field (nor one of OTHER_ENV_VARS) is logged as a WARNING with the
        closest field's variable: the environment is shared with other tools and versions, so an unknown
        name is not an error, but a typo must not go unnoticed."""
        env = os.environ if environ is None else environ
        known = {ENV_PREFIX + name.upper(): name for name in cls.model_fields}
        values: dict[str, Any] = {}
        for var, raw in env.items():
            if not var.startswith(ENV_PREFIX) or var in OTHER_ENV_VARS:
                continue
            name = known.get(var)
            if name is None:
                near = difflib.get_close_matches(var, known, n=1)
                logger.warning(
                    "environment variable %s is not an offload config field%s; ignored",
                    var,
                    f" (did you mean {near[0]}?)" if near else "",
                )
                continue
            source = f"environment ({var})"
            if len(raw) > ENV_VALUE_LIMITS.max_bytes:
                raise ConfigError(
                    name,
                    f"a value longer than {ENV_VALUE_LIMITS.max_bytes} characters "
                    f"(bound max_bytes={ENV_VALUE_LIMITS.max_bytes})",
                    source,
                )
            if name in _STRING_FIELDS:
                values[name] = raw
                continue
            try:
                check_json_nesting(raw, ENV_VALUE_LIMITS, source, 1, "the value")
                values[name] = json.loads(raw)
                count_elements(values[name], ENV_VALUE_LIMITS, source, 1, "the value", len(raw))
            except InputRejected as exc:
                raise ConfigError(name, exc.reason, source) from exc
            except ValueError:
                values[name] = raw
        values.update(overrides)
        return cls._validate(values, "environment (KVFSM_*)")


def _config_error(exc: ValidationError, source: str) -> ConfigError:
    """One ConfigError for every problem pydantic found: each named by its field, unknown fields with the
    closest known one."""
    problems: list[tuple[Optional[str], str]] = []
    for err in exc.errors():
        raised = (err.get("ctx") or {}).get("error")
        if isinstance(raised, ConfigError):  # from _fields_agree: keeps its own field
            problems.extend(raised.problems)
            continue
        field = ".".join(map(str, err["loc"])) or None
        reason = err["msg"]
        if err["type"] == "extra_forbidden" and field is not None:
            near = difflib.get_close_matches(field, OffloadConfig.model_fields, n=1)
            reason = f"unknown field{f'; did you mean {near[0]!r}?' if near else ''}"
        problems.append((field, reason))
    (field, reason), others = problems[0], problems[1:]
    return ConfigError(field, reason, source, others)
