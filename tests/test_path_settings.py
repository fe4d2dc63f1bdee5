"""Path-valued settings reached through a plain ``torch.compile`` (no vLLM): a regular file
where a directory must go ends the compile with an error naming the variable and its value,
never with a bare ``NotADirectoryError`` about a path derived from it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from vllm_neuron import envs
from vllm_neuron.assembly import reset_runtime
from vllm_neuron.envs import ConfigError, require_directory
from vllm_neuron.snapshot.context import reset_snapshot_config

SNAPSHOT_DIR = "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_DIR"
_OURS = ("VLLM_CACHE_ROOT", "XDG_CACHE_HOME", "NEURON_LIBTORCH_REMOTE_CACHE",
         "VLLM_NEURON_MANIFEST_DIR", "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_ENABLE", SNAPSHOT_DIR,
         "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE", "VLLM_NEURON_DISABLE_WARMUP_COMPILE")


def _reset() -> None:
    envs.reset_for_tests()
    reset_snapshot_config()
    reset_runtime()
    torch._dynamo.reset()


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Callable[..., None]]:
    """Set this test's variables (every other one of ours unset) and re-read them."""
    for name in _OURS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_NEURON_TOOLCHAIN", "host")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("VLLM_NEURON_RUN_ID", "path-settings-test")

    def apply(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        _reset()

    yield apply
    monkeypatch.undo()
    _reset()


def compile_and_run() -> None:
    model = torch.nn.Linear(4, 3)
    torch.compile(model, backend="vllm_neuron")(torch.ones(2, 4))


def a_file(tmp_path: Path, name: str = "a-file") -> Path:
    path = tmp_path / name
    path.write_text("a regular file where a directory must go")
    return path


def expect_config_error(name: str, value: str, *, names: str | None = None) -> str:
    """Run the compile; its error must quote ``name=value`` (and ``names`` when given)."""
    with pytest.raises(Exception) as info:
        compile_and_run()
    inner = getattr(info.value, "inner_exception", info.value)
    assert isinstance(inner, ConfigError), repr(info.value)
    message = str(inner)
    assert f"{name}={value!r}" in message
    assert "not a directory" in message
    if names is not None:
        assert names in message
    return message


@pytest.mark.parametrize(
    "name", ["VLLM_CACHE_ROOT", "NEURON_LIBTORCH_REMOTE_CACHE", "VLLM_NEURON_MANIFEST_DIR",
             SNAPSHOT_DIR],
)
def test_a_path_setting_that_is_a_regular_file_is_named_with_its_value(
    environ: Callable[..., None], tmp_path: Path, name: str
) -> None:
    blocker = str(a_file(tmp_path))
    environ(**{"VLLM_CACHE_ROOT": str(tmp_path / "cache"),
               "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_ENABLE": "1", name: blocker})
    expect_config_error(name, blocker)
    if name != "VLLM_CACHE_ROOT":  # refused before anything was created
        assert not (tmp_path / "cache").exists()


def test_a_regular_file_above_the_path_is_named_too(
    environ: Callable[..., None], tmp_path: Path
) -> None:
    below = str(a_file(tmp_path) / "vllm")
    environ(VLLM_CACHE_ROOT=below)
    expect_config_error("VLLM_CACHE_ROOT", below, names=f"{tmp_path / 'a-file'} is a regular file")


def test_a_file_in_the_way_of_the_derived_cache_dir_names_the_cache_root(
    environ: Callable[..., None], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    a_file(root, "neuron")  # the root is fine; $VLLM_CACHE_ROOT/neuron is not
    environ(VLLM_CACHE_ROOT=str(root))
    expect_config_error("VLLM_CACHE_ROOT", str(root), names=f"{root / 'neuron'} is a regular file")


def test_the_default_cache_root_names_where_it_came_from(
    environ: Callable[..., None], tmp_path: Path
) -> None:
    xdg = str(a_file(tmp_path))
    environ(XDG_CACHE_HOME=xdg)
    expect_config_error("XDG_CACHE_HOME", xdg, names="VLLM_CACHE_ROOT (unset")


def test_a_file_url_of_the_remote_tier_is_checked_like_a_path(
    environ: Callable[..., None], tmp_path: Path
) -> None:
    url = f"file://{a_file(tmp_path)}"
    environ(VLLM_CACHE_ROOT=str(tmp_path / "cache"), NEURON_LIBTORCH_REMOTE_CACHE=url)
    expect_config_error("NEURON_LIBTORCH_REMOTE_CACHE", url)


def test_the_default_snapshot_root_names_both_settings(
    environ: Callable[..., None], tmp_path: Path
) -> None:
    root = tmp_path / "root"
    (root / "neuron").mkdir(parents=True)
    a_file(root / "neuron", "snapshots")
    environ(VLLM_CACHE_ROOT=str(root), VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_ENABLE="1")
    expect_config_error("VLLM_CACHE_ROOT", str(root), names=f"{SNAPSHOT_DIR} (unset")


def test_directories_that_exist_or_not_yet_compile_and_store_urls_are_not_probed(
    environ: Callable[..., None], tmp_path: Path
) -> None:
    environ(VLLM_CACHE_ROOT=str(tmp_path / "not" / "yet"),
            NEURON_LIBTORCH_REMOTE_CACHE=str(tmp_path),
            VLLM_NEURON_MANIFEST_DIR="memory://manifests")
    compile_and_run()
    assert (tmp_path / "not" / "yet" / "neuron" / "compile_cache").is_dir()


def test_require_directory_walks_up_to_the_nearest_existing_ancestor(tmp_path: Path) -> None:
    assert require_directory(str(tmp_path / "a" / "b"), setting="X", purpose="p") == str(
        tmp_path / "a" / "b")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="X: .*dangling is a dangling symbolic link"):
        require_directory(str(tmp_path / "dangling" / "x"), setting="X", purpose="p")


def test_a_directory_another_process_makes_during_the_check_is_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Eight ranks start on a fresh VLLM_CACHE_ROOT: one of them creates it between this
    # process's "is it a directory?" (no) and "does something exist there?" (yes). Replayed
    # in that order here: the first look creates it, as the other rank did, and says no.
    root = str(tmp_path / "vllm-cache")
    real_isdir = os.path.isdir
    raced: list[str] = []

    def isdir_racing_another_rank(path: object) -> bool:
        if path == root and not raced:
            raced.append(root)
            os.mkdir(root)
            return False
        return real_isdir(path)  # type: ignore[arg-type]

    monkeypatch.setattr(os.path, "isdir", isdir_racing_another_rank)
    assert require_directory(root, setting="VLLM_CACHE_ROOT", purpose="caches") == root
    assert raced == [root]


def test_a_fresh_process_reports_the_variable_not_a_bare_os_error(tmp_path: Path) -> None:
    # The reported failure, end to end: nothing reset, nothing imported beforehand.
    blocker = str(a_file(tmp_path))
    env = {k: v for k, v in os.environ.items() if k not in _OURS}
    env.update(VLLM_CACHE_ROOT=blocker, VLLM_NEURON_TOOLCHAIN="host",
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    code = ("import torch\n"
            "torch.compile(torch.nn.Linear(4, 3), backend='vllm_neuron')(torch.ones(2, 4))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0
    assert re.search(rf"ConfigError: VLLM_CACHE_ROOT={re.escape(repr(blocker))}", proc.stderr), \
        proc.stderr[-3000:]
    assert "NotADirectoryError" not in proc.stderr
