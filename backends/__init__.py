"""The storage layer: every byte the project writes goes through a `Store`.

Get a store with `open_store(url)`; see `base.Store` for the operations and
`base.Capabilities` for what each backend promises.
"""

from ._local import read_local_file
from .base import Capabilities, FileInfo, Staging, Store
from .errors import (
    InvalidKey,
    LeaseLost,
    LockTimeout,
    MissingDependency,
    StoreError,
    StoreUnavailable,
    UnknownScheme,
)
from .eventlog import EventLog
from .keys import join, validate_hex, validate_key
from .locks import KernelLock, LeaseLock, Lock
from .records import (
    Decoded,
    Record,
    RecordCodec,
    encode,
    encode_into,
    encode_line,
    register_upcaster,
)
from .router import open_store
from .transfer import CopyResult, Progress, copy_file, copy_tree

__all__ = [
    "Capabilities",
    "CopyResult",
    "Decoded",
    "EventLog",
    "FileInfo",
    "InvalidKey",
    "KernelLock",
    "LeaseLock",
    "LeaseLost",
    "Lock",
    "LockTimeout",
    "MissingDependency",
    "Progress",
    "Record",
    "RecordCodec",
    "Staging",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "UnknownScheme",
    "copy_file",
    "copy_tree",
    "encode",
    "encode_into",
    "encode_line",
    "join",
    "open_store",
    "read_local_file",
    "register_upcaster",
    "validate_hex",
    "validate_key",
]
