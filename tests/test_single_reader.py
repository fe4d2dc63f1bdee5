"""`vllm_neuron.envs` is the only reader of this package's environment variables.

Why a test: the point of parsing every setting in one place is lost the day one module
reads ``os.environ`` itself, with its own idea of blank values, booleans and defaults, and
without being reset by ``envs.reset_for_tests``. The source of the package (and of the
storage layer under it) is scanned with ``ast``, outside ``vllm_neuron/envs/``:

- a read of a named variable (``os.environ[...]``, ``.get``, ``.pop``, ``in``,
  ``os.getenv``) fails when the name is one envs reads (`envs.READ_VARIABLES`) or has the
  package's prefixes ``VLLM_NEURON_`` / ``NEURON_``; other programs' variables (the storage
  layer's ``AWS_ENDPOINT_URL``) are not this package's settings;
- writes are allowed (``os.environ[name] = ...``, ``setdefault``, ``update``, ``del``):
  they hand a setting to vLLM or to child processes, which read it themselves;
- any other use of ``os.environ`` (a copy, an alias, iteration) can read anything, so it
  fails unless it is listed in `WHOLE_ENVIRONMENT_USES`, each with the reason it is not a
  reading of settings. An entry that no longer matches fails too, so the list stays exact.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vllm_neuron import envs
from vllm_neuron.envs.compile_cache import load_model_info_looked, load_node_files_dir

ROOT = Path(__file__).resolve().parent.parent
PREFIXES = ("VLLM_NEURON_", "NEURON_")

# (path or directory/, function) -> why that use of the whole environment is not a reading
# of settings. server_environment is named by its package: profiling's modules are being
# split, and the function is the same wherever it lands.
WHOLE_ENVIRONMENT_USES: dict[tuple[str, str], str] = {
    ("vllm_neuron/compile/toolchains/private_dirs.py", "_secure_inductor_dirs"):
        "torch's own TORCHINDUCTOR_CACHE_DIR, read as torch reads it and replaced for this "
        "process (and the workers it starts) when the directory is not private",
    ("vllm_neuron/profiling/", "server_environment"):
        "the profiling server's environment is this process's, plus the capture's "
        "settings: a copy handed to a child process, which parses it itself",
    ("vllm_neuron/cli/demo.py", "run_worker"):
        "the demo's worker processes get a copy of the environment with their own "
        "VLLM_CACHE_ROOT and remote tier: settings handed to children, not read",
    ("vllm_neuron/profiling/run_spec.py", "snapshot_model_env"):
        "records the launch-time values of the variables a recipe declares in run_spec.json "
        "(a secret's value redacted when written); it interprets none of them",
}

_READ_METHODS = frozenset({"get", "pop"})
_WRITE_METHODS = frozenset({"setdefault", "update", "__setitem__", "__delitem__"})


@dataclass(frozen=True)
class Use:
    """One use of the process environment: ``kind`` is "read" (of ``name``) or "whole"."""

    path: str
    line: int
    function: str
    kind: str
    name: str | None = None

    def __str__(self) -> str:
        what = f"reads {self.name}" if self.kind == "read" else "uses os.environ as a whole"
        return f"{self.path}:{self.line} ({self.function or '<module>'}) {what}"


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _function_of(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    names: list[str] = []
    current: ast.AST | None = node
    while current is not None:
        if isinstance(current, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(current.name)
        current = parents.get(current)
    return ".".join(reversed(names))


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def environment_uses(source: str, path: str) -> list[Use]:
    """Every read of a named variable and every other use of the environment in ``source``
    (writes are not uses: they hand settings on)."""
    tree = ast.parse(source, path)
    parents = _parents(tree)
    os_names = {"os"}
    environ_names: set[str] = set()
    getenv_names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            os_names |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in ("environ", "environb"):
                    environ_names.add(alias.asname or alias.name)
                elif alias.name in ("getenv", "getenvb"):
                    getenv_names.add(alias.asname or alias.name)

    def is_environ(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "environb"):
            return isinstance(node.value, ast.Name) and node.value.id in os_names
        return isinstance(node, ast.Name) and node.id in environ_names

    def is_getenv(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute) and node.attr in ("getenv", "getenvb"):
            return isinstance(node.value, ast.Name) and node.value.id in os_names
        return isinstance(node, ast.Name) and node.id in getenv_names

    uses: list[Use] = []

    def use(node: ast.AST, kind: str, name: str | None = None) -> None:
        uses.append(Use(path, getattr(node, "lineno", 0), _function_of(node, parents), kind,
                        name))  # fmt: skip

    def named_read(node: ast.AST, key: ast.AST | None) -> None:
        name = _literal(key)
        use(node, "read", name) if name is not None else use(node, "whole")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and is_getenv(node.func):
            named_read(node, node.args[0] if node.args else None)
            continue
        if not is_environ(node) or is_getenv(node):
            continue
        parent = parents.get(node)
        if isinstance(parent, ast.Subscript) and parent.value is node:
            if isinstance(parent.ctx, ast.Load):
                named_read(parent, parent.slice)
            continue  # os.environ[name] = value, del os.environ[name]: writes
        if isinstance(parent, ast.Attribute) and parent.value is node:
            call = parents.get(parent)
            if isinstance(call, ast.Call) and call.func is parent:
                if parent.attr in _WRITE_METHODS:
                    continue
                if parent.attr in _READ_METHODS:
                    named_read(call, call.args[0] if call.args else None)
                    continue
            use(parent, "whole")
            continue
        if (isinstance(parent, ast.Compare) and node in parent.comparators
                and all(isinstance(op, ast.In | ast.NotIn) for op in parent.ops)):
            named_read(parent, parent.left)
            continue
        use(node, "whole")
    return uses


def _owned(name: str) -> bool:
    return name in envs.READ_VARIABLES or name.startswith(PREFIXES)


def _scanned_files() -> list[Path]:
    files = [p for p in (ROOT / "vllm_neuron").rglob("*.py")
             if p.relative_to(ROOT).parts[1] not in ("envs", "backends")]  # fmt: skip
    # The storage layer is scanned where it lives (vllm_neuron/backends is a symlink).
    return sorted(files + list((ROOT / "backends").rglob("*.py")))


def _whole_use_entry(path: str, function: str) -> tuple[str, str] | None:
    for where, name in WHOLE_ENVIRONMENT_USES:
        inside = path.startswith(where) if where.endswith("/") else path == where
        if inside and function == name:
            return where, name
    return None


def test_no_module_outside_envs_reads_a_variable_of_the_package() -> None:
    violations: list[str] = []
    matched: set[tuple[str, str]] = set()
    for file in _scanned_files():
        path = file.relative_to(ROOT).as_posix()
        for found in environment_uses(file.read_text(encoding="utf-8"), path):
            if found.kind == "read":
                if found.name is not None and _owned(found.name):
                    violations.append(f"{found}: read it through vllm_neuron.envs")
            elif (entry := _whole_use_entry(path, found.function)) is not None:
                matched.add(entry)
            else:
                violations.append(f"{found}: read settings through vllm_neuron.envs, or list "
                                  "this use in WHOLE_ENVIRONMENT_USES with the reason")
    stale = sorted(set(WHOLE_ENVIRONMENT_USES) - matched)
    assert not violations, "\n".join(violations)
    assert not stale, f"WHOLE_ENVIRONMENT_USES entries that match nothing any more: {stale}"


class RecordingEnviron(dict[str, str]):
    """A mapping that remembers every name looked up in it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.asked.add(str(key))
        return super().__contains__(key)


