"""The store contract suite, shipped with the package (as zarr ships `StoreTests`).

Every backend runs the same tests. A backend's test module subclasses
`StoreContractTests` and supplies one fixture, ``store``, that returns a fresh, empty
store::

    from vllm_neuron.backends import open_store
    from vllm_neuron.backends.testing import StoreContractTests

    class TestMemoryStore(StoreContractTests):
        @pytest.fixture
        def store(self):
            return open_store("memory://")

The tests ask the store's `Capabilities` which protocol applies (kernel lock or lease,
rename or commit record) instead of checking its type. Lease tests run on every store:
where `store.lock()` gives a kernel lock they drive a `LeaseLock` over the same store,
since the lease protocol only needs the store's create-if-absent.

Why a package of modules: the suite is one class to a backend, but its parts are read and
changed one concern at a time, so each has its own module:

- :mod:`.contract` - `StoreContractTests`, the class a backend subclasses, and sub views;
- :mod:`.contract_files` - read, write, create-if-absent, listing, delete, info, local files;
- :mod:`.contract_publication` - staging, commit, abort, unpublish;
- :mod:`.contract_withdrawal` - what a publication is now, withdrawing one version, and
  repairing a broken commit record;
- :mod:`.contract_locks` - kernel locks and leases;
- :mod:`.contract_eventlogs` - append-only event logs;
- :mod:`.contract_keys` - bad keys and prefixes refused before any I/O;
- :mod:`.contract_copies` - `copy_tree` between this store and another;
- :mod:`.handshakes` - waiting on observable facts instead of on the clock;
- :mod:`.samples` - the records, keys and bytes the tests feed a store.

The operations domain code needs beyond the primitives are ``testing_ops.py``
(`StoreOperationTests`), which `StoreContractTests` inherits.

Needs pytest (the ``test`` extra); nothing else in the package imports this package.
"""

from __future__ import annotations

from ..testing_ops import published_files
from .contract import StoreContractTests
from .contract_withdrawal import CommitRecordContractTests
from .handshakes import HANG, lease_record, wait_until_blocked
from .moto_server import conditional_puts_made_atomic, free_port, moto_s3_server
from .samples import BAD_KEYS, BAD_PREFIXES, BINARY, ContractEvent, OtherEvent, all_files

__all__ = [
    "BAD_KEYS",
    "BAD_PREFIXES",
    "BINARY",
    "CommitRecordContractTests",
    "HANG",
    "ContractEvent",
    "OtherEvent",
    "StoreContractTests",
    "all_files",
    "conditional_puts_made_atomic",
    "free_port",
    "lease_record",
    "moto_s3_server",
    "published_files",
    "wait_until_blocked",
]
