"""`snapshot replay --manifest`: every bundle an engine's manifest names on its graphs, made
by the real capturer with the assembly's link, replayed; ``--graph`` picks one graph; bad
input is exit 2 naming the value (issue 27)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from linked_capture import NORM_HASH, SHARD_HASH, STEP, Linked, capture_linked, expected_paths

from vllm_neuron.cli import main
from vllm_neuron.manifest.inspect import load_manifest
from vllm_neuron.snapshot import RankInfo, SnapshotCapturer, forward_context

DATA = Path(__file__).parent.parent / "manifest" / "data" / "records"


@pytest.fixture
def linked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Linked:
    monkeypatch.setenv("VLLM_NEURON_RUN_ID", "linked-run")
    return capture_linked(str(tmp_path / "manifests"), str(tmp_path / "snaps"))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_each_graph_lists_the_bundles_of_both_ranks(linked: Linked) -> None:
    _, manifest = load_manifest(linked.engine)
    graphs = {g.graph_hash: g for g in manifest.graphs}
    for key in (SHARD_HASH, NORM_HASH):
        assert graphs[key].input_snapshot_paths == expected_paths(key)
        assert graphs[key].output_snapshot_paths == expected_paths(key)
        for path in expected_paths(key):
            assert (Path(linked.snapshot_root) / path / "meta.json").is_file()


def test_replay_manifest_replays_every_bundle_bit_exact(
    linked: Linked, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "snapshot", "replay", "--manifest", linked.engine, "--root",
                         linked.snapshot_root, "--runner", "eager", "--json")
    assert code == 0, out + err
    reports = json.loads(out)
    named = [f"{linked.snapshot_root}/{p}" for key in (SHARD_HASH, NORM_HASH)
             for p in expected_paths(key)]
    assert [r["bundle"] for r in reports] == named  # the manifest's order: graph, rank, call
    assert all(r["passed"] and r["call_index"] == STEP for r in reports)
    assert all(o["max_abs_err"] == 0.0 for r in reports for o in r["outputs"])
    code, out, _ = run(capsys, "snapshot", "replay", "--manifest", linked.engine, "--root",
                       linked.snapshot_root, "--runner", "eager")
    assert code == 0 and "rank 0: 2 of 2 bundles match" in out and "PASS: 4 of 4" in out


def test_graph_picks_one_graphs_bundles(linked: Linked, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "snapshot", "replay", "--manifest", linked.engine,
                         "--graph", SHARD_HASH[:12], "--root", linked.snapshot_root,
                         "--runner", "eager", "--json")
    assert code == 0, err
    assert [r["bundle"] for r in json.loads(out)] == [f"{linked.snapshot_root}/{p}"
                                                      for p in expected_paths(SHARD_HASH)]


def test_configured_root_is_the_default(linked: Linked, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_DIR", linked.snapshot_root)
    code, out, err = run(capsys, "snapshot", "replay", "--manifest", linked.engine,
                         "--graph", NORM_HASH, "--runner", "eager")
    assert code == 0 and "PASS: 2 of 2" in out, out + err


def test_a_url_root_names_its_bundles_by_url(
    tmp_path: Path, memory_root: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.setenv("VLLM_NEURON_RUN_ID", "url-run")
    linked = capture_linked(str(tmp_path / "manifests"), memory_root)
    _, manifest = load_manifest(linked.engine)
    assert manifest.graphs[0].input_snapshot_paths == expected_paths(manifest.graphs[0].graph_hash,
                                                                     root=memory_root)
    # No --root needed, none used: a URL says where it is.
    code, out, err = run(capsys, "snapshot", "replay", "--manifest", linked.engine, "--root",
                         str(tmp_path / "elsewhere"), "--runner", "eager")
    assert code == 0 and "PASS: 4 of 4" in out, out + err


def test_a_bundle_gone_fails_alone_and_a_wrong_root_is_named(
    linked: Linked, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gone = f"{NORM_HASH}/rank1/call{STEP}"
    shutil.rmtree(Path(linked.snapshot_root) / gone)
    code, out, _ = run(capsys, "snapshot", "replay", "--manifest", linked.engine, "--root",
                       linked.snapshot_root, "--runner", "eager")
    assert code == 1
    assert f"{linked.snapshot_root}/{gone}" in out
    assert "MISSING: missing: " in out and "names this bundle, but it is not there" in out
    # Listed as missing, not counted as a mismatch.
    assert "FAIL: 3 of 4 bundles match their captured outputs (1 missing)" in out
    assert "differ" not in out
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "snapshot", "replay", "--manifest", linked.engine, "--root",
                       str(tmp_path / "empty"))
    assert code == 2 and "none of the 4 bundles" in err and str(tmp_path / "empty") in err
    assert "--root" in err


@pytest.mark.parametrize(("argv", "said"), [
    (["--manifest", "{engine}", "--graph", "ffff"], "--graph 'ffff'"),
    (["--manifest", "/no/such/manifest.json"], "/no/such/manifest.json"),
    (["--manifest", "/no/such/engine"], "/no/such/engine"),
    (["{bundle}", "--manifest", "{engine}"], "not both"),
    (["{bundle}", "--graph", SHARD_HASH], f"--graph '{SHARD_HASH}' needs --manifest"),
    ([], "give the BUNDLE to replay, or --manifest"),
    (["--manifest", str(DATA / "manifest.json")], "names no snapshot bundle"),
])  # fmt: skip
def test_bad_input_is_exit_2_naming_it(linked: Linked, capsys: pytest.CaptureFixture[str],
                                       argv: list[str], said: str) -> None:  # fmt: skip
    bundle = f"{linked.snapshot_root}/{SHARD_HASH}/rank0/call{STEP}"
    args = [a.format(engine=linked.engine, bundle=bundle) for a in argv]
    code, out, err = run(capsys, "snapshot", "replay", *args, "--root", linked.snapshot_root)
    assert code == 2 and said in err, out + err
    assert "Traceback" not in err


def test_a_listener_that_fails_leaves_the_bundle_and_the_forward(
    tmp_path: Path, capturer_for: object, caplog: pytest.LogCaptureFixture
) -> None:
    import torch
    from snapshot_helpers import ctx, make_config

    cfg = make_config(str(tmp_path / "s"), CAPTURE_AT_CALL="0,1")

    def broken(_bundle: object) -> None:
        raise OSError("the manifest directory went away")

    cap: SnapshotCapturer = capturer_for(cfg, rank=RankInfo(), on_bundle=broken)  # type: ignore[operator]
    fn = cap.wrap(lambda x: x * 2)
    for step in range(2):
        with forward_context(ctx(step, config=cfg)):
            assert torch.equal(fn(torch.ones(2)), torch.full((2,), 2.0))
    assert len(cap.captured) == 2
    said = [r.getMessage() for r in caplog.records
            if "listener of snapshot bundles" in r.getMessage()]
    assert len(said) == 1 and "went away" in said[0]


def test_the_manifest_is_all_a_replay_needs(linked: Linked, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """No --root, no --cache-dir, and a configured snapshot root elsewhere: the manifest
    records where the engine wrote its bundles."""
    _, manifest = load_manifest(linked.engine)
    assert manifest.locations.snapshot_root == linked.snapshot_root  # type: ignore[union-attr]
    monkeypatch.setenv("VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_DIR", "/nonexistent/elsewhere")
    code, out, err = run(capsys, "snapshot", "replay", "--manifest", linked.engine,
                         "--runner", "eager")
    assert code == 0 and "PASS: 4 of 4" in out, out + err


def test_replay_from_a_copy_on_another_host_with_root(
    tmp_path: Path, linked: Linked, capsys: pytest.CaptureFixture[str]
) -> None:
    """The snapshots and the manifest copied to another tree, the original paths gone: the
    recorded root no longer exists, --root points at the copy."""
    host = tmp_path / "other-host"
    shutil.copytree(linked.snapshot_root, host / "snaps")
    shutil.copytree(linked.engine, host / "manifest")
    shutil.rmtree(linked.snapshot_root)
    shutil.rmtree(linked.manifest_dir)
    code, _, err = run(capsys, "snapshot", "replay", "--manifest", str(host / "manifest"),
                       "--runner", "eager")
    assert code == 2 and "the snapshot root" in err and "records" in err and "--root" in err
    code, out, err = run(capsys, "snapshot", "replay", "--manifest", str(host / "manifest"),
                         "--root", str(host / "snaps"), "--json")
    assert code == 0, out + err
    reports = json.loads(out)
    assert len(reports) == 4 and all(r["passed"] and r["ran"] for r in reports)
    assert all(r["bundle"].startswith(str(host / "snaps")) for r in reports)
    # No compile cache was recorded (none existed): auto says why it ran the graph.
    assert {r["runner"] for r in reports} == {"eager"}
    assert all(r["runner_note"] and "cache runner cannot run here" in r["runner_note"]
               for r in reports)


def test_a_recorded_cache_that_is_not_this_users_own_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A manifest travels: the compile cache it names is loaded from only when this user
    owns it and no one else can write it (loading an entry runs its native code)."""
    monkeypatch.setenv("VLLM_NEURON_RUN_ID", "shared-cache-run")
    shared = tmp_path / "shared-cache"
    shared.mkdir()
    shared.chmod(0o777)
    linked = capture_linked(str(tmp_path / "manifests"), str(tmp_path / "snaps"),
                            cache_root=str(shared))
    code, out, err = run(capsys, "snapshot", "replay", "--manifest", linked.engine, "--json")
    assert code == 0, out + err
    notes = {r["runner_note"] for r in json.loads(out)}
    (note,) = notes
    assert f"the compile cache the manifest names ({shared}) is not this user's own" in note
    assert "--cache-dir" in note
