"""Layer 3: where checkpoints live. One protocol; a local directory; RAM (/dev/shm)."""

from pitstop.storage.base import Storage
from pitstop.storage.local import LocalStorage, RamStorage

__all__ = ["LocalStorage", "RamStorage", "Storage"]
