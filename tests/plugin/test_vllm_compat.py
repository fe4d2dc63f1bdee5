"""The plugin's start-up checks that need no vLLM: the supported vLLM range, and the
registration of the settings when vLLM's table of variables is missing or holds a name.
The registration inside the real vLLM is in test_vllm_env.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm_neuron.envs import INTERNAL_MARKERS, OWN_SETTINGS
from vllm_neuron.plugin.vllm_env import register_settings_with_vllm
from vllm_neuron.plugin.vllm_version import (
    SUPPORTED_RANGE,
    check_vllm_version,
    vllm_version_supported,
)


@pytest.mark.parametrize(("version", "supported"), [
    ("0.32.0", True), ("0.32.7.dev3+cpu", True), ("v0.32.1", True),
    ("0.31.9", False), ("0.33.0", False), ("1.0.0", False), ("dev", None),
])
def test_supported_vllm_range(version: str, supported: bool | None) -> None:
    assert vllm_version_supported(version) is supported


def test_a_vllm_outside_the_range_is_warned_about_naming_the_range(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vllm_neuron"):
        assert check_vllm_version("0.32.2")
        assert caplog.records == []
        assert not check_vllm_version("0.34.0")
        assert not check_vllm_version("dev")
    assert len(caplog.records) == 2
    assert "vLLM 0.34.0 is outside the supported range" in caplog.records[0].getMessage()
    assert f"supports vLLM {SUPPORTED_RANGE}" in caplog.records[0].getMessage()
    assert "vLLM dev is not a version this package can read" in caplog.records[1].getMessage()


def test_registration_keeps_vllms_own_getter_and_degrades_without_a_table(
        caplog: pytest.LogCaptureFixture) -> None:
    def theirs() -> str:
        return "vLLM's"

    table = {OWN_SETTINGS[0]: theirs}
    added = register_settings_with_vllm(SimpleNamespace(environment_variables=table))
    assert added == list(OWN_SETTINGS[1:]) and table[OWN_SETTINGS[0]] is theirs
    assert all(table[name]() is None for name in added)  # no value in vLLM's compile hash
    with caplog.at_level(logging.WARNING, logger="vllm_neuron"):
        assert register_settings_with_vllm(SimpleNamespace()) == []
    assert "no vllm.envs.environment_variables table" in caplog.text


def test_internal_markers_are_outside_vllms_namespace() -> None:
    """vLLM checks every VLLM_* variable; what the plugin sets itself is no setting."""
    assert INTERNAL_MARKERS and not any(m.startswith("VLLM_") for m in INTERNAL_MARKERS)
    assert not set(INTERNAL_MARKERS) & set(OWN_SETTINGS)
