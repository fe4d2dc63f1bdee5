"""The operator's kit in deploy/ is consistent with the code it drives (docs/operations.md).

Every file parses; every metric a PromQL expression (dashboard, alert rule) names is one
our exporter really produces or one of vLLM's own listed below; every alert carries what an
on-call engineer needs; every `vllm-neuron` command a Kubernetes manifest runs parses with
the CLI's own parser; every variable a manifest sets is a real setting. No server: the
exporter's names come from rendering it into fresh registries.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from vllm_neuron.cli import build_parser
from vllm_neuron.compile.tiers.inventory import parse_size
from vllm_neuron.envs import ENVIRONMENT_VARIABLES, load_compile_cache_settings
from vllm_neuron.metrics import GAUGES, SeriesTotals, TierSampler, render_text

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DASHBOARDS = sorted(DEPLOY.glob("**/*.json"))
YAML_FILES = sorted(DEPLOY.glob("**/*.yaml"))

# vLLM's own series the dashboard shows beside ours (vLLM 0.32, vllm/v1/metrics/loggers.py;
# served by the same /metrics). Histograms are named by the samples PromQL reads.
VLLM_SERIES = frozenset({
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
})
# Variables a manifest may set that are no setting of ours: the temporary directory every
# process of ours and of Python's tempfile uses (an emptyDir in the examples).
OTHER_VARIABLES = frozenset({"TMPDIR"})
SETTINGS = frozenset(v.name for v in ENVIRONMENT_VARIABLES)

PROMQL_WORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan"})


def exported_names(tmp_path: Path) -> set[str]:
    """Every family and sample name the exporter produces: the counters from folded totals
    (what `cache stats --prometheus` renders), the gauges from one real sample collected
    by prometheus_client's multiprocess collector (what vLLM's /metrics serves)."""
    text = render_text(SeriesTotals())
    remote = tmp_path / "remote"
    remote.mkdir()
    env = {"VLLM_CACHE_ROOT": str(tmp_path / "root"), "VLLM_NEURON_CACHE_MAX_SIZE": "1G",
           "NEURON_LIBTORCH_REMOTE_CACHE": str(remote)}
    directory = tmp_path / "metrics"
    directory.mkdir()
    sampled = TierSampler(str(directory), env).sample()
    assert {gauge for gauge, _ in sampled} == set(GAUGES)  # every gauge got a value
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    text += generate_latest(registry).decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


@pytest.fixture(scope="module")
def known_metrics(tmp_path_factory: pytest.TempPathFactory) -> frozenset[str]:
    return frozenset(exported_names(tmp_path_factory.mktemp("exporter"))) | VLLM_SERIES


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords, label matchers,
    ranges and grouping lists taken out; Grafana's $variables live inside those)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w$.])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group() in PROMQL_WORDS:
            continue  # a function or an operator
        names.add(m.group())
    return names


def test_metric_names_are_found_in_expressions() -> None:
    """The extraction itself: a metric beside functions, matchers, ranges and grouping."""
    expr = ('sum by (tier) (rate(vllm_neuron_cache_hits_total{job=~"$job"}[$__rate_interval]))'
            " / on(instance) vllm:num_requests_running > 0.9 and bool up")
    assert metric_names(expr) == {"vllm_neuron_cache_hits_total", "vllm:num_requests_running",
                                  "up"}


def yaml_documents() -> Iterator[tuple[Path, Any]]:
    for path in YAML_FILES:
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc is not None:
                    yield path, doc


def test_the_kit_has_every_part_and_every_file_parses() -> None:
    assert DASHBOARDS and YAML_FILES
    for path in DASHBOARDS:
        json.loads(path.read_text())
    kinds = {doc.get("kind") for _, doc in yaml_documents()}
    assert {"StatefulSet", "CronJob", "ConfigMap"} <= kinds
    assert any("groups" in doc for _, doc in yaml_documents())


# ------------------------------------------------------------------ dashboards and alerts
def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and every templating query."""
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r}", target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable["type"] == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            found = re.fullmatch(r"label_values\((.*),\s*\w+\)", text)
            assert found, f"variable {variable['name']}: {text}"
            yield f"variable {variable['name']}", found.group(1)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_the_dashboard_is_importable_and_names_real_series(
    path: Path, known_metrics: frozenset[str]
) -> None:
    dashboard = json.loads(path.read_text())
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["title"] and dashboard["uid"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert graphs and all(p["targets"] and p["gridPos"] and p["datasource"] for p in graphs)
    named: set[str] = set()
    for where, expr in dashboard_queries(dashboard):
        names = metric_names(expr)
        assert names, f"{path.name}, {where}: no metric in {expr!r}"
        assert names <= known_metrics, f"{path.name}, {where}: unknown {names - known_metrics}"
        named |= names
    # What the issue asks the dashboard for: the problems, the gauges, a vLLM series.
    for wanted in ("vllm_neuron_cache_hits_total", "vllm_neuron_cache_misses_total",
                   "vllm_neuron_cache_compiles_total", "vllm_neuron_cache_compile_failures_total",
                   "vllm_neuron_cache_remote_outages_total",
                   "vllm_neuron_cache_verification_failures_total",
                   "vllm_neuron_cache_untrusted_total", "vllm_neuron_cache_tier_size_bytes",
                   "vllm_neuron_cache_tier_bound_bytes", "vllm_neuron_cache_remote_up",
                   "vllm:time_to_first_token_seconds_bucket"):
        assert wanted in named, wanted


def alert_rules() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, rule) for path, doc in yaml_documents() if "groups" in doc
            for group in doc["groups"] for rule in group["rules"]]


