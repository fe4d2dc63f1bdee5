"""Another user of the node, for real: a process running as uid 65534 (``nobody``; the tests
run as root) makes the directories a node compiles through before the node starts - the
temporary directory or what is in it, the cache root, Inductor's cache directory, compile
job directories - world-writable, with a FIFO and a symbolic link planted in each. A node,
a real process compiling a model through ``torch.compile(backend="vllm_neuron")``
(helpers/serve_worker.py), uses none of them: the cache is bypassed, Inductor's default
directory is not even looked in (its cache and headers are in the node's own group of node
files, node_files.py) and every other one is replaced by a private directory of its own,
each said in exactly one warning, and nothing blocks on a planted FIFO (the node's run is
bounded; no sleep). And the converse: a node running as uid 65534 facing directories root
made (docs/trust.md, issue 39).

Nothing is given away with ``chown``: each directory belongs to whoever made it.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_neuron.compile.toolchains.node_files import THROWAWAY_PREFIX

NOBODY = 65534
HELPERS = Path(__file__).resolve().parents[1] / "helpers"
ROOT = Path(__file__).resolve().parents[3]
BOUND = 300.0  # seconds for a node's whole run: a compile takes seconds, a FIFO for ever
RESULT = "SERVE_WORKER_RESULT "
JOB_PREFIX = "vllm_neuron_compile_job_"

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="running a process as another "
                                "user needs root (as CI runs)")  # fmt: skip

# What the other user runs: make each directory (world-writable, whatever its umask), then
# plant a FIFO and a link in it. Argument: {"dirs": [...]} as JSON.
_PLANT = r"""
import json, os, sys
for d in json.loads(sys.argv[1])["dirs"]:
    os.makedirs(d, exist_ok=True)
    os.chmod(d, 0o777)
    os.mkfifo(os.path.join(d, "fifo"))
    os.symlink("/dev/zero", os.path.join(d, "link"))
for d in json.loads(sys.argv[1])["jobs"]:  # a compile job's directory, a FIFO as its owner
    os.makedirs(d)
    os.chmod(d, 0o777)
    os.mkfifo(os.path.join(d, ".owner"))
