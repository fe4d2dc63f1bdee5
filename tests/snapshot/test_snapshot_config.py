"""Snapshot settings: defaults, every variable, startup validation and the async gate."""

from __future__ import annotations

import logging
import os

import pytest
from snapshot_helpers import PREFIX

from vllm_neuron.envs import ConfigError
from vllm_neuron.snapshot import (
    CaptureSelector,
    check_snapshot_gating,
    load_snapshot_config,
    reset_snapshot_config,
    snapshot_config,
)

HOME = {"HOME": "/home/alice", "USER": "alice"}
ON = {**HOME, PREFIX + "ENABLE": "1"}


def test_disabled_by_default_and_root_follows_vllm_cache_root() -> None:
    cfg = load_snapshot_config(HOME)
    assert not cfg.enabled
    assert cfg.root == "/home/alice/.cache/vllm/neuron/snapshots"
    cfg = load_snapshot_config({**HOME, "VLLM_CACHE_ROOT": "/data/vc"})
    assert cfg.root == "/data/vc/neuron/snapshots"


@pytest.mark.parametrize("value", ["0", "false", "off", "", "  "])
def test_enable_off_values(value: str) -> None:
    assert not load_snapshot_config({**HOME, PREFIX + "ENABLE": value}).enabled


def test_enabled_defaults_follow_the_seed() -> None:
    cfg = load_snapshot_config(ON)
    assert cfg.enabled
    assert cfg.selector == CaptureSelector(at_calls=frozenset({0}))  # no rule: call 0
    assert cfg.max_captures == 4
    assert cfg.ranks is None
    assert cfg.format == "pt"


def test_every_variable_parses() -> None:
    cfg = load_snapshot_config(
        {
            **ON,
            PREFIX + "CAPTURE_AT_CALL": " 0, 3 ,7",
            PREFIX + "CAPTURE_TOKEN": "130,131",
            PREFIX + "CAPTURE_REQUEST": "abc, chatcmpl-1",
            PREFIX + "MAX_CAPTURES": "9",
            PREFIX + "RANKS": "0,2",
            PREFIX + "FORMAT": "NPY",
            PREFIX + "DIR": "s3://bucket/snaps/",
        }
    )
    assert cfg.selector == CaptureSelector(
        at_calls=frozenset({0, 3, 7}),
        tokens=frozenset({130, 131}),
        requests=("abc", "chatcmpl-1"),
    )
    assert (cfg.max_captures, cfg.ranks, cfg.format) == (9, frozenset({0, 2}), "npy")
    assert cfg.root == "s3://bucket/snaps"


def test_minus_one_selects_every_call() -> None:
    sel = load_snapshot_config({**ON, PREFIX + "CAPTURE_AT_CALL": "-1"}).selector
    assert sel.all_calls and all(sel.selects_call(i) for i in range(100))


def test_token_or_request_rule_alone_turns_off_the_default_call_rule() -> None:
    for var, value in (("CAPTURE_TOKEN", "5"), ("CAPTURE_REQUEST", "abc")):
        sel = load_snapshot_config({**ON, PREFIX + var: value}).selector
        assert sel.at_calls is None and not sel.selects_call(0)


def test_dir_override_local_path_is_absolute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir("/tmp")
    assert load_snapshot_config({**ON, PREFIX + "DIR": "rel/snaps"}).root == "/tmp/rel/snaps"
    assert load_snapshot_config({**ON, PREFIX + "DIR": "memory://x"}).root == "memory://x"


