"""The offload manager: generated per-request machines driving the data plane."""

from kvfsm.errors import ConfigError, InvalidRequest, RequestFieldMissing, RetractionRefused, RowInUse
from kvfsm.runtime.backup import BackupJob, BackupWorker, SteppedBackupWorker, ThreadBackupWorker
from kvfsm.runtime.config import OffloadConfig
from kvfsm.runtime.ledger import CheckedModeError, SlotLedger
from kvfsm.runtime.manager import DecodeOffloadManager
from kvfsm.runtime.metrics import OffloadMetrics
from kvfsm.runtime.progress import TPMismatch
from kvfsm.runtime.protocols import OffloadRequest, PrefixCache, PrefixLock, SimplePrefixCache

__all__ = [
    "BackupJob",
    "BackupWorker",
    "CheckedModeError",
    "ConfigError",
    "DecodeOffloadManager",
    "InvalidRequest",
    "OffloadConfig",
    "OffloadMetrics",
    "OffloadRequest",
    "PrefixCache",
    "PrefixLock",
    "RequestFieldMissing",
    "RetractionRefused",
    "RowInUse",
    "SimplePrefixCache",
    "SlotLedger",
    "SteppedBackupWorker",
    "TPMismatch",
    "ThreadBackupWorker",
]
