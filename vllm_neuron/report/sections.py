"""The page's sections for manifests, snapshot bundles and profile runs.

Why apart from `page`: each renders one feature's records as tables, as its own command
shows them (`manifest show`/`check`, `snapshot ls`/`replay`, `profile show`/`validate`),
and only marks what matters at a glance: a partial deployment, a failed replay, a failed
validation. Each row carries the record's identity in a ``data-*`` attribute.

A graph links to the snapshot bundles its manifest names (``input_snapshot_paths``, relative
to a snapshot root or a URL): each is looked up among the bundles of the snapshot roots the
page lists, and links (``href="#..."``, within the page: nothing is loaded) to that bundle's
row and, when it was replayed, to its replay, with the verdict beside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from vllm_neuron.compile.entry.text import human_size
from vllm_neuron.manifest.inspect import snapshot_paths
from vllm_neuron.manifest.schema import GraphEntry
from vllm_neuron.snapshot.replay import ReplayReport

from .gather import EngineView
from .markup import Markup, el, join
from .runs import ARTIFACT_FIELDS, ProfileRun, SnapshotView

__all__ = ["bundle_index", "render_engines", "render_profiles", "render_snapshots"]


def _table(headers: Sequence[str], rows: Sequence[Markup], **attrs: Any) -> Markup:
    return el("table", el("tr", *(el("th", h) for h in headers)), join(rows), **attrs)


def _badge(text: str, kind: str) -> Markup:
    return el("span", text, class_=f"badge {kind}")


def problem_list(title: str, items: Sequence[str]) -> Markup:
    return el("div", el("b", title), el("ul", join(el("li", p) for p in items)),
              class_="problems")  # fmt: skip


# Manifests ----------------------------------------------------------------------------------


def _anchor(kind: str, root: int, prefix: str) -> str:
    """The id of a bundle's row (``bundle``) or replay (``replay``) in the snapshot section."""
    return f"{kind}-{root}-{prefix}"


BundleIndex = dict[str, tuple[int, str, ReplayReport | None]]


def bundle_index(views: Sequence[SnapshotView]) -> BundleIndex:
    """How a manifest's snapshot path finds its bundle on the page: by URL (root and
    prefix), or by prefix alone for a path relative to its root (the first root holding it)
    -> (the root's number, the bundle's prefix, its replay)."""
    out: BundleIndex = {}
    for n, view in enumerate(views):
        if view.listing is None:
            continue
        root = view.root.rstrip("/")
        for b in view.listing.bundles:
            found = (n, b.prefix, view.replays.get(b.prefix))
            out.setdefault(f"{root}/{b.prefix}", found)
            out.setdefault(b.prefix, found)
    return out


def _bundle_links(g: GraphEntry, index: BundleIndex) -> Markup:
    """The graph's bundles: a link to each bundle's row, its replay verdict linking to the
    replay; a bundle the page does not list is named as text."""
    paths = snapshot_paths([g])
    if not paths:
        return el("td", "-", class_="muted")
    links = []
    for path in paths:
        label = "/".join(path.rstrip("/").split("/")[-2:])  # rank<N>/call<K>
        found = index.get(path)
        if found is None:
            links.append(el("span", label, " (not in the snapshot roots read)", title=path,
                            class_="muted", data_bundle_link=path))  # fmt: skip
            continue
        root, prefix, replayed = found
        row = _anchor("bundle", root, prefix)
        # The replay's table when it has one (outputs compared), else the row saying why.
        target = _anchor("replay", root, prefix) if replayed and replayed.outputs else row
        verdict = (None if replayed is None else
                   el("a", _badge("pass", "ok") if replayed.passed else _badge("FAIL", "bad"),
                      href=f"#{target}", data_replay_link=path))
        links.append(el("span", el("a", label, href=f"#{row}", title=path), " ", verdict,
                        class_="bundle-link", data_bundle_link=path))  # fmt: skip
    return el("td", join(links, Markup(" · ")), data_bundles=len(paths))


