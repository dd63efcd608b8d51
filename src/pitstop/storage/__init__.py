"""Layer 3: where checkpoints live. One protocol; a local directory; RAM (/dev/shm); an object
store (``s3://``, ``gs://``, ``az://``, fsspec URLs: the ``pitstop[s3]`` extra); a wrapper that
retries transient errors."""

from pitstop.storage.base import Storage
from pitstop.storage.local import LocalStorage, RamStorage
from pitstop.storage.object_store import ObjectStorage
from pitstop.storage.retry import RetryingStorage

__all__ = ["LocalStorage", "ObjectStorage", "RamStorage", "RetryingStorage", "Storage"]
