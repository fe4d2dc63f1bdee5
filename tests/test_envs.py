"""vllm_neuron.envs: parsing, validation, the cached accessor and the cache directory."""

from __future__ import annotations

import os
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_neuron import envs
from vllm_neuron.envs import (
    CompileCacheSettings,
    ConfigError,
    filesystem_type,
    get_neuron_compile_cache_dir,
    load_compile_cache_settings,
)

HOME_ENV = {"HOME": "/home/alice", "USER": "alice"}

TRUE_WORDS = ["1", "true", "yes", "on"]
FALSE_WORDS = ["0", "false", "no", "off"]
BOOL_VARS = ["NEURON_LIBTORCH_DISABLE_COMPILE_CACHE", "VLLM_NEURON_DISABLE_WARMUP_COMPILE"]


def _attr(var: str) -> str:
    return {
        "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE": "disable_compile_cache",
        "VLLM_NEURON_DISABLE_WARMUP_COMPILE": "disable_warmup_compile",
    }[var]


def test_defaults_follow_the_seed() -> None:
    s = load_compile_cache_settings(HOME_ENV)
    assert s == CompileCacheSettings(
        cache_root="/home/alice/.cache/vllm",
        cache_root_explicit=False,
        remote_cache=None,
        disable_compile_cache=False,
        compilation_timeout=600.0,
        disable_warmup_compile=False,
        toolchain="auto",
    )


def test_xdg_cache_home_moves_the_default_root_like_vllm() -> None:
    s = load_compile_cache_settings({**HOME_ENV, "XDG_CACHE_HOME": "/scratch/cache"})
    assert s.cache_root == "/scratch/cache/vllm"
    assert not s.cache_root_explicit


def test_explicit_cache_root_is_expanded_and_absolute(monkeypatch: pytest.MonkeyPatch) -> None:
    s = load_compile_cache_settings({**HOME_ENV, "VLLM_CACHE_ROOT": "~/models/cache"})
    assert s.cache_root == "/home/alice/models/cache"
    assert s.cache_root_explicit
    monkeypatch.chdir("/tmp")
    rel = load_compile_cache_settings({**HOME_ENV, "VLLM_CACHE_ROOT": "rel/dir"})
    assert rel.cache_root == "/tmp/rel/dir"


@pytest.mark.parametrize("value", ["", "   "])
def test_blank_values_count_as_unset(value: str) -> None:
    env = {
        **HOME_ENV,
        "VLLM_CACHE_ROOT": value,
        "NEURON_LIBTORCH_REMOTE_CACHE": value,
        "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE": value,
        "NEURON_LIBTORCH_COMPILATION_TIMEOUT": value,
        "VLLM_NEURON_DISABLE_WARMUP_COMPILE": value,
        "VLLM_NEURON_TOOLCHAIN": value,
    }
    assert load_compile_cache_settings(env) == load_compile_cache_settings(HOME_ENV)


@pytest.mark.parametrize("url", ["/mnt/fsx/neuron-cache", "s3://bucket/prefix", "memory://x"])
def test_remote_cache_is_kept_as_given(url: str) -> None:
    s = load_compile_cache_settings({**HOME_ENV, "NEURON_LIBTORCH_REMOTE_CACHE": f" {url} "})
    assert s.remote_cache == url


@st.composite
def _case_variants(draw: st.DrawFn, words: list[str]) -> str:
    word = draw(st.sampled_from(words))
    flips = draw(st.lists(st.booleans(), min_size=len(word), max_size=len(word)))
    cased = "".join(c.upper() if f else c for c, f in zip(word, flips, strict=True))
    pad = draw(st.sampled_from(["", " ", "\t", "  "]))
    return pad + cased + pad


@given(var=st.sampled_from(BOOL_VARS), raw=_case_variants(TRUE_WORDS + FALSE_WORDS))
def test_bool_words_parse_in_any_case(var: str, raw: str) -> None:
    s = load_compile_cache_settings({**HOME_ENV, var: raw})
    assert getattr(s, _attr(var)) is (raw.strip().lower() in TRUE_WORDS)


@given(var=st.sampled_from(BOOL_VARS), raw=st.text(min_size=1, max_size=8))
def test_anything_else_is_not_a_bool(var: str, raw: str) -> None:
    if raw.strip() == "" or raw.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        return
    with pytest.raises(ConfigError) as info:
        load_compile_cache_settings({**HOME_ENV, var: raw})
    assert var in str(info.value)
    assert repr(raw) in str(info.value)