def _engine(engine: EngineView, index: BundleIndex) -> Markup:
    if engine.manifest is None:
        return el("section", el("h3", engine.location),
                  problem_list("This manifest cannot be read", [engine.error or "unknown error"]),
                  class_="engine", data_engine=engine.location)  # fmt: skip
    m = engine.manifest
    cfg, topo = m.config, m.config.topology
    partial = any("partial" in p for p in engine.problems)
    badge = (_badge("partial deployment", "bad") if partial
             else _badge(f"{len(engine.problems)} problems", "bad") if engine.problems
             else _badge("complete", "ok"))  # fmt: skip
    facts = (f"model {cfg.model or '-'} · target {cfg.target or '-'} · dtype {cfg.dtype or '-'}"
             f" · world {topo.world_size} (tp {topo.tensor_parallel_size}, pp "
             f"{topo.pipeline_parallel_size}, dp {topo.data_parallel_size}) · max_num_seqs "
             f"{cfg.max_num_seqs if cfg.max_num_seqs is not None else '-'} · max_model_len "
             f"{cfg.max_model_len if cfg.max_model_len is not None else '-'}")  # fmt: skip
    rows = []
    for g in m.graphs:
        found = engine.problems_of(g.graph_hash)
        rows.append(el(
            "tr", el("td", g.graph_hash[:12], title=g.graph_hash, class_="mono"),
            el("td", "; ".join(g.input_shapes) or "-", class_="mono"),
            el("td", "; ".join(g.output_shapes) or "-", class_="mono"),
            el("td", human_size(g.neff_size), class_="num"),
            el("td", ",".join(map(str, g.ranks)) or "-"), el("td", g.created_timestamp or "-"),
            el("td", "; ".join(found) if found else "ok"), _bundle_links(g, index),
            class_="bad" if found else None, data_graph=g.graph_hash,
            data_partial="true" if any("partial" in p for p in found) else None,
        ))  # fmt: skip
    other = [p for p in engine.problems if not any(g.graph_hash in p for g in m.graphs)]
    return el("section",
              el("h3", engine.location, " ", badge), el("p", facts, class_="muted"),
              problem_list("Not part of any graph", other) if other else None,
              _table(["graph", "inputs", "outputs", "size", "ranks", "created", "check",
                      "snapshot bundles"], rows, class_="graphs"),
              el("p", f"{len(m.graphs)} graphs", class_="muted"),
              class_="engine", data_engine=engine.location,
              data_partial="true" if partial else None)  # fmt: skip


def render_engines(engines: Sequence[EngineView],
                   snapshots: Sequence[SnapshotView] = ()) -> Markup:
    """Each engine's manifest; its graphs link to their bundles among `snapshots` (the
    page's snapshot roots, in the order `render_snapshots` draws them)."""
    index = bundle_index(snapshots)
    return join(_engine(e, index) for e in engines)


# Snapshots ----------------------------------------------------------------------------------


def _num(x: float) -> str:
    if math.isinf(x):
        return "inf"
    return "0" if x == 0.0 else f"{x:.3e}"


def _replay_cell(report: ReplayReport | None) -> Markup:
    if report is None:
        return el("td", "not replayed", class_="muted")
    if report.passed:
        return el("td", _badge("pass", "ok"), f" ({report.runner})")
    return el("td", _badge("FAIL", "bad"), " ", report.problem or f"({report.runner})")


def _replay_details(report: ReplayReport, anchor: str) -> Markup | None:
    if not report.outputs:
        return None
    rows = [el("tr", el("td", o.index, class_="num"), el("td", o.dtype),
               el("td", "x".join(map(str, o.shape)) or "scalar"),
               el("td", _num(o.max_abs_err), class_="num", data_value=repr(o.max_abs_err)),
               el("td", _num(o.max_rel_err), class_="num", data_value=repr(o.max_rel_err)),
               el("td", f"{o.cosine:.6f}", class_="num", data_value=repr(o.cosine)),
               el("td", f"{o.atol:g}", class_="num"), el("td", f"{o.rtol:g}", class_="num"),
               el("td", "pass" if o.passed else f"FAIL ({o.mismatched} elements)"
                  + (f": {o.problem}" if o.problem else "")),
               class_=None if o.passed else "bad", data_output=o.index)
            for o in report.outputs]  # fmt: skip
    headers = ["output", "dtype", "shape", "max abs err", "max rel err", "cosine", "atol", "rtol",
               "result"]  # fmt: skip
    # The id on the table, inside the closed details: a link to it opens them.
    return el("details", el("summary", f"replay of {report.bundle}"),
              _table(headers, rows, class_="replay", data_bundle=report.bundle,
                     id=anchor))  # fmt: skip


