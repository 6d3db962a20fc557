"""The offload manager: generated per-request machines driving the data plane."""

from kvfsm.errors import ConfigError, InvalidRequest, RequestFieldMissing, RowInUse
from kvfsm.runtime.backup import BackupJob, BackupWorker, SteppedBackupWorker, ThreadBackupWorker
from kvfsm.runtime.config import OffloadConfig
from kvfsm.runtime.ledger import CheckedModeError, SlotLedger
from kvfsm.runtime.manager import DecodeOffloadManager, TPMismatch
from kvfsm.runtime.metrics import OffloadMetrics
from kvfsm.runtime.protocols import OffloadRequest, PrefixCache, ProtectedSize

__all__ = ["BackupJob", "BackupWorker", "CheckedModeError", "ConfigError", "DecodeOffloadManager", "InvalidRequest",
           "OffloadConfig", "OffloadMetrics", "OffloadRequest", "PrefixCache", "ProtectedSize", "RequestFieldMissing",
           "RowInUse", "SlotLedger", "SteppedBackupWorker", "TPMismatch", "ThreadBackupWorker"]
