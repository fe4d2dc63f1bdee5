"""The storage layer: every byte the project writes goes through a `Store`.

Get a store with `open_store(url)`; see `store.Store` (and `base.StoreBase`) for the operations and
`base.Capabilities` for what each backend promises. A new URL scheme is one
`register_scheme` call. Whether a setting names a URL or a local directory is asked of
`is_url`, `local_path_of` and `normalize_location`, never sniffed, so every caller agrees
with `open_store`; `check_location` says whether `open_store` would accept a location
(settings are checked with it at start-up), `probe_store` whether an opened store can
serve. Code above this layer does no file I/O on a store's files: every operation it needs
is a store operation (docs/storage.md, "Operations"), with two documented doors to real
directories for tools that only take a directory: loading a published entry
(`Store.local_dir_of`) and writing one's own output files (`Staging.output_dir`,
`Store.local_output`).
"""

from .base import PRIVATE_FILE, Capabilities, FileInfo, Staging
from .digests import Expected, FileDigest
from .errors import (
    IntegrityError,
    InvalidKey,
    InvalidLocation,
    LeaseLost,
    LeaseUnusable,
    LockTimeout,
    MissingDependency,
    PublicationStuck,
    StoreAccessDenied,
    StoreError,
    StoreMissing,
    StoreUnavailable,
    UnknownScheme,
)
from .eventlog import EventLog
from .faults import fault_point
from .keys import join, validate_hex, validate_key
from .locations import (
    check_location,
    check_remote_location,
    is_url,
    local_path_of,
    local_root_missing,
    normalize_location,
)
from .locks import KernelLock, LeaseLock, Lock
from .publication import Publication
from .records import (
    Decoded,
    Record,
    RecordCodec,
    encode,
    encode_into,
    encode_line,
    register_upcaster,
)
from .router import open_store, probe_store
from .schemes import register_scheme, registered_schemes, unregister_scheme
from .store import Store
from .transfer import CopyResult, Progress, copy_file, copy_tree
from .verified_copy import copy_verified

__all__ = [
    "PRIVATE_FILE",
    "Capabilities",
    "CopyResult",
    "Decoded",
    "EventLog",
    "Expected",
    "FileDigest",
    "FileInfo",
    "IntegrityError",
    "InvalidKey",
    "InvalidLocation",
    "KernelLock",
    "LeaseLock",
    "LeaseLost",
    "LeaseUnusable",
    "PublicationStuck",
    "Lock",
    "LockTimeout",
    "MissingDependency",
    "Progress",
    "Record",
    "RecordCodec",
    "Staging",
    "Store",
    "StoreAccessDenied",
    "StoreError",
    "StoreMissing",
    "StoreUnavailable",
    "UnknownScheme",
    "copy_file",
    "copy_tree",
    "copy_verified",
    "encode",
    "encode_into",
    "encode_line",
    "fault_point",
    "check_location",
    "check_remote_location",
    "is_url",
    "join",
    "local_path_of",
    "local_root_missing",
    "normalize_location",
    "open_store",
    "probe_store",
    "register_scheme",
    "register_upcaster",
    "registered_schemes",
    "unregister_scheme",
    "validate_hex",
    "validate_key",
    "Publication",
]