def _snapshot_root(n: int, view: SnapshotView) -> Markup:
    if view.listing is None:
        return el("section", el("h3", view.root),
                  problem_list("This snapshot root cannot be read", [view.error or "unknown"]),
                  class_="snapshots", data_root=view.root)  # fmt: skip
    rows, details = [], []
    for b in view.listing.bundles:
        replayed = view.replays.get(b.prefix)
        phase = "-" if b.is_prompt is None else ("prefill" if b.is_prompt else "decode")
        rows.append(el(
            "tr", el("td", b.compilation_hash[:12], title=b.compilation_hash, class_="mono"),
            el("td", f"{b.global_rank} / {b.tp_rank} / {b.dp_rank}"),
            el("td", b.call_index, class_="num"),
            el("td", "-" if b.global_step is None else b.global_step, class_="num"),
            el("td", phase), el("td", ",".join(b.selected_by)), el("td", b.format),
            el("td", f"{b.inputs}/{b.outputs}"), el("td", human_size(b.size), class_="num"),
            _replay_cell(replayed), data_bundle=b.prefix,
            class_="bad" if replayed is not None and not replayed.passed else None,
            id=_anchor("bundle", n, b.prefix),
        ))  # fmt: skip
        if replayed is not None:
            details.append(_replay_details(replayed, _anchor("replay", n, b.prefix)))
    headers = ["hash", "rank (global / tp / dp)", "call", "step", "phase", "selected by",
               "format", "in/out", "size", "replay"]  # fmt: skip
    leftovers = ([f"incomplete (no meta.json, not a bundle): {p}" for p in view.listing.incomplete]
                 + [f"unreadable meta.json: {p}" for p in view.listing.unreadable])  # fmt: skip
    return el("section", el("h3", view.root),
              _table(headers, rows, class_="bundles"),
              el("p", f"{len(view.listing.bundles)} bundles, {human_size(view.listing.size)}",
                 class_="muted"),
              problem_list("Not bundles", leftovers) if leftovers else None,
              join(d for d in details if d is not None),
              class_="snapshots", data_root=view.root)  # fmt: skip


def render_snapshots(views: Sequence[SnapshotView]) -> Markup:
    return join(_snapshot_root(n, v) for n, v in enumerate(views))


# Profiles -----------------------------------------------------------------------------------


def _profile(run: ProfileRun) -> Markup:
    m = run.manifest
    if m is None:
        return el("section", el("h3", run.location),
                  problem_list("This run cannot be read", [run.error or "no manifest.json"]),
                  class_="profile", data_run=run.location)  # fmt: skip
    v = run.validation
    verdict = (_badge("not validated", "warn") if v is None
               else _badge(f"valid ({v.source})", "ok") if v.ok
               else _badge(f"invalid ({v.source})", "bad"))  # fmt: skip
    status = _badge(m.status, "ok" if m.status == "ok" else "bad")
    artifacts = []
    for name in ARTIFACT_FIELDS:
        path = getattr(m.profile, name)
        if path is None and name != "device_trace":
            continue
        artifacts.append(el("tr", el("td", name), el("td", path or "(null)", class_="mono"),
                            el("td", human_size(run.sizes.get(path)) if path else "-",
                               class_="num")))  # fmt: skip
    traces = [el("tr", el("td", t.path, class_="mono"), el("td", t.worker or "-"),
                 el("td", human_size(t.size), class_="num"), data_trace=t.path)
              for t in m.profile.traces]  # fmt: skip
    windows = [el("li", f"attempt {w.attempt} window {w.window}: {w.outcome}"
                  + (f" ({w.reason})" if w.reason else "")) for w in m.windows]  # fmt: skip
    facts = (f"recipe {m.recipe} · phase {m.phase} · profiler {m.profile.profiler} · "
             f"started {m.started_at or '-'} · finished {m.finished_at or '-'}")
    return el("section",
              el("h3", m.run_name or run.location, " ", status, " ", verdict),
              el("p", facts, class_="muted"), el("p", run.location, class_="mono muted"),
              el("p", "error: ", m.error) if m.error else None,
              problem_list("Validation failures", v.failures) if v and v.failures else None,
              el("ul", join(el("li", "note: ", n) for n in v.notes)) if v and v.notes else None,
              el("h4", "Artifacts"), _table(["artifact", "path", "size"], artifacts),
              el("h4", "Trace files") if traces else None,
              _table(["path", "worker", "size (recorded)"], traces, class_="traces")
              if traces else None,
              el("p", "steps: ", ", ".join(m.executed_graphs)) if m.executed_graphs else None,
              el("ul", join(windows)) if windows else None,
              class_="profile", data_run=run.location,
              data_valid=None if v is None else str(v.ok).lower())  # fmt: skip


def render_profiles(runs: Sequence[ProfileRun]) -> Markup:
    return join(_profile(r) for r in runs)