def test_read_variables_are_exactly_what_the_groups_read() -> None:
    # The scan's notion of "ours" comes from envs.READ_VARIABLES: it must hold every name
    # a group looks up, and every documented variable must really be read by one.
    env = RecordingEnviron({"VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_ENABLE": "1",
                            "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_DIR": "memory://reader",
                            "HOME": "/home/alice"})  # fmt: skip
    envs.load_compile_cache_settings(env)
    envs.load_manifest_settings(env)
    envs.load_run_id(env)
    envs.load_snapshot_settings(env)
    envs.check_snapshot_root("memory://reader", env)
    envs.load_host_mode_settings(env)
    envs.load_cpu_probe_marker(env)
    envs.cold_start_without("probe", env)
    load_node_files_dir(env)
    load_model_info_looked(env)
    envs.load_profiling_settings(env)
    envs.load_identity_settings(env)
    envs.load_fault_settings(env)
    envs.load_metrics_settings(env)
    envs.load_trust_settings(env)
    assert env.asked <= envs.READ_VARIABLES, env.asked - envs.READ_VARIABLES
    documented = {v.name for v in envs.ENVIRONMENT_VARIABLES}
    assert documented <= env.asked, documented - env.asked


# The checker itself ------------------------------------------------------------------------

FLAGGED = [
    'import os\nos.environ.get("VLLM_NEURON_TOOLCHAIN")',
    'import os\nos.environ["NEURON_VISIBLE_DEVICES"]',
    'import os\nos.getenv("RANK", "0")',
    'import os\n"VLLM_CACHE_ROOT" in os.environ',
    'from os import environ\nenviron.get("VLLM_DP_RANK")',
    'import os as o\no.environ.pop("VLLM_USE_AOT_COMPILE")',
]
WHOLE = [
    "import os\nenv = os.environ",
    "import os\ndef f(e=None):\n    return os.environ if e is None else e",
    "import os\ndict(os.environ)",
    "import os\nos.environ.get(name)",
]
ALLOWED = [
    'import os\nos.environ["VLLM_NEURON_RUN_ID"] = "x"',
    'import os\nos.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")',
    'import os\ndel os.environ["VLLM_NEURON_RUN_ID"]',
    'import os\nos.environ.get("AWS_ENDPOINT_URL")',
    "def f(environ):\n    return environ.get('VLLM_NEURON_TOOLCHAIN')",  # a mapping, not os's
]


@pytest.mark.parametrize("source", FLAGGED)
def test_checker_flags_a_read_of_our_variable(source: str) -> None:
    uses = environment_uses(source, "x.py")
    assert any(u.kind == "read" and u.name is not None and _owned(u.name) for u in uses)


@pytest.mark.parametrize("source", WHOLE)
def test_checker_flags_a_use_it_cannot_see_through(source: str) -> None:
    assert [u.kind for u in environment_uses(source, "x.py")] == ["whole"]


@pytest.mark.parametrize("source", ALLOWED)
def test_checker_allows_writes_and_other_programs_variables(source: str) -> None:
    assert not [u for u in environment_uses(source, "x.py")
                if u.kind == "whole" or (u.name is not None and _owned(u.name))]  # fmt: skip


def test_checker_names_file_line_and_function() -> None:
    [found] = environment_uses("import os\n\ndef f():\n    return os.getenv('RANK')\n", "m.py")
    assert str(found) == "m.py:4 (f) reads RANK"