@pytest.mark.parametrize("raw,expected", [("600", 600.0), ("1.5", 1.5), (" 1e3 ", 1000.0)])
def test_timeout_accepts_positive_numbers(raw: str, expected: float) -> None:
    env = {**HOME_ENV, "NEURON_LIBTORCH_COMPILATION_TIMEOUT": raw}
    assert load_compile_cache_settings(env).compilation_timeout == expected


@pytest.mark.parametrize("raw", ["0", "-1", "abc", "nan", "inf", "10s"])
def test_timeout_rejects_bad_values_naming_them(raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_compile_cache_settings({**HOME_ENV, "NEURON_LIBTORCH_COMPILATION_TIMEOUT": raw})
    assert "NEURON_LIBTORCH_COMPILATION_TIMEOUT" in str(info.value)
    assert repr(raw) in str(info.value)


def test_toolchain_choice_is_case_insensitive_and_validated() -> None:
    assert load_compile_cache_settings({"VLLM_NEURON_TOOLCHAIN": "HOST"}).toolchain == "host"
    assert load_compile_cache_settings({"VLLM_NEURON_TOOLCHAIN": "neuron"}).toolchain == "neuron"
    with pytest.raises(ConfigError, match=r"VLLM_NEURON_TOOLCHAIN='gpu'"):
        load_compile_cache_settings({"VLLM_NEURON_TOOLCHAIN": "gpu"})


def test_precompiled_only_mode_conflicts_with_disabled_cache() -> None:
    env = {
        **HOME_ENV,
        "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE": "1",
        "VLLM_NEURON_DISABLE_WARMUP_COMPILE": "yes",
    }
    with pytest.raises(ConfigError) as info:
        load_compile_cache_settings(env)
    message = str(info.value)
    assert "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE='1'" in message
    assert "VLLM_NEURON_DISABLE_WARMUP_COMPILE='yes'" in message
    # Each alone is fine.
    for var in BOOL_VARS:
        assert getattr(load_compile_cache_settings({**HOME_ENV, var: "1"}), _attr(var))


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_cached_accessor_parses_once_until_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEURON_LIBTORCH_COMPILATION_TIMEOUT", "30")
    envs.reset_for_tests()
    try:
        first = envs.compile_cache_settings()
        assert first.compilation_timeout == 30.0
        monkeypatch.setenv("NEURON_LIBTORCH_COMPILATION_TIMEOUT", "45")
        assert envs.compile_cache_settings() is first  # parsed once per process
        envs.reset_for_tests()
        assert envs.compile_cache_settings().compilation_timeout == 45.0
    finally:
        monkeypatch.undo()
        envs.reset_for_tests()


def test_every_variable_is_documented_once() -> None:
    names = [v.name for v in envs.ENVIRONMENT_VARIABLES]
    assert len(names) == len(set(names))
    assert set(names) >= {
        "VLLM_CACHE_ROOT",
        "NEURON_LIBTORCH_REMOTE_CACHE",
        "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE",
        "NEURON_LIBTORCH_COMPILATION_TIMEOUT",
        "VLLM_NEURON_DISABLE_WARMUP_COMPILE",
        "VLLM_NEURON_TOOLCHAIN",
        "VLLM_NEURON_RUN_ID",
    }


@pytest.mark.parametrize("value", ["4242-0a1b2c3d4e5f", "job.17_rank-set", "a" * 64])
def test_run_id_is_one_safe_path_component(value: str) -> None:
    assert envs.load_run_id({"VLLM_NEURON_RUN_ID": f" {value} "}) == value
    assert envs.load_run_id({"VLLM_NEURON_RUN_ID": "  "}) is None


@pytest.mark.parametrize("value", ["../x", "a/b", ".hidden", "a" * 65, "run id"])
def test_run_id_that_is_not_one_path_component_is_refused_naming_it(value: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"VLLM_NEURON_RUN_ID={value!r}")):
        envs.load_run_id({"VLLM_NEURON_RUN_ID": value})


