"""The report links each graph of a manifest to the snapshot bundles it names and to their
replays (issue 27): links within the page only, every one to an element that is there, the
verdict beside each bundle; the page still loads nothing and logs nothing in Chromium."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from report_browser import descendants, load, parse, select
from report_deployment import TESTS, run_report

if str(TESTS / "snapshot") not in sys.path:
    sys.path.insert(0, str(TESTS / "snapshot"))

from linked_capture import (  # noqa: E402
    NORM_HASH,
    SHARD_HASH,
    STEP,
    Linked,
    capture_linked,
    expected_paths,
)


@pytest.fixture(scope="module")
def linked(tmp_path_factory: pytest.TempPathFactory) -> Linked:
    base = tmp_path_factory.mktemp("linked")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_NEURON_RUN_ID", "report-links-run")
        done = capture_linked(str(base / "manifests"), str(base / "snaps"))
    # One bundle made not to match its captured outputs: its graph shows the failure.
    from vllm_neuron.snapshot.encoding import decode_tensor, encode_tensor

    tensor = Path(done.snapshot_root) / NORM_HASH / "rank1" / f"call{STEP}" / "tensor0.npy"
    t = decode_tensor(tensor.read_bytes(), "npy", "float32", [2, 4]).clone()
    t.view(-1)[0] += 0.5
    tensor.write_bytes(encode_tensor(t, "npy"))
    return done


@pytest.fixture(scope="module")
def page(linked: Linked, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("page") / "report.html"
    done = run_report("--manifest-dir", linked.manifest_dir, "--snapshot-dir",
                      linked.snapshot_root, "--replay", "-o", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_each_graph_links_its_bundles_and_their_replays(page: Path) -> None:
    dom = parse(page.read_text())
    ids = {e.attrs["id"]: e for e in dom if "id" in e.attrs}
    for key in (SHARD_HASH, NORM_HASH):
        (row,) = select(dom, "tr", data_graph=key)
        (cell,) = [e for e in descendants(row) if "data-bundles" in e.attrs]
        assert cell.attrs["data-bundles"] == "2"
        links = [e for e in descendants(cell) if "data-bundle-link" in e.attrs]
        assert [e.attrs["data-bundle-link"] for e in links] == expected_paths(key)
        for link, path in zip(links, expected_paths(key), strict=True):
            bundle, verdict = [a for a in descendants(link) if a.tag == "a"]
            # The bundle's row in the snapshot section ...
            target = ids[bundle.attrs["href"].removeprefix("#")]
            assert target.tag == "tr" and target.attrs["data-bundle"] == path
            # ... and its replay, with the verdict the replay gave.
            table = ids[verdict.attrs["href"].removeprefix("#")]
            assert table.tag == "table" and table.attrs["class"] == "replay"
            assert table.attrs["data-bundle"].endswith(f"/{path}")
            failed = key == NORM_HASH and "/rank1/" in path
            assert verdict.text.strip() == ("FAIL" if failed else "pass")
            assert ("FAIL" if failed else "pass") in target.text


def test_every_link_stays_in_the_page(page: Path) -> None:
    text = page.read_text()
    hrefs = re.findall(r'\bhref="([^"]*)"', text)
    assert len(hrefs) == 8  # two bundles of two graphs, each with its replay
    ids = {e.attrs["id"] for e in parse(text) if "id" in e.attrs}
    assert all(h.startswith("#") and h[1:] in ids for h in hrefs), hrefs
    assert not re.search(r"<(script|link|img|iframe|object|embed)\b|\bsrc=", text)


def test_chromium_loads_it_and_logs_nothing(page: Path, tmp_path: Path) -> None:
    loaded = load(page, tmp_path)
    assert loaded.console == []
    links = select(parse(loaded.dom), "span", class_="bundle-link")
    assert len(links) == 4


def test_a_bundle_the_page_does_not_list_is_named_as_text(linked: Linked, tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    done = run_report("--manifest-dir", linked.manifest_dir, "-o", str(out))
    assert done.returncode == 0, done.stderr
    dom = parse(out.read_text())
    (row,) = select(dom, "tr", data_graph=SHARD_HASH)
    named = [e for e in descendants(row) if "data-bundle-link" in e.attrs]
    assert [e.attrs["data-bundle-link"] for e in named] == expected_paths(SHARD_HASH)
    assert all("not in the snapshot roots read" in e.text for e in named)
    assert "href=" not in out.read_text()
