"""The plugin's hooks without vLLM: entry points, settings, the forward context publisher.

The same hooks run inside a real `vllm serve` in test_vllm_serve.py; here each is checked
on its own, quickly, with stand-ins for vLLM's objects (they are used by attribute only).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_neuron import envs
from vllm_neuron import plugin as plugin_mod
from vllm_neuron.envs import ConfigError, load_host_mode_settings
from vllm_neuron.plugin import hooks
from vllm_neuron.plugin.hooks import ForwardPublisher, install_forward_publisher
from vllm_neuron.snapshot import context as snap_context
from vllm_neuron.snapshot.context import reset_snapshot_config

SNAP = "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_"


@pytest.fixture(autouse=True)
def clean_settings(monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in ("VLLM_NEURON_HOST_MODE", "VLLM_NEURON_TOOLCHAIN", "VLLM_NEURON_MANIFEST_DIR",
                 *(SNAP + s for s in ("ENABLE", "CAPTURE_AT_CALL", "CAPTURE_TOKEN",
                                      "CAPTURE_REQUEST", "MAX_CAPTURES", "RANKS", "FORMAT",
                                      "DIR"))):
        monkeypatch.delenv(name, raising=False)
    # No vLLM here: its CPU platform stands as fenced (the fence itself, and host mode off
    # without it, are tested in vLLM's environment: test_vllm_internals.py).
    monkeypatch.setattr(plugin_mod, "resolve", lambda qualname: object())
    # register() in host mode would start Inductor's CPU probe for this process's default
    # cache root (head_start.py): this process has looked already.
    monkeypatch.setenv("_VLLM_NEURON_CPU_PROBE_STARTED", str(os.getpid()))
    # ... and it would look for vLLM's model information (model_info.py), marking this
    # process for the ones it starts: restored after the test, as the probe's marker.
    monkeypatch.setenv("_VLLM_NEURON_MODEL_INFO_LOOKED", str(os.getpid()))
    # register() would give the package logger a stderr handler (not propagating): keep
    # this session's logging as pytest set it up.
    monkeypatch.setattr(plugin_mod, "_show_logs", lambda: None)
    envs.reset_for_tests()
    reset_snapshot_config()
    yield
    envs.reset_for_tests()
    reset_snapshot_config()
    snap_context.clear_current_forward()


# Settings and entry points ----------------------------------------------------------------


def test_host_mode_is_a_strict_boolean() -> None:
    assert not load_host_mode_settings({}).enabled
    assert load_host_mode_settings({"VLLM_NEURON_HOST_MODE": " yes "}).enabled
    assert not load_host_mode_settings({"VLLM_NEURON_HOST_MODE": ""}).enabled
    with pytest.raises(ConfigError, match=r"VLLM_NEURON_HOST_MODE='ture'"):
        load_host_mode_settings({"VLLM_NEURON_HOST_MODE": "ture"})


def test_host_mode_refuses_the_neuron_toolchain() -> None:
    env = {"VLLM_NEURON_HOST_MODE": "1", "VLLM_NEURON_TOOLCHAIN": "neuron"}
    with pytest.raises(ConfigError, match="VLLM_NEURON_TOOLCHAIN='neuron'"):
        load_host_mode_settings(env)
    assert load_host_mode_settings({**env, "VLLM_NEURON_TOOLCHAIN": "host"}).enabled


def test_host_mode_is_documented() -> None:
    names = {v.name for v in envs.ENVIRONMENT_VARIABLES}
    assert "VLLM_NEURON_HOST_MODE" in names


def fake_neuron_host(tmp_path: Path) -> Path:
    """A device directory as on a Trainium machine (plus a node that is not a device)."""
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "neuron0").touch()
    (dev / "neuron_monitor").touch()
    return dev


def stepping_aside_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if "claims no vLLM platform" in r.getMessage()]


def test_platform_plugin_steps_aside_on_a_neuron_host_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # On a Trainium machine vLLM must select as if this package had no platform (the
    # Neuron runtime's plugin, or stock vLLM): a platform claimed here could only refuse.
    dev = fake_neuron_host(tmp_path)
    monkeypatch.setattr(plugin_mod, "_stepped_aside", False)
    with caplog.at_level(logging.INFO, logger="vllm_neuron"):
        assert plugin_mod.platform_plugin(str(dev)) is None
        assert plugin_mod.platform_plugin(str(dev)) is None  # vLLM asks more than once
    (line,) = stepping_aside_lines(caplog)
    assert str(dev) in line and "VLLM_NEURON_HOST_MODE" in line
    for provided in ("torch.compile backend 'vllm_neuron'", "vllm-neuron CLI",
                     "vllm_neuron.plugin.hooks"):
        assert provided in line
    # The entry point vLLM calls takes no argument: it looks in DEVICE_DIR.
    monkeypatch.setattr(plugin_mod, "DEVICE_DIR", str(dev))
    assert plugin_mod.neuron_devices_present()
    assert plugin_mod.platform_plugin() is None


def test_host_mode_still_gets_the_host_platform_on_a_neuron_host(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(plugin_mod, "DEVICE_DIR", str(fake_neuron_host(tmp_path)))
    monkeypatch.setattr(plugin_mod, "_stepped_aside", False)
    monkeypatch.setenv("VLLM_NEURON_HOST_MODE", "1")
    with caplog.at_level(logging.INFO, logger="vllm_neuron"):
        assert plugin_mod.platform_plugin() == plugin_mod.HOST_PLATFORM
    assert stepping_aside_lines(caplog) == []


def test_platform_plugin_without_devices_is_silent_and_only_ever_the_host_platform(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(plugin_mod, "DEVICE_DIR", str(tmp_path))
    monkeypatch.setattr(plugin_mod, "_stepped_aside", False)
    with caplog.at_level(logging.INFO, logger="vllm_neuron"):
        assert plugin_mod.platform_plugin() is None
    assert stepping_aside_lines(caplog) == []
    monkeypatch.setenv("VLLM_NEURON_HOST_MODE", "1")
    assert plugin_mod.platform_plugin() == plugin_mod.HOST_PLATFORM
    # vLLM swallows exceptions of platform detection: a malformed value is no platform
    # here, and the general plugin raises it with the variable's name.
    monkeypatch.setenv("VLLM_NEURON_HOST_MODE", "maybe")
    assert plugin_mod.platform_plugin() is None
    # Nothing else can be selected: the only platform class this package defines.
    source = (Path(plugin_mod.__file__).parent / "platform.py").read_text()
    assert "class NeuronPlatform" not in source
    assert not hasattr(plugin_mod, "NEURON_PLATFORM")


def test_neuron_devices_are_detected_by_their_device_nodes(tmp_path: Path) -> None:
    assert not plugin_mod.neuron_devices_present(str(tmp_path))
    (tmp_path / "neuron_monitor").touch()
    assert not plugin_mod.neuron_devices_present(str(tmp_path))
    (tmp_path / "neuron0").touch()
    assert plugin_mod.neuron_devices_present(str(tmp_path))


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (SNAP + "FORMAT", "parquet"),
        (SNAP + "CAPTURE_AT_CALL", "first"),
        (SNAP + "MAX_CAPTURES", "0"),
        ("NEURON_LIBTORCH_COMPILATION_TIMEOUT", "soon"),
        ("VLLM_NEURON_HOST_MODE", "ture"),
        ("VLLM_NEURON_RUN_ID", "../elsewhere"),
    ],
)
def test_general_plugin_stops_on_a_malformed_setting_naming_it(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setattr(plugin_mod, "_registered", False)
    monkeypatch.setenv(SNAP + "ENABLE", "1")
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"vllm_neuron: invalid configuration: {name}="):
        plugin_mod.register()


@pytest.mark.parametrize(
    "name", ["VLLM_CACHE_ROOT", "NEURON_LIBTORCH_REMOTE_CACHE", "VLLM_NEURON_MANIFEST_DIR",
             SNAP + "DIR"],
)
def test_general_plugin_stops_on_a_path_setting_that_is_a_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(plugin_mod, "_registered", False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    monkeypatch.setenv(SNAP + "ENABLE", "1")
    monkeypatch.setenv(name, str(blocker))
    with pytest.raises(ConfigError, match=f"invalid configuration: {name}='{blocker}'"):
        plugin_mod.register()


def test_general_plugin_fixes_the_run_id_for_the_engine_processes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import os

    monkeypatch.setattr(plugin_mod, "_registered", False)
    monkeypatch.setenv("VLLM_NEURON_RUN_ID", "restored after the test")
    monkeypatch.delenv("VLLM_NEURON_RUN_ID")
    plugin_mod.register()  # manifest off: no run id is made
    assert "VLLM_NEURON_RUN_ID" not in os.environ
    monkeypatch.setattr(plugin_mod, "_registered", False)
    monkeypatch.setenv("VLLM_NEURON_MANIFEST_DIR", str(tmp_path))
    envs.reset_for_tests()
    plugin_mod.register()  # vLLM's first process: created, for the processes it starts
    created = os.environ["VLLM_NEURON_RUN_ID"]
    monkeypatch.setattr(plugin_mod, "_registered", False)
    plugin_mod.register()  # a process it started: the inherited id is kept
    assert os.environ["VLLM_NEURON_RUN_ID"] == created


def test_general_plugin_turns_off_vllm_aot_cache_in_host_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(plugin_mod, "_registered", False)
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "unset below; restored after the test")
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE")
    monkeypatch.setenv("VLLM_NEURON_HOST_MODE", "1")
    plugin_mod.register()
    import os

    assert os.environ["VLLM_USE_AOT_COMPILE"] == "0"
    import torch._dynamo

    assert "vllm_neuron" in torch._dynamo.list_backends()


# The forward context ---------------------------------------------------------------------


def new_req(req_id: str, prompt_len: int, computed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(req_id=req_id, prompt_token_ids=list(range(prompt_len)),
                           num_computed_tokens=computed)


def output(new: list[SimpleNamespace], cached: list[tuple[str, int]],
           scheduled: dict[str, int], finished: tuple[str, ...] = ()) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached], num_computed_tokens=[c for _, c in cached]
        ),
        num_scheduled_tokens=scheduled,
        finished_req_ids=set(finished),
    )


def test_publisher_rows_positions_and_phases_follow_the_scheduler() -> None:
    pub = ForwardPublisher()
    first = pub.context_for(output([new_req("a-1", 5)], [], {"a-1": 5}))
    assert first is not None
    assert (first.step, first.req_ids, first.positions, first.is_decode) == (
        0, ("a-1",), (0,), (False,)
    )
    assert first.is_prompt
    # a decodes (5 computed = its prompt) while b is prefilled in chunks.
    mixed = pub.context_for(output([new_req("b-2", 10)], [("a-1", 5)], {"b-2": 4, "a-1": 1}))
    assert mixed is not None
    assert mixed.req_ids == ("b-2", "a-1") and mixed.positions == (0, 5)
    assert mixed.is_decode == (False, True) and mixed.is_prompt
    chunk = pub.context_for(output([], [("b-2", 4), ("a-1", 6)], {"b-2": 6, "a-1": 1}))
    assert chunk is not None and chunk.is_decode == (False, True) and chunk.step == 2
    assert pub.context_for(output([], [], {})) is None  # nothing scheduled: nothing published
    pub.context_for(output([], [("b-2", 10)], {"b-2": 1}, finished=("a-1",)))
    assert "a-1" not in pub.prompt_lens


def test_publisher_asks_the_runner_for_requests_it_never_saw() -> None:
    pub = ForwardPublisher(prompt_len_of=lambda rid: 3 if rid == "old" else None)
    ctx = pub.context_for(output([], [("old", 2), ("gone", 7)], {"old": 1, "gone": 1}))
    assert ctx is not None and ctx.is_decode == (False, True)


def test_request_rule_verdict_is_evaluated_by_the_publisher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SNAP + "ENABLE", "1")
    monkeypatch.setenv(SNAP + "CAPTURE_REQUEST", "chatcmpl-wanted")
    reset_snapshot_config()
    pub = ForwardPublisher()
    ctx = pub.context_for(output([new_req("chatcmpl-wanted-0123abcd", 4),
                                  new_req("chatcmpl-other-0123abcd", 4)], [],
                                 {"chatcmpl-wanted-0123abcd": 4, "chatcmpl-other-0123abcd": 4}))
    assert ctx is not None and ctx.verdict is not None
    assert ctx.verdict.selected_by == ("request",)
    assert [m.req_id for m in ctx.verdict.matches] == ["chatcmpl-wanted-0123abcd"]


class FakeRunner:
    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.requests: dict[str, Any] = {}

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> str:
        self.seen.append(snap_context.get_current_forward())
        if scheduler_output == "boom":
            raise RuntimeError("forward failed")
        return "out"


def test_runner_is_untouched_when_capture_is_off() -> None:
    runner = FakeRunner()
    original = runner.execute_model
    assert install_forward_publisher(runner, SimpleNamespace()) is None
    assert runner.execute_model == original


def test_runner_publishes_around_execute_model_and_always_clears(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SNAP + "ENABLE", "1")
    reset_snapshot_config()
    runner = FakeRunner()
    spec = SimpleNamespace(num_speculative_tokens=2)
    pub = install_forward_publisher(runner, SimpleNamespace(speculative_config=spec))
    assert pub is not None and pub.num_speculative_tokens == 2
    assert runner.execute_model(output([new_req("r", 3)], [], {"r": 3})) == "out"
    assert runner.seen[-1] is not None and runner.seen[-1].req_ids == ("r",)
    assert snap_context.get_current_forward() is None
    runner.execute_model(output([], [], {}))  # an empty step publishes nothing
    assert runner.seen[-1] is None
    monkeypatch.setattr(pub, "context_for", lambda so: snap_context.SnapshotForwardContext(9))
    with pytest.raises(RuntimeError, match="forward failed"):
        runner.execute_model("boom")
    assert runner.seen[-1].step == 9 and snap_context.get_current_forward() is None


def test_manifest_emit_is_skipped_off_rank_zero_and_when_off(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert not hooks.emit_manifest_after_warm_up(SimpleNamespace(), local_rank=0)
    monkeypatch.setenv("VLLM_NEURON_MANIFEST_DIR", str(tmp_path))
    envs.reset_for_tests()
    assert not hooks.emit_manifest_after_warm_up(SimpleNamespace(), local_rank=1)
    assert not list(tmp_path.iterdir())