def test_path_settings_with_a_regular_file_in_the_way_are_refused_when_parsed(
    tmp_path: os.PathLike[str],
) -> None:
    blocker = os.path.join(str(tmp_path), "file")
    with open(blocker, "w") as f:
        f.write("x")
    for name, value in [("VLLM_CACHE_ROOT", blocker),
                        ("NEURON_LIBTORCH_REMOTE_CACHE", blocker + "/remote"),
                        ("NEURON_LIBTORCH_REMOTE_CACHE", "file://" + blocker)]:
        with pytest.raises(ConfigError, match=re.escape(f"{name}={value!r}")):
            load_compile_cache_settings({**HOME_ENV, name: value})
    with pytest.raises(ConfigError, match=re.escape(f"VLLM_NEURON_MANIFEST_DIR={blocker!r}")):
        envs.load_manifest_settings({"VLLM_NEURON_MANIFEST_DIR": blocker})
    # Store URLs have no local directory to look at.
    remote = load_compile_cache_settings({**HOME_ENV, "NEURON_LIBTORCH_REMOTE_CACHE": "s3://b/p"})
    assert remote.remote_cache == "s3://b/p"


# /proc/mounts ------------------------------------------------------------------------------

MOUNTS = """\
overlay / overlay rw,relatime 0 0
proc /proc proc rw 0 0
server:/export/home /home nfs4 rw,vers=4.1 0 0
/dev/sdb1 /home/alice/local\\040disk ext4 rw 0 0
/dev/sdc1 /homework xfs rw 0 0
tmpfs /scratch tmpfs rw 0 0
fsx@tcp:/fsx /scratch lustre rw,flock 0 0
"""


@pytest.mark.parametrize(
    "path,fstype",
    [
        ("/home/alice", "nfs4"),
        ("/home", "nfs4"),
        ("/home/", "nfs4"),
        ("/homework/x", "xfs"),  # a mount point prefix must end at a path separator
        ("/home/alice/local disk/cache", "ext4"),  # \040 decoded, longest prefix wins
        ("/home/alice/local diskette", "nfs4"),
        ("/scratch/job", "lustre"),  # over-mounted: the later line wins
        ("/usr/lib", "overlay"),
    ],
)
def test_filesystem_type_longest_mount_prefix(path: str, fstype: str) -> None:
    assert filesystem_type(path, MOUNTS) == fstype


def test_filesystem_type_unknown_is_empty() -> None:
    assert filesystem_type("/anything", "") == ""
    assert filesystem_type("/anything", "garbage line\n") == ""


def test_filesystem_type_reads_proc_mounts() -> None:
    # Linux only, like the project (vLLM on Neuron runs on Linux): /proc/mounts must exist.
    with open("/proc/mounts") as f:
        text = f.read()
    assert filesystem_type("/") == filesystem_type("/", text) != ""


# Cache directory ---------------------------------------------------------------------------


def test_cache_dir_default_on_local_home() -> None:
    local = "/dev/sda1 / ext4 rw 0 0\n"
    d = get_neuron_compile_cache_dir(environ=HOME_ENV, mounts_text=local)
    assert d == "/home/alice/.cache/vllm/neuron/compile_cache"


def test_cache_dir_falls_back_to_tmp_when_home_is_on_nfs() -> None:
    d = get_neuron_compile_cache_dir(environ=HOME_ENV, mounts_text=MOUNTS)
    assert d == "/tmp/vllm_neuron_wdir_alice/neuron/compile_cache"
    nfs3 = "/dev/sda1 / ext4 rw 0 0\nsrv:/h /home/alice nfs rw 0 0\n"
    assert get_neuron_compile_cache_dir(environ=HOME_ENV, mounts_text=nfs3).startswith(
        "/tmp/vllm_neuron_wdir_alice/"
    )


def test_cache_dir_fallback_user_name_is_one_safe_path_component() -> None:
    env = {"HOME": "/home/alice", "USER": "dom\\ali/ce"}
    d = get_neuron_compile_cache_dir(environ=env, mounts_text=MOUNTS)
    assert d == "/tmp/vllm_neuron_wdir_dom_ali_ce/neuron/compile_cache"


def test_explicit_cache_root_is_never_moved_even_on_nfs() -> None:
    env = {**HOME_ENV, "VLLM_CACHE_ROOT": "/home/alice/shared"}
    d = get_neuron_compile_cache_dir(environ=env, mounts_text=MOUNTS)
    assert d == "/home/alice/shared/neuron/compile_cache"


def test_cache_dir_uses_the_process_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    envs.reset_for_tests()
    try:
        assert get_neuron_compile_cache_dir() == os.path.join(
            str(tmp_path), "neuron", "compile_cache"
        )
    finally:
        monkeypatch.undo()
        envs.reset_for_tests()
