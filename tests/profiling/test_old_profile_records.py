"""Profile records our own code wrote before the record layer was unified still read.

The files under ``data/records/`` were written by the code of commit 6d14dc9 (a torch
capture that fell back to the decode-only connector, a failed Neuron capture, and a run
spec) and are never regenerated. The Neuron plugin's own forms are tested in
``test_profile_plugin_format.py``.
"""

from __future__ import annotations

from pathlib import Path

from vllm_neuron.profiling.run_record import decode_manifest
from vllm_neuron.profiling.run_spec import DECODE, decode_run_spec

DATA = Path(__file__).parent / "data" / "records"


def test_an_old_run_spec_reads() -> None:
    spec = decode_run_spec((DATA / "run_spec.json").read_bytes())
    assert (spec.schema_version, spec.recipe, spec.profiler) == (1, DECODE, "torch")
    assert spec.kv_transfer is not None and spec.kv_transfer.reason == "no prefill-free tick"
    assert spec.launch is not None and spec.launch.attempt == 2
    assert spec.model_env == {"NEURON_CC_FLAGS": "-O1", "XLA_IR_DEBUG": None}


def test_an_old_torch_manifest_reads() -> None:
    m = decode_manifest((DATA / "manifest.json").read_bytes())
    assert (m.schema_version, m.status, m.max_windows) == (1, "ok", 3)
    assert m.profile.profiler == "torch" and m.profile.traces[0].worker == "rank0.1"
    assert [w.outcome for w in m.windows] == ["rejected", "captured"]
    assert [a.attempt for a in m.attempts] == [1, 2]
    assert m.teardown is not None and m.teardown.signals == ["SIGTERM"]
    assert m.validation is not None and m.validation.ok
    # our manifests carry their own paths: the location it is read from changes nothing
    assert decode_manifest((DATA / "manifest.json").read_bytes(), "/elsewhere") == m


def test_an_old_failed_neuron_manifest_reads() -> None:
    m = decode_manifest((DATA / "manifest-neuron-failed.json").read_bytes())
    assert (m.status, m.failed_stage, m.neff_hashes) == ("failed", "validate", ["8f3a2b1c9d0e"])
    p = m.profile
    assert (p.profiler, p.device_ntff, p.cpu_util_pb) == ("neuron", "/r/output/s/d.ntff", None)
    assert p.activities == ["device_profile"] and p.traces[0].size == 99