def test_every_alert_rule_is_complete_and_names_real_series(
    known_metrics: frozenset[str],
) -> None:
    rules = alert_rules()
    assert rules
    covered: set[str] = set()
    for path, rule in rules:
        name = rule.get("alert")
        assert name and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", name), (path.name, rule)
        assert re.fullmatch(r"\d+[smh]", str(rule.get("for", ""))), f"{name}: no `for:`"
        assert rule.get("labels", {}).get("severity"), f"{name}: no severity label"
        notes = rule.get("annotations", {})
        assert notes.get("summary") and notes.get("description"), f"{name}: annotations"
        names = metric_names(rule["expr"])
        assert names and names <= known_metrics, f"{name}: unknown {names - known_metrics}"
        covered |= names
    for wanted in ("vllm_neuron_cache_compile_failures_total",
                   "vllm_neuron_cache_remote_outages_total", "vllm_neuron_cache_remote_up",
                   "vllm_neuron_cache_verification_failures_total",
                   "vllm_neuron_cache_untrusted_total", "vllm_neuron_cache_tier_size_bytes",
                   "vllm_neuron_cache_tier_bound_bytes"):
        assert wanted in covered, wanted


# ------------------------------------------------------------------------------ Kubernetes
def pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    for path, doc in yaml_documents():
        kind = doc.get("kind")
        if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield f"{path.name} {kind}", doc["spec"]["template"]["spec"]
        elif kind == "CronJob":
            yield f"{path.name} {kind}", doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]


def containers() -> Iterator[tuple[str, dict[str, Any]]]:
    for where, spec in pod_specs():
        for container in spec.get("initContainers", []) + spec["containers"]:
            yield f"{where} {container['name']}", container


def parses(argv: list[str]) -> str | None:
    """None when the `vllm-neuron` parser accepts `argv`, else why not."""
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        return f"vllm-neuron {' '.join(argv)}: exit {exc.code}"
    return None


def test_the_parser_check_can_fail() -> None:
    assert parses(["cache", "prune", "--max-size", "1G"]) is None
    assert parses(["cache", "prun", "--max-size", "1G"]) is not None
    assert parses(["cache", "prune", "--max-sise", "1G"]) is not None


def test_every_vllm_neuron_command_a_manifest_runs_parses() -> None:
    ran = []
    for where, container in containers():
        argv = [str(a) for a in container.get("command", []) + container.get("args", [])]
        if not argv or argv[0] != "vllm-neuron":
            # A command hidden in a shell line would escape the check: none are.
            assert not any("vllm-neuron" in a for a in argv), f"{where}: {argv}"
            continue
        problem = parses(argv[1:])
        assert problem is None, f"{where}: {problem}"
        for option, value in zip(argv, argv[1:], strict=False):
            if option == "--max-size":
                parse_size(value)
        ran.append(" ".join(argv[1:3]))
    assert {"cache warm", "manifest check", "cache gc", "cache prune"} <= set(ran)
    assert any("--remote" in c.get("command", []) and "check" in c.get("command", [])
               for _, c in containers())


def test_every_variable_a_manifest_sets_is_a_real_setting() -> None:
    seen = set()
    for where, container in containers():
        for item in container.get("env", []):
            assert item["name"] in SETTINGS | OTHER_VARIABLES, f"{where}: {item['name']}"
            seen.add(item["name"])
    config_maps = [doc for _, doc in yaml_documents() if doc.get("kind") == "ConfigMap"]
    for config_map in config_maps:
        data = {k: str(v) for k, v in config_map["data"].items()}
        unknown = set(data) - SETTINGS - OTHER_VARIABLES
        assert not unknown, f"ConfigMap {config_map['metadata']['name']}: {unknown}"
        load_compile_cache_settings(data)  # and the values are well-formed
        seen |= set(data)
    names = {c["metadata"]["name"] for c in config_maps}
    assert {"vllm-neuron-env-mp", "vllm-neuron-env-ray"} <= names
    for where, container in containers():  # every envFrom names a ConfigMap of the kit
        for source in container.get("envFrom", []):
            assert source["configMapRef"]["name"] in names, where
    assert {"VLLM_CACHE_ROOT", "NEURON_LIBTORCH_REMOTE_CACHE",
            "VLLM_NEURON_CACHE_MAX_SIZE"} <= seen
