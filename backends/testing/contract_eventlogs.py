"""The store contract for event logs: append, read back, fold, and survive foreign lines.

Why here and not only in the log's own tests: a log's segments live in the store, and the
append path differs per backend (one ``os.write`` per record on local disk, a rewrite
elsewhere), so every backend has to show the same records come back.
"""

from __future__ import annotations

import os

from ..records import Record, RecordCodec, encode_line
from ..store import Store
from .samples import ContractEvent, OtherEvent


class EventLogContractTests:
    """`Store.log` on this store. Subclasses supply a ``store`` fixture."""

    # ---------------------------------------------------------- event logs
    def test_eventlog_append_read_fold(self, store: Store) -> None:
        log = store.log("events/compile", writer="w1")
        records = [ContractEvent(key=f"k{i}", rank=i, shape=(i, 2)) for i in range(3)]
        for record in records:
            log.append(record)
        other = store.log("events/compile", writer="w2")
        other.append(OtherEvent(note="hi"))
        decoded = log.read([ContractEvent, OtherEvent])
        assert decoded.records == [*records, OtherEvent(note="hi")]
        assert decoded.skipped == 0
        assert len(log.segments()) == 2

        def count(state: dict[str, int], record: Record) -> dict[str, int]:
            name = type(record).__name__
            return {**state, name: state.get(name, 0) + 1}

        empty: dict[str, int] = {}
        state, skipped = log.fold([ContractEvent, OtherEvent], count, empty)
        assert state == {"ContractEvent": 3, "OtherEvent": 1}
        assert skipped == 0
        log.close()
        other.close()

    def test_eventlog_append_many_and_reopen(self, store: Store) -> None:
        log = store.log("s", writer="w")
        log.append_many([ContractEvent(key="a", rank=0), ContractEvent(key="b", rank=1)])
        log.close()
        again = store.log("s", writer="w")
        again.append(ContractEvent(key="c", rank=2))
        again.close()
        keys = [r.key for r in again.read([ContractEvent]).records]
        assert keys == ["a", "b", "c"]

    def test_eventlog_truncate_first(self, store: Store) -> None:
        log = store.log("s", writer="w")
        log.append(ContractEvent(key="old", rank=0))
        log.close()
        fresh = store.log("s", writer="w", truncate_first=True)
        fresh.append(ContractEvent(key="new", rank=0))
        fresh.close()
        assert [r.key for r in fresh.read([ContractEvent]).records] == ["new"]

    def test_eventlog_default_writer_is_the_process(self, store: Store) -> None:
        log = store.log("s")
        log.append(ContractEvent(key="a", rank=0))
        log.close()
        assert log.segments() == [f"s/{os.getpid()}.jsonl"]

    def test_eventlog_skips_and_counts_undecodable_lines(self, store: Store) -> None:
        good = ContractEvent(key="ok", rank=1, shape=(2,))
        log = store.log("s", writer="good")
        log.append(good)
        log.close()
        store.write(
            "s/foreign.jsonl",
            b'{"type":"contract-event","v":1,"key":"torn","ra'  # torn JSON
            b"\n\xff\xfe\x00garbage\n"  # not UTF-8, not JSON
            b'{"type":"contract-event","v":1,"key":"k","rank":"not-an-int"}\n'  # wrong field
            b'{"type":"from-the-future","v":9}\n'  # unknown tag
            b"[1, 2, 3]\n"  # not an object
            b"\n"  # blank lines are not records and not errors
            b'{"type":"contract-event","v":1,"key":"ok2","rank":2}\n'
            b'{"type":"contract-event","v":1,"key":"tail","rank":3',  # torn tail, no newline
        )
        store.write("s/not-a-segment.txt", b"ignored entirely\n")
        decoded = log.read([ContractEvent])
        assert decoded.records == [ContractEvent(key="ok2", rank=2), good]
        assert decoded.skipped == 6
        assert len(decoded.errors) == 6
        _, skipped = log.fold([ContractEvent], lambda n, _r: n + 1, 0)
        assert skipped == 6
        codec = RecordCodec([ContractEvent])
        assert log.read(codec).skipped == 6

    def test_eventlog_descriptor_appends_exactly_like_append(self, store: Store) -> None:
        log = store.log("s", writer="w")
        assert log.descriptor() == -1  # nothing opened yet in this process
        log.append(ContractEvent(key="a", rank=0))
        fd = log.descriptor()
        # One os.write per record where the store appends natively (local disk), else none.
        assert (fd >= 0) == (store.capabilities.native_append and store.capabilities.local_paths)
        if fd >= 0:
            os.write(fd, encode_line(ContractEvent(key="b", rank=1)))
        else:
            log.append(ContractEvent(key="b", rank=1))
        log.close()
        assert log.descriptor() == -1
        assert [r.key for r in log.read([ContractEvent]).records] == ["a", "b"]
        assert [key for key, _ in log.segment_data()] == ["s/w.jsonl"]

    def test_eventlog_delete(self, store: Store) -> None:
        log = store.log("s", writer="w")
        log.append(ContractEvent(key="a", rank=0))
        assert log.delete() == 1
        assert log.read([ContractEvent]).records == []
