"""Engine identity from NEURON_VISIBLE_DEVICES."""

from __future__ import annotations

import logging

import pytest

from vllm_neuron.identity import get_server_prefix, parse_visible_devices


@pytest.mark.parametrize(
    ("value", "prefix"),
    [
        ("0-7", "dev0_7"),
        ("8-15", "dev8_15"),
        ("0,1,2,3", "dev0_3"),
        (" 4 ", "dev4_4"),
        ("0-3,8-11", "dev0_11"),
        ("", "nodev"),
    ],
)
def test_prefix_forms(value, prefix):
    assert get_server_prefix({"NEURON_VISIBLE_DEVICES": value}) == prefix


def test_unset_is_nodev():
    assert get_server_prefix({}) == "nodev"


@pytest.mark.parametrize("bad", ["0-x", "7-3", "a,b", "0..7"])
def test_malformed_value_warns_once_and_is_nodev(bad, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm_neuron"):
        assert get_server_prefix({"NEURON_VISIBLE_DEVICES": bad}) == "nodev"
        assert get_server_prefix({"NEURON_VISIBLE_DEVICES": bad}) == "nodev"
    messages = [r.message for r in caplog.records if bad in r.message]
    assert len(messages) == 1 and "NEURON_VISIBLE_DEVICES" in messages[0]


def test_parse_visible_devices_dedups_and_sorts():
    assert parse_visible_devices("3,1-2,2") == [1, 2, 3]
