"""The offload manager: generated per-request machines driving the data plane."""

from kvfsm.runtime.backup import BackupJob, BackupWorker, SteppedBackupWorker, ThreadBackupWorker
from kvfsm.runtime.config import ConfigError, OffloadConfig
from kvfsm.runtime.ledger import CheckedModeError, SlotLedger
from kvfsm.runtime.manager import DecodeOffloadManager, InvalidRequest, TPMismatch
from kvfsm.runtime.metrics import OffloadMetrics
from kvfsm.runtime.protocols import OffloadRequest, PrefixCache, ProtectedSize

__all__ = ["BackupJob", "BackupWorker", "CheckedModeError", "ConfigError", "DecodeOffloadManager", "InvalidRequest",
           "OffloadConfig", "OffloadMetrics", "OffloadRequest", "PrefixCache", "ProtectedSize", "SlotLedger",
           "SteppedBackupWorker", "TPMismatch", "ThreadBackupWorker"]
