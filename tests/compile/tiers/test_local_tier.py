"""The local tier's directory: the NFS-home fallback of the compile feature, decided from the
parsed settings and the mount table (vllm_neuron/compile/tiers/location.py)."""

from __future__ import annotations

import os
import re

import pytest

from vllm_neuron import envs
from vllm_neuron.backends.mounts import filesystem_type
from vllm_neuron.compile.tiers import location as local_tier
from vllm_neuron.compile.tiers.location import get_neuron_compile_cache_dir, local_tier_moves
from vllm_neuron.envs import CompileCacheSettings, ConfigError

HOME_ENV = {"HOME": "/home/alice", "USER": "alice"}


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


def test_only_a_default_root_on_nfs_moves() -> None:
    default = envs.load_compile_cache_settings(HOME_ENV)
    explicit = envs.load_compile_cache_settings({**HOME_ENV, "VLLM_CACHE_ROOT": "/home/alice/c"})
    assert local_tier_moves(default, MOUNTS)
    assert not local_tier_moves(explicit, MOUNTS)
    assert not local_tier_moves(default, "/dev/sda1 / ext4 rw 0 0\n")


def test_a_file_in_the_way_of_the_moved_tier_names_the_fallback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    # The error must say why the tier is not under the cache root at all.
    monkeypatch.setattr(local_tier, "NFS_FALLBACK_BASE", str(tmp_path))
    with open(os.path.join(str(tmp_path), "vllm_neuron_wdir_alice"), "w") as f:
        f.write("a regular file where the moved tier must go")
    expected = f"VLLM_CACHE_ROOT (unset; its default /home/alice/.cache/vllm is on NFS, so " \
               f"the local tier is under {tmp_path})"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        get_neuron_compile_cache_dir(environ=HOME_ENV, mounts_text=MOUNTS)


def test_settings_built_by_hand_still_name_their_root(tmp_path: os.PathLike[str]) -> None:
    blocker = os.path.join(str(tmp_path), "file")
    with open(blocker, "w") as f:
        f.write("x")
    settings = CompileCacheSettings(cache_root=blocker, cache_root_explicit=True)
    with pytest.raises(ConfigError, match=re.escape(f"VLLM_CACHE_ROOT (resolved to {blocker})")):
        get_neuron_compile_cache_dir(settings, mounts_text="")
