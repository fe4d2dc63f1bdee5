"""`vllm-neuron report`: how roots map to stores, what the page says of manifests, bundles and
runs, that it is self-contained, bad input (exit 2 naming the argument), and a root on S3."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from report_browser import descendants, parse, select
from report_deployment import HOSTILE_MODEL, KEYS, SNAP_HASH, Deployment, run_report

from vllm_neuron.backends import copy_tree, open_store
from vllm_neuron.cli import main
from vllm_neuron.manifest.inspect import check_manifest, load_manifest


def report(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["report", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# -- bad input: exit 2, the argument and its value named -------------------------------------


@pytest.mark.parametrize(("argv", "named"), [
    (["/no/such/root"], "root '/no/such/root': no such directory"),
    (["s3:/bucket/x"], "root 's3:/bucket/x'"),
    (["--cache-dir", "/no/such/cache"], "--cache-dir '/no/such/cache'"),
    (["--profile-dir", "nope://x"], "--profile-dir 'nope://x'"),
])  # fmt: skip
def test_a_bad_root_or_option_is_exit_2_naming_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], named: str
) -> None:
    code, out, err = report(capsys, *argv, "-o", str(tmp_path / "r.html"))
    assert code == 2 and named in err, err
    assert not (tmp_path / "r.html").exists()


def test_a_root_holding_nothing_says_where_it_looked(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "empty").mkdir()
    code, _, err = report(capsys, str(tmp_path / "empty"), "-o", str(tmp_path / "r.html"))
    assert code == 2
    assert f"root '{tmp_path / 'empty'}'" in err and "neuron/compile_cache" in err
    assert "--cache-dir" in err


def test_no_root_and_an_unwritable_output(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, deployment: Deployment
) -> None:
    code, _, err = report(capsys, "-o", str(tmp_path / "r.html"))
    assert code == 2 and "at least one DIR|URL root" in err
    code, _, err = report(capsys, str(deployment.root), "-o", str(tmp_path / "no" / "r.html"))
    assert code == 2 and "-o " in err and "no directory" in err


# -- roots and overrides -----------------------------------------------------------------------


def test_a_root_maps_by_the_layouts_and_an_option_replaces_its_kind(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, deployment: Deployment
) -> None:
    out = tmp_path / "r.html"
    code, said, err = report(capsys, str(deployment.root), "--cache-dir",
                             str(deployment.cache_b), "-o", str(out))  # fmt: skip
    assert code == 0, err
    assert "2 engines" in said and "2 snapshot bundles" in said and "2 profile runs" in said
    dom = parse(out.read_text())
    origins = [[td.text for td in descendants(tr) if td.tag == "td"]
               for tr in select(dom, "tr") if tr in descendants(select(dom, "table",
                                                                         class_="sources")[0])]
    kinds = {(row[0], row[1]) for row in origins if row}
    assert kinds == {("--cache-dir", "cache"), (str(deployment.root), "manifests"),
                     (str(deployment.root), "snapshots"), (str(deployment.root), "profiles")}
    caches = {e.attrs["data-cache"] for e in select(dom, "div", class_="cache-stats")}
    assert caches == {str(deployment.cache_b)}


def test_a_root_that_is_itself_a_manifest_dir_or_a_tier(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, deployment: Deployment
) -> None:
    out = tmp_path / "r.html"
    code, said, err = report(capsys, str(deployment.root / "manifests"),
                             str(deployment.cache_a), "-o", str(out))  # fmt: skip
    assert code == 0, err
    assert "2 engines" in said and "4 processes" in said and "0 snapshot bundles" in said


# -- what the page says --------------------------------------------------------------------------


def test_partial_deployments_are_marked_as_manifest_check_finds_them(
    report_page: Path, deployment: Deployment
) -> None:
    dom = parse(report_page.read_text())
    engines = {Path(e.attrs["data-engine"]).parent.name: e for e in select(dom, "section",
                                                                          class_="engine")}
    assert set(engines) == {"nodev", "dev0_1"}
    assert engines["dev0_1"].attrs.get("data-partial") == "true"
    assert "data-partial" not in engines["nodev"].attrs
    _, manifest = load_manifest(str(deployment.root / "manifests" / "dev0_1"))
    problems = check_manifest(manifest, str(deployment.cache_a))
    flagged = {g.graph_hash for g in manifest.graphs if any(g.graph_hash in p for p in problems)}
    rows = select(descendants(engines["dev0_1"]), "tr")
    marked = {r.attrs["data-graph"] for r in rows if r.attrs.get("class") == "bad"}
    assert marked == flagged == {KEYS[1]}
    (row,) = [r for r in rows if r.attrs.get("data-graph") == KEYS[1]]
    assert row.attrs.get("data-partial") == "true" and "partial deployment" in row.text


def test_replays_show_what_snapshot_replay_reports(
    report_page: Path, deployment: Deployment
) -> None:
    dom = parse(report_page.read_text())
    snaps = deployment.root / "neuron" / "snapshots"
    for rank, passed in ((0, True), (1, False)):
        bundle = snaps / SNAP_HASH / f"rank{rank}" / "call2"
        done = subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "snapshot", "replay",
                               str(bundle), "--cache-dir", str(deployment.cache_a), "--json"],
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        (expected,) = json.loads(done.stdout)
        assert expected["passed"] is passed
        (table,) = select(dom, "table", class_="replay", data_bundle=str(bundle))
        rows = [r for r in descendants(table) if "data-output" in r.attrs]
        assert len(rows) == len(expected["outputs"]) == 2
        for row, output in zip(rows, expected["outputs"], strict=True):
            values = [float(c.attrs["data-value"]) for c in descendants(row)
                      if "data-value" in c.attrs]
            assert values == [output["max_abs_err"], output["max_rel_err"], output["cosine"]]
        (listed,) = select(dom, "tr", data_bundle=f"{SNAP_HASH}/rank{rank}/call2")
        assert ("pass" if passed else "FAIL") in listed.text


def test_profile_runs_with_their_validation_and_traces(report_page: Path) -> None:
    dom = parse(report_page.read_text())
    runs = {Path(e.attrs["data-run"]).name: e for e in select(dom, "section", class_="profile")}
    assert runs["prefill-ok"].attrs["data-valid"] == "true"
    assert runs["prefill-failed"].attrs["data-valid"] == "false"
    assert "capture status is 'failed'" in runs["prefill-failed"].text
    traces = select(descendants(runs["prefill-ok"]), "tr")
    assert any(t.attrs.get("data-trace", "").endswith(".pt.trace.json.gz") for t in traces)


def test_the_page_is_self_contained_and_escapes_what_it_reads(report_page: Path) -> None:
    text = report_page.read_text()
    assert not re.search(r"<(script|link|img|iframe|object|embed)\b|<[^>]*\b(src|href)=", text)
    assert "@import" not in text and "url(" not in text
    dom = parse(text)
    # the only URL in any attribute is SVG's namespace name, which is never fetched
    urls = {v for e in dom for v in e.attrs.values() if "://" in v}
    assert urls == {"http://www.w3.org/2000/svg"}
    assert HOSTILE_MODEL not in text
    assert any(HOSTILE_MODEL in e.text for e in select(dom, "p"))  # shown, as text


# -- a root on S3 --------------------------------------------------------------------------------


def test_a_root_on_s3_reads_through_the_store(
    s3_env: str, s3_store_url: str, deployment: Deployment, tmp_path: Path
) -> None:
    # The setup's upload is not under test: moto's one Python server, queueing eight
    # parallel uploads on a busy machine, once took more than the 10 s default bound to
    # answer a small put. The report itself reads with the default bound.
    copy_tree(open_store(str(deployment.root)), "",
              open_store(s3_store_url, request_timeout=300), workers=2)
    out = tmp_path / "r.html"
    done = run_report(s3_store_url, "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "2 engines, 4 processes (2 compiles, 0 fetches), 2 snapshot bundles, 2 profile runs" \
        in done.stdout
    dom = parse(out.read_text())
    tier = f"{s3_store_url}/neuron/compile_cache"
    (block,) = select(dom, "div", class_="cache-stats", data_cache=tier)
    cells = {e.attrs["data-stat"]: json.loads(e.attrs["data-value"])
             for e in descendants(block) if "data-stat" in e.attrs}
    stats = subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "cache", "--cache-dir",
                            tier, "stats", "--json"], capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert stats.returncode == 0, stats.stderr
    assert cells["compiles"] == json.loads(stats.stdout)["compiles"] == 2
    assert len(select(dom, "rect", data_kind="compile")) == 2
    runs = {e.attrs["data-run"].rsplit("/", 1)[1]: e for e in select(dom, "section",
                                                                      class_="profile")}
    assert runs["prefill-ok"].attrs["data-valid"] == "true"  # as recorded in its manifest
    assert "recorded" in runs["prefill-ok"].text
    code = subprocess.run([sys.executable, "-m", "vllm_neuron.cli", "report",
                           f"{s3_store_url}-missing/x", "-o", str(out)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert code.returncode == 2 and f"root '{s3_store_url}-missing/x'" in code.stderr


def test_a_tiers_load_failure_notes_are_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A remote where a host could not load an entry (its note,
    compile/entry/load_failure_notes.py): the report read on that tier names the entry, the
    host and the loader's error."""
    from vllm_neuron.compile.entry.load_failure_notes import note_load_failure

    tier = tmp_path / "remote"
    store = open_store(str(tier))
    key = "ab" * 16
    note_load_failure(store, key, "cannot load AOTInductor package: truncated")
    page = tmp_path / "page.html"
    code, _, err = report(capsys, "--cache-dir", str(tier), "-o", str(page))
    assert code == 0, err
    html = page.read_text()
    assert f"{key}: did not load on" in html and "truncated" in html
