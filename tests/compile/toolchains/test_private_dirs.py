"""Another user of the node cannot put code into what this node compiles through a directory
it compiles in (toolchains/private_dirs.py): Inductor's cache directory with its precompiled
headers, and the compile jobs' temporary directory, are used only when private; one that is
not is replaced by a private directory of this user's own, said once in a warning.

The other user is real: directories are given to uid 65534 (``nobody``) with ``os.chown``
(the tests run as root); a Kubernetes ``emptyDir`` is a world-writable directory without the
sticky bit. Inductor's directories are checked in a fresh process that compiles a real graph,
as a builder's does.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from cache_workers import SAFETY

from vllm_neuron.compile.toolchains import private_dirs
from vllm_neuron.compile.toolchains.private_dirs import make_private_dir, why_not_private
from vllm_neuron.compile.workers import job_dirs

OTHER_UID = 65534  # nobody

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="giving a directory to another "
                                "user (chown) needs root")  # fmt: skip


def _sticky_tmp(tmp_path: Path) -> Path:
    """A stand-in for ``/tmp``: world-writable and sticky."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    return tmp


def test_what_counts_as_private(tmp_path: Path) -> None:
    tmp = _sticky_tmp(tmp_path)
    assert make_private_dir(str(tmp / "ours")) is None  # made 0700 under a sticky parent
    assert (tmp / "ours").stat().st_mode & 0o777 == 0o700
    theirs = tmp / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    assert "belongs to uid 65534" in (why_not_private(str(theirs)) or "")
    loose = tmp / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    assert "writable by group or others" in (why_not_private(str(loose)) or "")
    (tmp / "link").symlink_to(tmp / "ours")
    assert why_not_private(str(tmp / "link")) == "it is a symbolic link"
    # An emptyDir: world-writable, not sticky. A directory we have just made 0700 in it is
    # refused all the same: anyone can rename it away and put theirs under its name.
    empty_dir = tmp_path / "emptydir"
    empty_dir.mkdir()
    empty_dir.chmod(0o777)
    why = make_private_dir(str(empty_dir / "ours"))
    assert why is not None and "not sticky" in why, why
    # Another user's directory above: it could replace everything below.
    above = tmp / "above"
    (above / "inner").mkdir(parents=True, mode=0o700)
    above.chmod(0o755)
    os.chown(above, OTHER_UID, OTHER_UID)
    assert "belongs to uid 65534, who can replace it" in (
        why_not_private(str(above / "inner")) or "")


_COMPILE = """
import json, logging, os, sys
log = sys.argv[1]
logging.basicConfig(filename=log, level=logging.INFO)
import torch
from torch._inductor import codecache
from vllm_neuron.compile.toolchains.host import HostToolchain

class Scaled(torch.nn.Module):
    def forward(self, x):
        return (x * 3.5 + 1,)

if sys.argv[2] == "check":  # only what a compile does first
    from vllm_neuron.compile.toolchains.node_files import secure_inductor_dirs
    secure_inductor_dirs()
else:
    gm = torch.fx.symbolic_trace(Scaled())
    HostToolchain().compile(gm, (torch.randn(4, 8),), sys.argv[2])
print(json.dumps({"cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                  "headers": codecache._HEADER_DIR}))
"""


@pytest.mark.parametrize("planted", ["another user's", "world-writable"])
def test_an_inductor_cache_another_user_could_change_is_not_compiled_in(
    tmp_path: Path, planted: str
) -> None:
    """``/tmp/torchinductor_<user>`` made first by another user (or left world-writable): a
    real compile never uses it: Inductor's cache and headers are in its own private group of
    node files (toolchains/node_files.py; here, with no local tier named, a throwaway removed
    at exit), and nothing of it is left in the temporary directory."""
    tmp = _sticky_tmp(tmp_path)
    user = subprocess.run(["id", "-un"], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    found = tmp / f"torchinductor_{user}"
    found.mkdir()
    found.chmod(0o777)
    if planted == "another user's":
        os.chown(found, OTHER_UID, OTHER_UID)
    log = tmp_path / "log.txt"
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_CACHE_DIR", "_VLLM_NEURON_NODE_FILES",
                        "_VLLM_NEURON_SHARED_NODE_FILES")}  # fmt: skip
    env.update(TMPDIR=str(tmp), XDG_CACHE_HOME=str(tmp_path / "home-cache"))
    compiles = planted == "another user's"
    out = str(tmp_path / "out") if compiles else "check"
    done = subprocess.run([sys.executable, "-c", _COMPILE, str(log), out],
                          env=env, capture_output=True, text=True, timeout=SAFETY,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    where = json.loads(done.stdout.strip().splitlines()[-1])
    group = Path(where["headers"]).parent
    assert where == {"cache": str(group / "inductor"), "headers": str(group / "headers")}
    assert not str(group).startswith(str(found))
    assert list(found.iterdir()) == []  # nothing read from or written into it
    if compiles:
        assert (tmp_path / "out" / "graph.pt2").is_file()
    assert {p.name for p in tmp.iterdir()} == {found.name}  # nothing of ours left
    warnings = [line for line in log.read_text().splitlines() if line.startswith("WARNING")]
    assert warnings == [], warnings


def test_a_temporary_directory_anyone_can_replace_in_takes_no_compile_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An emptyDir ``/tmp`` (world-writable, not sticky): compile jobs are made in this
    user's own private directory instead, said once; and swept there."""
    empty_dir = tmp_path / "emptydir"
    empty_dir.mkdir()
    empty_dir.chmod(0o777)
    monkeypatch.setattr(tempfile, "tempdir", str(empty_dir))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    monkeypatch.setattr(private_dirs, "_WARNED", set())
    caplog.set_level(logging.WARNING, logger="vllm_neuron.compile")
    made = []
    for _ in range(2):
        job_dir, owner = job_dirs.owned_job_dir(keep_free=False)
        owner.close()
        made.append(Path(job_dir))
    private = tmp_path / "home-cache" / "vllm" / "neuron" / "private" / f"tmp-{os.getuid()}"
    assert all(p.parent == private for p in made), made
    assert all(p.stat().st_mode & 0o777 == 0o700 for p in made)
    assert list(empty_dir.iterdir()) == []
    warned = [r.getMessage() for r in caplog.records if str(empty_dir) in r.getMessage()]
    assert len(warned) == 1 and "not sticky" in warned[0], warned
    monkeypatch.setattr(job_dirs, "_swept", False)
    job_dirs.sweep_dead_jobs()  # their owners' locks went with the files' closing
    assert not any(p.exists() for p in made)