MALFORMED = [
    ("ENABLE", "maybe", "not a boolean"),
    ("ENABLE", "2", "not a boolean"),
    ("CAPTURE_AT_CALL", "first", "'first' is not an integer call index"),
    ("CAPTURE_AT_CALL", "1.5", "'1.5' is not an integer call index"),
    ("CAPTURE_AT_CALL", "1,,2", "an empty item"),
    ("CAPTURE_AT_CALL", "-2", "0-based"),
    ("CAPTURE_AT_CALL", "-1,3", "cannot be combined"),
    ("CAPTURE_TOKEN", "12a", "'12a' is not an integer token position"),
    ("CAPTURE_TOKEN", "0", ">= 1"),
    ("CAPTURE_TOKEN", "-4", ">= 1"),
    ("CAPTURE_TOKEN", "5,", "an empty item"),
    ("CAPTURE_REQUEST", "abc,", "empty request id"),
    ("CAPTURE_REQUEST", ",", "empty request id"),
    ("MAX_CAPTURES", "0", ">= 1"),
    ("MAX_CAPTURES", "-1", ">= 1"),
    ("MAX_CAPTURES", "four", ">= 1"),
    ("MAX_CAPTURES", "2.0", ">= 1"),
    ("FORMAT", "pickle", "not a snapshot format"),
    ("FORMAT", "np", "not a snapshot format"),
]


@pytest.mark.parametrize(("var", "value", "message"), MALFORMED)
def test_malformed_values_raise_naming_variable_and_value(
    var: str, value: str, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_snapshot_config({**ON, PREFIX + var: value})
    text = str(info.value)
    assert PREFIX + var in text
    assert repr(value) in text
    assert message in text


@pytest.mark.parametrize("value", ["zero", "0,x", "-1", "1,,2"])
def test_malformed_rank_list_degrades_to_all_ranks_with_a_warning(
    value: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm_neuron.snapshot")
    cfg = load_snapshot_config({**ON, PREFIX + "RANKS": value})
    assert cfg.ranks is None
    assert cfg.captures_rank(0) and cfg.captures_rank(7)
    assert any(PREFIX + "RANKS" in r.getMessage() and "every rank" in r.getMessage()
               for r in caplog.records)


def test_safetensors_format_needs_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    assert load_snapshot_config({**ON, PREFIX + "FORMAT": "safetensors"}).format == "safetensors"
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "safetensors" else real(n, *a)
    )
    with pytest.raises(ConfigError, match="pip install safetensors"):
        load_snapshot_config({**ON, PREFIX + "FORMAT": "safetensors"})


def test_stray_variables_without_enable_are_ignored_but_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm_neuron.snapshot")
    cfg = load_snapshot_config({**HOME, PREFIX + "CAPTURE_TOKEN": "garbage"})
    assert not cfg.enabled  # a disabled feature never fails start-up
    assert any("capture is off" in r.getMessage() for r in caplog.records)


def test_resolved_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PREFIX + "ENABLE", "1")
    monkeypatch.setenv(PREFIX + "MAX_CAPTURES", "2")
    first = snapshot_config()
    monkeypatch.setenv(PREFIX + "MAX_CAPTURES", "3")
    assert snapshot_config() is first  # cached: the env is not re-parsed per executable
    reset_snapshot_config()
    assert snapshot_config().max_captures == 3


def test_gating_rejects_async_scheduling_only_when_enabled() -> None:
    on = load_snapshot_config(ON)
    off = load_snapshot_config(HOME)
    assert check_snapshot_gating(False, on) is on
    assert check_snapshot_gating(True, off) is off
    with pytest.raises(ConfigError, match="async scheduling") as info:
        check_snapshot_gating(True, on)
    assert PREFIX + "ENABLE" in str(info.value)


def test_gating_resolves_the_process_config_and_fails_at_startup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PREFIX + "ENABLE", "1")
    monkeypatch.setenv(PREFIX + "CAPTURE_TOKEN", "twelve")
    with pytest.raises(ConfigError, match="twelve"):
        check_snapshot_gating(False)
    assert os.environ[PREFIX + "ENABLE"] == "1"


def test_env_vars_are_documented() -> None:
    from vllm_neuron.envs import ENVIRONMENT_VARIABLES
    from vllm_neuron.snapshot.config import VARIABLES

    documented = {v.name for v in ENVIRONMENT_VARIABLES}
    assert set(VARIABLES) <= documented
