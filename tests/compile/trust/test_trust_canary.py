"""No stranger's code runs: a writer to the remote tier without the builder's key swaps in a
shared object that runs code the moment it is loaded, and recomputes every digest
(docs/trust.md).

Real processes (tests/compile/helpers/serve_worker.py: a model served through
``torch.compile(backend="vllm_neuron")``), a real AOTInductor package whose ``.so`` is
replaced by one with a constructor that writes a canary file. Under ``require`` no serving
node ever creates the canary and the graph is served; with the policy off the canary
appears, which shows the test would catch a node that loads it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
import serve_worker  # tests/compile/helpers/serve_worker.py
from entry_faults import make_code_running  # tests/entry_faults.py

from vllm_neuron.compile.entry.record import ENTRY_RECORD, decode_record
from vllm_neuron.compile.trust.signing import SIGNATURE_FILE, generate_key_pair, load_signer

INDUCTOR = Path(tempfile.mkdtemp(prefix="vllm-neuron-trust-inductor-"))


@pytest.fixture(scope="module")
def signed_remote(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A folder remote holding the model's graph, compiled and promoted by a builder that
    signs; the builder's and a retired key pair."""
    base = tmp_path_factory.mktemp("trust")
    builder = generate_key_pair(str(base / "keys"), "builder")
    retired = generate_key_pair(str(base / "keys"), "retired")
    remote = base / "remote"
    code, result, err = serve_worker.serve(
        base / "builder", INDUCTOR, NEURON_LIBTORCH_REMOTE_CACHE=str(remote),
        VLLM_NEURON_CACHE_SIGNING_KEY=builder[0], VLLM_NEURON_CACHE_TRUSTED_KEYS=builder[1])
    assert code == 0 and result is not None, err[-3000:]
    assert result["matched"] and result["sources"] == ["compiled"], result
    (key,) = result["keys"]
    assert (remote / key / SIGNATURE_FILE).is_file(), "the builder's promotion is not signed"
    return {"remote": remote, "key": key, "builder": builder, "retired": retired}


@pytest.mark.parametrize("forgery", ["tampered", "unsigned", "retired-key", "moved", "off"])
def test_a_swapped_in_shared_object_never_runs_in_a_node_that_requires_trust(
    forgery: str, signed_remote: dict[str, Any], tmp_path: Path
) -> None:
    remote, key = tmp_path / "remote", signed_remote["key"]
    shutil.copytree(signed_remote["remote"], remote)
    canary = tmp_path / "canary"
    make_code_running(remote, key, canary, tmp_path)
    entry = remote / key
    forged = decode_record((entry / ENTRY_RECORD).read_bytes())
    if forgery == "unsigned":
        (entry / SIGNATURE_FILE).unlink()
    elif forgery == "retired-key":  # signed by a key that is no longer trusted
        (entry / SIGNATURE_FILE).write_bytes(
            load_signer(signed_remote["retired"][0]).sign_bytes(forged))
    elif forgery == "moved":  # the builder's valid signature of another entry
        other = msgspec.structs.replace(forged, key="0123456789abcdef" * 2, files={})
        (entry / SIGNATURE_FILE).write_bytes(
            load_signer(signed_remote["builder"][0]).sign_bytes(other))
    trust = ({} if forgery == "off"
             else {"VLLM_NEURON_CACHE_TRUSTED_KEYS": signed_remote["builder"][1]})  # fmt: skip
    code, result, err = serve_worker.serve(
        tmp_path / "serving", INDUCTOR, NEURON_LIBTORCH_REMOTE_CACHE=str(remote), **trust)
    assert code == 0 and result is not None, err[-3000:]
    assert result["matched"], result  # the graph is served either way
    if forgery == "off":  # nobody looks at signatures: the stranger's code ran
        assert canary.exists(), "the forged artifact was never loaded: the test proves nothing"
        return
    assert not canary.exists(), f"the stranger's code ran in a node that requires trust ({forgery})"
    assert result["sources"] == ["compiled"], result  # compiled for itself
    said = [w for w in result["warnings"] if "untrusted" in w]
    assert len(said) == 1, result["warnings"]
    # Never copied into the node's tier, and the node promoted nothing over it.
    local = tmp_path / "serving" / "neuron" / "compile_cache" / key
    assert "fetched" not in (local / ENTRY_RECORD).read_text()  # its own compile
    assert decode_record((entry / ENTRY_RECORD).read_bytes()) == forged
