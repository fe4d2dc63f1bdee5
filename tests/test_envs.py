"""vllm_neuron.envs: parsing, validation and the cached accessors.

Where the local tier goes (the NFS fallback) is the compile feature's decision:
tests/compile/test_local_tier.py.
"""

from __future__ import annotations

import os
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_neuron import envs
from vllm_neuron.envs import CompileCacheSettings, ConfigError, load_compile_cache_settings
from vllm_neuron.envs.compile_cache import default_compile_workers

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
        defer_compiles=True,
        compile_workers=default_compile_workers(),
    )


def test_compile_workers_default_to_the_nodes_cpus_and_memory_and_take_a_whole_number(
) -> None:
    cpus = os.cpu_count() or 1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert default_compile_workers() == max(1, min(cpus, memory // (4 << 30)))
    s = load_compile_cache_settings({**HOME_ENV, "VLLM_NEURON_COMPILE_WORKERS": " 3 "})
    assert s.compile_workers == 3
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ConfigError) as info:
            load_compile_cache_settings({**HOME_ENV, "VLLM_NEURON_COMPILE_WORKERS": bad})
        assert f"VLLM_NEURON_COMPILE_WORKERS={bad!r}" in str(info.value)


def test_defer_compiles_is_a_strict_boolean() -> None:
    assert not load_compile_cache_settings(
        {**HOME_ENV, "VLLM_NEURON_DEFER_COMPILES": "0"}).defer_compiles
    with pytest.raises(ConfigError) as info:
        load_compile_cache_settings({**HOME_ENV, "VLLM_NEURON_DEFER_COMPILES": "sometimes"})
    assert "VLLM_NEURON_DEFER_COMPILES='sometimes'" in str(info.value)


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


# One reset for every group ----------------------------------------------------------------

SNAPSHOT_MAX = "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_MAX_CAPTURES"


def test_reset_for_tests_makes_a_changed_snapshot_variable_take_effect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_neuron.snapshot.config import snapshot_config

    monkeypatch.setenv("VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_ENABLE", "1")
    monkeypatch.setenv(SNAPSHOT_MAX, "2")
    envs.reset_for_tests()
    try:
        first = snapshot_config()
        assert envs.snapshot_settings().max_captures == first.max_captures == 2
        monkeypatch.setenv(SNAPSHOT_MAX, "7")
        assert snapshot_config() is first  # parsed once per process
        envs.reset_for_tests()  # the same reset as every other group: no second one needed
        assert envs.snapshot_settings().max_captures == snapshot_config().max_captures == 7
    finally:
        monkeypatch.undo()
        envs.reset_for_tests()


def test_reset_for_tests_forgets_every_cached_group() -> None:
    accessors = (envs.compile_cache_settings, envs.manifest_settings, envs.host_mode_settings,
                 envs.snapshot_settings)  # fmt: skip
    envs.reset_for_tests()
    try:
        before = [accessor() for accessor in accessors]
        envs.reset_for_tests()
        after = [accessor() for accessor in accessors]
        assert all(a is not b for a, b in zip(before, after, strict=True))
    finally:
        envs.reset_for_tests()


# Identity, host mode, the CLI's remote default ------------------------------------------------


def test_identity_is_read_as_set_and_never_refused() -> None:
    ident = envs.load_identity_settings(
        {"NEURON_VISIBLE_DEVICES": " 0-7 ", "RANK": "3", "VLLM_DP_RANK": "x", "USER": "bob"}
    )
    assert ident == envs.IdentitySettings(visible_devices="0-7", rank=3, dp_rank=None,
                                          user="bob")  # fmt: skip
    assert envs.load_identity_settings({"RANK": "-1", "NEURON_VISIBLE_DEVICES": " "}) == (
        envs.IdentitySettings()
    )


@pytest.mark.parametrize("value,requested", [(None, False), ("", False), (" 0 ", False),
                                             ("1", True), ("true", True)])  # fmt: skip
def test_host_mode_keeps_vllms_aot_variable_as_text(value: str | None, requested: bool) -> None:
    env = {"VLLM_NEURON_HOST_MODE": "1"}
    if value is not None:
        env["VLLM_USE_AOT_COMPILE"] = value
    assert envs.load_host_mode_settings(env).vllm_aot_compile_requested is requested


def test_remote_cache_default_of_the_cli_does_not_validate_the_group() -> None:
    env = {"NEURON_LIBTORCH_REMOTE_CACHE": " s3://b/p ", "NEURON_LIBTORCH_COMPILATION_TIMEOUT": "x"}
    assert envs.remote_cache_url(env) == "s3://b/p"
    assert envs.remote_cache_url({"NEURON_LIBTORCH_REMOTE_CACHE": " "}) is None
    with pytest.raises(ConfigError):
        load_compile_cache_settings(env)


def test_manifest_dir_is_a_normalised_location() -> None:
    assert envs.load_manifest_settings({**HOME_ENV, "VLLM_NEURON_MANIFEST_DIR": "~/m"}) == (
        envs.ManifestSettings("/home/alice/m")
    )
    assert envs.load_manifest_settings({"VLLM_NEURON_MANIFEST_DIR": "s3://b/m"}).manifest_dir == (
        "s3://b/m"
    )
    with pytest.raises(ConfigError, match="NUL"):
        envs.load_manifest_settings({"VLLM_NEURON_MANIFEST_DIR": "a\x00b"})
