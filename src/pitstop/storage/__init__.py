"""Layer 3: where checkpoints live. One protocol; a local directory; RAM (/dev/shm); a
wrapper that retries transient errors."""

from pitstop.storage.base import Storage
from pitstop.storage.local import LocalStorage, RamStorage
from pitstop.storage.retry import RetryingStorage

__all__ = ["LocalStorage", "RamStorage", "RetryingStorage", "Storage"]
