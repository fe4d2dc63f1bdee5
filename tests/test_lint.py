"""Lint runs with the tests, so CI (the README's test command) enforces it.

ruff (style and errors), mypy (types of the package) and import-linter (the layer
contract in pyproject.toml: storage <- settings <- compile <- features <- assembly <-
entry points, and profile capture never compiling). The checkers are pinned in the
``lint`` extra, so a new release cannot turn a fresh machine red.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)


LINTED = ("vllm_neuron", "backends", "tests", "benchmarks", "dev.py", ".ci/vllm_env.py",
          ".ci/tiny_model.py")


def test_ruff_is_clean() -> None:
    done = run(sys.executable, "-m", "ruff", "check", *LINTED)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_is_clean() -> None:
    done = run(sys.executable, "-m", "mypy", "vllm_neuron")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_layer_contract_is_kept() -> None:
    done = run(str(BIN / "lint-imports"), "--no-cache")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout, done.stdout


def _module_imports() -> dict[str, set[str]]:
    """Every module of the package (the storage layer aside: its own contract) and the
    package modules it imports anywhere in its body, lazy imports inside functions too."""
    import ast

    modules: dict[str, Path] = {}
    for path in (ROOT / "vllm_neuron").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if "backends" in parts:
            continue
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - max(0, node.level - 1)]
                mod = ".".join([*base, *([node.module] if node.module else [])]) \
                    if node.level else (node.module or "")
                found = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod
                         for a in node.names]
            elif isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in found if t in modules and t != name)
    return graph


def test_no_two_modules_import_each_other_at_any_depth() -> None:
    """A circle (a imports b, b imports a, directly or through others; a lazy import in a
    function counts) means the two are one concept split badly: what they share belongs in a
    module both use."""
    graph = _module_imports()
    circles = []
    for start in sorted(graph):
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module == start:
                circles.append(start)
                break
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
    assert not circles, f"modules on an import circle: {circles}"


# The storage layer is the only door to bytes (issue 42, "the storage door"): these modules
# write through `vllm_neuron.backends` (`open_store(...).write`), never with open() in a
# writing mode. By function, what may still open for writing, and why.
DOORED = {
    "vllm_neuron/compile/toolchains/aoti_runtime_store.py": set(),
    # A file descriptor the compiler's own output is pointed at (dup2), not bytes we write.
    "vllm_neuron/compile/workers/process.py": {"_output_to"},
}


def _writing_opens(source: str) -> list[tuple[str, int]]:
    """(function, line) of every builtin open() call with a writing mode in `source`."""
    import ast

    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = (child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
                    else function)  # fmt: skip
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Name)
                    and child.func.id == "open"):
                mode = child.args[1] if len(child.args) > 1 else next(
                    (k.value for k in child.keywords if k.arg == "mode"), None)
                text = ("r" if mode is None
                        else mode.value if isinstance(mode, ast.Constant) else "?")  # fmt: skip
                if not isinstance(text, str) or set(text) & set("wax+?"):
                    found.append((function, child.lineno))
            visit(child, name)

    visit(ast.parse(source), "<module>")
    return found


def test_doored_modules_write_no_bytes_with_open() -> None:
    for path, allowed in DOORED.items():
        found = [(f, n) for f, n in _writing_opens((ROOT / path).read_text()) if f not in allowed]
        assert not found, f"{path} writes with open() outside the storage layer: {found}"


def test_the_door_check_flags_a_writing_open() -> None:
    source = "def f(p, m):\n    open(p, 'wb')\n    open(p, mode='a')\n    open(p, m)\n    open(p)\n"
    assert _writing_opens(source) == [("f", 2), ("f", 3), ("f", 4)]