"""


def _as(uid: int | None) -> dict[str, Any]:
    """subprocess arguments that run a process as `uid` (None: as this process)."""
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": [], "umask": 0}


def plant(uid: int | None, dirs: list[Path], jobs: list[Path]) -> None:
    """As `uid`, make `dirs` world-writable with a FIFO and a link in each, and `jobs` as
    job directories whose owner file is a FIFO."""
    done = subprocess.run(
        [sys.executable, "-c", _PLANT, json.dumps({"dirs": [str(d) for d in dirs],
                                                   "jobs": [str(j) for j in jobs]})],
        capture_output=True, text=True, timeout=60, **_as(uid),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    for d in dirs:
        assert d.lstat().st_uid == (os.getuid() if uid is None else uid)


def snapshot(dirs: list[Path]) -> dict[str, str]:
    """Every name under `dirs` and its kind, read without following links or opening."""
    out = {}
    for d in dirs:
        for path in [d, *d.rglob("*")]:
            mode = path.lstat().st_mode
            out[str(path)] = ("fifo" if stat.S_ISFIFO(mode) else "link" if stat.S_ISLNK(mode)
                              else "dir" if stat.S_ISDIR(mode) else "file")  # fmt: skip
    return out


def run_node(uid: int | None, user: str, tmp: Path, cache_root: Path, home: Path,
             script: str | None = None) -> dict[str, Any]:  # fmt: skip
    """A node compiling a model (serve_worker.py), or running `script`, as `uid`: its
    result, within `BOUND`."""
    strip = ("VLLM_CACHE_ROOT", "NEURON_LIBTORCH_REMOTE_CACHE", "TORCHINDUCTOR_CACHE_DIR",
             "VLLM_NEURON_DISABLE_WARMUP_COMPILE", "VLLM_NEURON_MANIFEST_DIR",
             "VLLM_NEURON_CACHE_SIGNING_KEY", "VLLM_NEURON_CACHE_TRUSTED_KEYS",
             "VLLM_NEURON_CACHE_TRUST", "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE",
             # A node started anew: no tier named its node files.
             "_VLLM_NEURON_NODE_FILES", "_VLLM_NEURON_SHARED_NODE_FILES")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in strip}
    env.update(VLLM_CACHE_ROOT=str(cache_root), TMPDIR=str(tmp), HOME=str(home),
               XDG_CACHE_HOME=str(home / ".cache"), USER=user, LOGNAME=user,
               PYTHONPATH=str(ROOT), VLLM_NEURON_COMPILE_WORKERS="1")  # fmt: skip
    argv = ["-c", script] if script else [str(HELPERS / "serve_worker.py")]
    done = subprocess.run([sys.executable, *argv], env=env,
                          cwd=str(home.parent), capture_output=True, text=True,
                          timeout=BOUND, **_as(uid))  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    result: dict[str, Any] = json.loads(lines[-1][len(RESULT):])
    result["stderr"] = done.stderr
    return result


def naming(warnings: list[str], directory: Path) -> list[str]:
    return [w for w in warnings if f"{directory}:" in w or f"{directory} " in w]


@pytest.fixture(scope="module")
def root_home() -> Iterator[Path]:
    """The root node's home, shared by this module's runs: where its private temporary
    root is made when the temporary directory is another user's."""
    path = Path(tempfile.mkdtemp(prefix="vllm-neuron-root-home-"))
    try:
        yield path / "home"
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory every user can reach (pytest's own is root's 0700), root's, 0755."""
    path = Path(tempfile.mkdtemp(prefix="vllm-neuron-other-user-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.timeout(2 * BOUND)
@pytest.mark.parametrize("temp", ["sticky /tmp", "their temporary directory"])
def test_what_another_user_made_world_writable_is_never_used_and_nothing_blocks(
    base: Path, root_home: Path, temp: str
) -> None:
    """``sticky /tmp``: root's sticky temporary directory, where the other user made
    ``torchinductor_root``, the cache root and a job directory first. ``their temporary
    directory``: TMPDIR is a directory the other user made (world-writable, not sticky),
    with the same inside."""
    tmp = base / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    theirs = []
    if temp == "their temporary directory":
        tmp = tmp / "their-tmp"
        theirs.append(tmp)
    inductor, cache_root = tmp / "torchinductor_root", tmp / "cache"
    job = tmp / f"{JOB_PREFIX}1_theirs"
    theirs += [inductor, cache_root, cache_root / "neuron" / "compile_cache"]
    plant(NOBODY, theirs, jobs=[job])
    home = root_home
    home.mkdir(mode=0o700, exist_ok=True)
    watched = [inductor, cache_root, job]
    before = snapshot(watched)

    result = run_node(None, "root", tmp, cache_root, home)

    assert result["matched"] and result["sources"], result
    assert set(result["sources"]) == {"uncached"}, result  # the cache bypassed, compiled
    assert snapshot(watched) == before  # nothing made, removed or opened away in theirs
    # Nothing of the node's is left in the temporary directory, sticky or theirs: with no
    # writable tier (the cache bypassed) its node files were a throwaway group, removed at
    # exit (node_files.py), and its jobs' directories went with their jobs.
    made = {p.name for p in tmp.iterdir()} - {"torchinductor_root", "cache", job.name,
                                              "fifo", "link"}  # fmt: skip
    assert made == set(), made
    warnings = result["warnings"]
    bypassed = [w for w in warnings if "VLLM_CACHE_ROOT" in w]
    assert len(bypassed) == 1 and "bypassed" in bypassed[0], warnings
    assert "uid 65534" in bypassed[0] or "writable by group or others" in bypassed[0]
    said = set(bypassed)
    if temp == "their temporary directory":
        said |= set(naming(warnings, tmp))
        assert len(naming(warnings, tmp)) <= 1, warnings  # said once if a job was made
    assert said == set(warnings), warnings  # no other warning
    # Their torchinductor_root (torch's default here) is not even looked in: Inductor's cache
    # and torch's precompiled headers were in the node's own group, in the private temporary
    # root (the sticky /tmp, or this user's own instead of theirs), built there.
    group = Path(result["inductor"]).parent
    assert result["inductor"] == str(group / "inductor") and group != inductor.parent
    assert result["headers"] == str(group / "headers")
    assert any(name.endswith(".gch") for name in result["header_files"]), result
    temp_root = tmp if temp == "sticky /tmp" else (
        home / ".cache" / "vllm" / "neuron" / "private" / "tmp-0")  # fmt: skip
    assert group.parent.parent == temp_root and group.parent.name.startswith(THROWAWAY_PREFIX)
    assert not group.parent.exists()  # removed at exit


# What a node does first with each directory, without a compile (a compile as another uid
# would start Inductor's cache cold, a minute and more on a loaded machine): resolve its local
# tier, secure Inductor's directories, make a compile job and sweep the temporary directory.
_NODE_FIRST_STEPS = r"""
import json, logging
warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("vllm_neuron").addHandler(Keep(logging.WARNING))
import vllm_neuron
from vllm_neuron.compile.tiers.location import resolve_local_tier
from vllm_neuron.compile.toolchains.node_files import secure_inductor_dirs
from vllm_neuron.compile.toolchains.private_dirs import why_not_private
from vllm_neuron.compile.workers import job_dirs
from vllm_neuron.envs import compile_cache_settings
local_dir, bypassed = resolve_local_tier(compile_cache_settings())
secure_inductor_dirs()
job_dir, owner = job_dirs.owned_job_dir(keep_free=False)
job_dirs.sweep_dead_jobs()
import os
from torch._inductor import codecache
inductor = os.environ["TORCHINDUCTOR_CACHE_DIR"]
print("SERVE_WORKER_RESULT " + json.dumps({"bypassed": bypassed, "job_dir": job_dir,
      "inductor": inductor, "headers": codecache._HEADER_DIR, "warnings": warnings,
      "not_private": [why_not_private(d) for d in (inductor, codecache._HEADER_DIR)]}))
"""


@pytest.mark.timeout(2 * BOUND)
def test_a_node_running_as_another_uid_uses_none_of_roots_directories(base: Path) -> None:
    """The converse: a node running as uid 65534, where root made its Inductor cache
    directory and its cache root (world-writable, a FIFO and a link in each) and a job
    directory in the shared sticky temporary directory: refused, bypassed, one warning each,
    nothing blocks."""
    tmp = base / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    inductor, cache_root = tmp / "torchinductor_nobody", tmp / "cache"
    plant(None, [inductor, cache_root], jobs=[tmp / f"{JOB_PREFIX}1_roots"])
    home = tmp / "nobody-home"
    subprocess.run(["mkdir", "-m", "0700", str(home)], check=True, timeout=60, **_as(NOBODY))
    before = snapshot([inductor, cache_root, tmp / f"{JOB_PREFIX}1_roots"])

    result = run_node(NOBODY, "nobody", tmp, cache_root, home, script=_NODE_FIRST_STEPS)

    after = snapshot([inductor, cache_root, tmp / f"{JOB_PREFIX}1_roots"])
    assert before.items() <= after.items()  # what root planted is there, unopened
    # The tier's directories are made (0700, empty) before the root is judged, then
    # bypassed (tiers/location.py `trusted_local_tier_dir`): nothing else of the node's.
    made = {Path(p) for p in after} - {Path(p) for p in before}
    tier = cache_root / "neuron" / "compile_cache"
    assert made <= {tier.parent, tier} and not (tier.exists() and any(tier.iterdir())), made
    assert "not this user's own" in (result["bypassed"] or ""), result
    # Inductor's cache and torch's headers in its own throwaway group (no tier of its own),
    # private, in the shared sticky temporary directory, removed at exit (node_files.py).
    group = Path(result["inductor"]).parent
    assert result["inductor"] == str(group / "inductor") and group != inductor.parent
    assert result["headers"] == str(group / "headers")
    assert result["not_private"] == [None, None], result
    assert group.parent.parent == tmp and group.parent.name.startswith(THROWAWAY_PREFIX)
    assert not group.parent.exists()
    assert Path(result["job_dir"]).parent == tmp  # root's sticky /tmp is fine for jobs
    warnings = result["warnings"]
    # Root's torchinductor_nobody (torch's default here) is not even looked in, so nothing
    # is said of it; the bypass is said by the runtime (above).
    assert warnings == [], warnings
