"""What installing the package asks of an environment, and what the test command pins.

pyproject.toml gives ranges (an operator's `pip install vllm-neuron` beside vLLM and the
Neuron packages moves none of theirs); constraints.txt pins those packages exactly for the
tests; dev-lock.txt (`python3 dev.py lock`) pins every other package of the development
environment, so that a fresh machine's install skips pip's resolver search.
"""

from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
EXTRAS = ("test", "lint", "torch")  # what dev-lock.txt covers (dev.py ALL_EXTRAS)


def pins(path: Path) -> dict[str, Requirement]:
    out: dict[str, Requirement] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            assert [s.operator for s in req.specifier] == ["=="], f"{path.name}: {line}"
            name = canonicalize_name(req.name)
            assert name not in out, f"{path.name} pins {name} twice"
            out[name] = req
    return out


def project() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]  # type: ignore[no-any-return]


def test_runtime_dependencies_are_ranges_and_signing_is_declared() -> None:
    deps = [Requirement(d) for d in project()["dependencies"]]  # type: ignore[attr-defined]
    for req in deps:
        operators = {s.operator for s in req.specifier}
        assert operators and operators <= {">=", "<", "<=", "!=", "~="}, str(req)
        assert ">=" in operators or "~=" in operators, f"{req}: no lower bound"
    assert "cryptography" in {canonicalize_name(r.name) for r in deps}  # keygen, signing


def test_the_constraints_and_the_lock_never_pin_the_same_package() -> None:
    assert not set(pins(ROOT / "constraints.txt")) & set(pins(ROOT / "dev-lock.txt"))


def test_every_package_the_test_environment_needs_is_pinned_at_what_is_installed() -> None:
    """The project's requirements with every dev.py extra, followed through each installed
    distribution's own: each one is pinned, at the version installed here. A dependency
    added without `python3 dev.py lock` fails here, naming the package."""
    pinned = {**pins(ROOT / "constraints.txt"), **pins(ROOT / "dev-lock.txt")}
    seen: set[str] = set()
    todo = [(str(r), "") for r in md.requires("vllm-neuron") or []]
    for extra in EXTRAS:
        todo += [(str(r), extra) for r in md.requires("vllm-neuron") or []]
    unpinned, wrong = [], []
    while todo:
        line, extra = todo.pop()
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({**default_environment(),
                                                               "extra": extra}):  # fmt: skip
            continue
        name = canonicalize_name(req.name)
        if name == "vllm-neuron":  # an extra naming others: followed with those extras
            todo += [(str(r), e) for e in req.extras for r in md.requires(name) or []]
            continue
        key = f"{name}[{','.join(sorted(req.extras))}]"
        if key in seen:
            continue
        seen.add(key)
        version = md.version(name)
        if name not in pinned:
            unpinned.append(f"{name}=={version}")
        elif not pinned[name].specifier.contains(version, prereleases=True):
            wrong.append(f"{name}: {version} installed, {pinned[name]} pinned")
        for sub in md.requires(name) or []:
            todo += [(sub, e) for e in ("", *req.extras)]
    assert not unpinned and not wrong, (
        f"not pinned: {unpinned}; pinned at another version: {wrong} "
        "(python3 dev.py lock writes dev-lock.txt again)")
    assert len(seen) > 50  # the walk reached the dependencies' own dependencies


def test_the_lock_header_says_how_it_is_written() -> None:
    head = (ROOT / "dev-lock.txt").read_text().splitlines()[0]
    assert re.search(r"python3 dev\.py lock", head), head
