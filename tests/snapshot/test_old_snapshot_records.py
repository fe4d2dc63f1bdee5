"""A ``meta.json`` our capturer wrote before the record layer was unified still reads.

``data/records/meta.json`` was written by the code of commit 6d14dc9 (a tensor, a scalar
and a kernel-handle input, an output, a token match) and is never regenerated. The Neuron
plugin's own form is tested in ``test_snapshot_plugin_format.py``.
"""

from __future__ import annotations

from pathlib import Path

from vllm_neuron.snapshot.meta import MatchRecord, decode_call_meta

DATA = Path(__file__).parent / "data" / "records"


def test_an_old_call_meta_reads() -> None:
    meta = decode_call_meta((DATA / "meta.json").read_bytes())
    assert (meta.v, meta.global_rank, meta.call_index, meta.writer) == (1, 1, 3, "host")
    assert [i.kind for i in meta.inputs] == ["tensor", "scalar", "kernel-handle"]
    assert meta.inputs[1].value == 4
    handle = meta.inputs[2].handle
    assert handle is not None and handle.primitive_cache_size == 128
    assert meta.files == ["input0.npy", "input2.npy", "output0.npy"]
    assert meta.matches == [MatchRecord(rule="token", row=1, req_id="r2-1a2b3c4d", position=11,
                                        target=12, offset=1, request="r2")]  # fmt: skip
    assert not meta.from_plugin
