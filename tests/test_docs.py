"""The docs cannot drift from the code they cite.

docs/architecture.md's tables "From behaviour to code" and "Where to start in compile/" cite
code as backticked paths, each followed by backticked names defined in that file:
``compile/flow/cache.py`` ``TwoTierCache._locked_miss`` (paths relative to ``vllm_neuron/``
unless they start with ``backends/``; a path ending in ``/`` is a directory, and no names
follow it). Every cited file must exist and every cited name must be defined where the row
says, read with ``ast`` (nothing is imported):

* ``name``: a module-level def, class or assignment (also inside a module-level ``if`` or
  ``try``), else a member of a class in the file (method, class attribute, or an attribute
  a method assigns on ``self``);
* ``Class.member``: ``member`` is a method, class attribute, ``self`` attribute or nested
  class of the module-level class ``Class``;
* ``name(keyword=...)``: ``name`` as above, and ``keyword`` one of its parameters;
* ``keyword=`` or ``keyword=value`` (after a function): a parameter of that function;
* a name in parentheses: as ``name``, or a parameter of the function cited just before it.

An imported name is never accepted: ``from x import y`` is not where ``y`` is defined, so
the row cites ``x``. A path in parentheses applies only inside them.

Every path of the package cited anywhere in docs/*.md or README.md (``vllm_neuron/...py``,
``compile/...py``, ``backends/...py``, the other sub-packages', ``tests/...py``,
``benchmarks/...py``) must exist too (and in ``path.py:name`` the name must be defined
there), and every dotted module name (``vllm_neuron.a.b``) must name a module, or a name
defined in one (or listed in its ``__all__``).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TABLES = ("## From behaviour to code", "### Where to start in `compile/`")

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
NAME_RE = re.compile(rf"^{IDENT}(?:\.{IDENT})?$")
CALL_RE = re.compile(rf"^(?P<name>{IDENT}(?:\.{IDENT})?)\((?P<args>[^()]*)\)$")
KEYWORD_RE = re.compile(rf"^(?P<kw>{IDENT})=(?P<value>[^=]*)$")
PATH_RE = re.compile(r"^[\w./-]+\.py$")
DIR_RE = re.compile(r"^[\w./-]+/$")


def cited_path(text: str) -> Path:
    """A path as the docs write it: relative to vllm_neuron/ unless it starts with backends/
    (the storage layer lives beside the package) or vllm_neuron/."""
    if text.startswith(("backends/", "vllm_neuron/")):
        return ROOT / text
    return ROOT / "vllm_neuron" / text


# --- what a file defines ---------------------------------------------------------------


@dataclass
class Defined:
    module: set[str] = field(default_factory=set)
    classes: dict[str, set[str]] = field(default_factory=dict)
    params: dict[str, set[str]] = field(default_factory=dict)  # "f" / "C.m" -> parameters


def _targets(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for elt in node.elts for n in _targets(elt)]
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    return []


def _bound(stmt: ast.stmt) -> list[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [stmt.name]
    if isinstance(stmt, ast.Assign):
        return [n for t in stmt.targets for n in _targets(t)]
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        return _targets(stmt.target)
    return []


def _block(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of a body, with those of its ifs, trys and withs flattened in."""
    out: list[ast.stmt] = []
    for stmt in body:
        out.append(stmt)
        if isinstance(stmt, ast.If):
            out += _block(stmt.body) + _block(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            out += _block(stmt.body) + _block(stmt.orelse) + _block(stmt.finalbody)
            for handler in stmt.handlers:
                out += _block(handler.body)
        elif isinstance(stmt, ast.With):
            out += _block(stmt.body)
    return out


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = fn.args
    names = {p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
    names |= {p.arg for p in (a.vararg, a.kwarg) if p is not None}
    return names


def _members(cls: ast.ClassDef, defined: Defined) -> set[str]:
    members: set[str] = set()
    for stmt in _block(cls.body):
        members.update(_bound(stmt))
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.params[f"{cls.name}.{stmt.name}"] = _parameters(stmt)
            for node in ast.walk(stmt):
                target = node.target if isinstance(node, (ast.AnnAssign, ast.AugAssign)) \
                    else None
                for t in [*getattr(node, "targets", []), *([target] if target else [])]:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                            and t.value.id == "self":
                        members.add(t.attr)
    return members


@cache
def defined_in(path: Path) -> Defined:
    defined = Defined()
    for stmt in _block(ast.parse(path.read_text(), filename=str(path)).body):
        defined.module.update(_bound(stmt))
        if isinstance(stmt, ast.ClassDef):
            defined.classes[stmt.name] = _members(stmt, defined)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defined.params[stmt.name] = _parameters(stmt)
    return defined


def _resolve(defined: Defined, name: str) -> str | None:
    """The key of ``name`` in ``defined.params`` style ("f" or "C.m") if it is defined."""
    if "." in name:
        owner, member = name.split(".")
        if member in defined.classes.get(owner, ()):
            return name
        return None
    if name in defined.module:
        return name
    for cls, members in defined.classes.items():
        if name in members:
            return f"{cls}.{name}"
    return None


def _params_of(defined: Defined, key: str) -> set[str]:
    """The parameters of function or method `key`; of a class: its ``__init__``'s."""
    if key in defined.classes:
        key = f"{key}.__init__"
    return defined.params.get(key, set())


# --- the table -------------------------------------------------------------------------


def table_rows(heading: str) -> list[tuple[int, str, str]]:
    """(line number, behaviour, cited code) of every row of the table under `heading`."""
    lines = (DOCS / "architecture.md").read_text().splitlines()
    assert heading in lines, f"docs/architecture.md has no section {heading!r}"
    start = lines.index(heading)
    rows = []
    for number, line in enumerate(lines[start + 1:], start + 2):
        if line.startswith("#"):
            break
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == 2, f"architecture.md:{number}: not two cells: {line}"
        rows.append((number, *cells))
    # Not the header and the rule, nor a section row (**Compile cache**, nothing cited).
    return [(number, first, code) for number, first, code in rows[2:] if code]


def _tokens(cell: str) -> list[tuple[str, str]]:
    """("open" | "close" | "code", text) in order: backticked text and the parentheses
    outside backticks."""
    out: list[tuple[str, str]] = []
    for i, part in enumerate(cell.split("`")):
        if i % 2:
            out.append(("code", part))
            continue
        out += [("open" if ch == "(" else "close", ch) for ch in part if ch in "()"]
    return out


def row_problems(code: str) -> list[str]:
    problems: list[str] = []
    current: Path | None = None
    stack: list[tuple[Path | None, str | None]] = []
    last: str | None = None  # the function cited last, for keywords and parenthesised names

    if "`" not in code:
        return ["cites no code (backticked paths and names)"]
    for kind, text in _tokens(code):
        if kind == "open":
            stack.append((current, last))
            continue
        if kind == "close":
            if stack:
                current, last = stack.pop()
            continue
        in_parens = bool(stack)
        if DIR_RE.match(text):  # a whole directory (a wing): no names follow it
            current, last = None, None
            if not cited_path(text).is_dir():
                problems.append(f"`{text}` is no directory")
            continue
        if PATH_RE.match(text):
            current, last = cited_path(text), None
            if not current.is_file():
                problems.append(f"`{text}` does not exist")
                current = None
            continue
        if current is None:
            if not problems:
                problems.append(f"`{text}` is cited without an existing file before it")
            continue
        rel = current.relative_to(ROOT)
        defined = defined_in(current)
        if keyword := KEYWORD_RE.match(text):
            if last is None or keyword["kw"] not in _params_of(defined, last):
                problems.append(f"`{text}` is no parameter of `{last}` in {rel}")
            continue
        call = CALL_RE.match(text)
        name = call["name"] if call else text
        if not NAME_RE.match(name):
            problems.append(f"`{text}` is neither a path nor a name")
            continue
        key = _resolve(defined, name)
        if key is None and in_parens and last is not None \
                and name in _params_of(defined, last):
            continue  # a parameter of the function (or class) just cited
        if key is None:
            problems.append(f"`{name}` is not defined in {rel}")
            continue
        if call:
            for arg in filter(None, (a.strip() for a in call["args"].split(","))):
                kw = arg.split("=")[0].strip()
                if kw not in _params_of(defined, key):
                    problems.append(f"`{kw}` is no parameter of `{name}` in {rel}")
        if not in_parens or key in defined.params or key in defined.classes:
            last = key
    return problems


ROWS = [row for heading in TABLES for row in table_rows(heading)]


def test_the_tables_are_read() -> None:
    assert len(table_rows(TABLES[0])) > 50, "the behaviour table moved or changed shape"
    assert len(table_rows(TABLES[1])) > 5, "the compile/ starting points moved"


@pytest.mark.parametrize("row", ROWS, ids=[f"line{n}" for n, _, _ in ROWS])
def test_every_cited_name_is_defined_where_the_row_says(row: tuple[int, str, str]) -> None:
    number, behaviour, code = row  # behaviour: the row's first cell (a task, for the 2nd)
    problems = row_problems(code)
    assert not problems, (f"docs/architecture.md:{number} ({behaviour}): "
                          + "; ".join(problems))


# --- every path and module in the docs ------------------------------------------------

PACKAGES = ("vllm_neuron", "backends", "compile", "cli", "envs", "manifest", "snapshot",
            "profiling", "metrics", "report", "plugin")
DOC_PATH_RE = re.compile(
    rf"(?<![\w/.-])((?:{'|'.join(PACKAGES)}|tests|benchmarks)/[\w/.-]*?\w\.py)\b")
DOTTED_RE = re.compile(rf"(?<![\w.])vllm_neuron(?:\.{IDENT})+")
FILE_SUFFIXES = {"tmp", "json", "jsonl", "db", "log", "txt", "py", "md", "pt", "pt2"}
DOCUMENTS = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]


def _doc_lines() -> list[tuple[str, int, str]]:
    return [(doc.relative_to(ROOT).as_posix(), number, line) for doc in DOCUMENTS
            for number, line in enumerate(doc.read_text().splitlines(), 1)]


def _doc_path(text: str) -> Path:
    return ROOT / text if text.startswith(("tests/", "benchmarks/")) else cited_path(text)


def test_every_cited_path_exists() -> None:
    missing = [f"{doc}:{number}: {match[1]}" for doc, number, line in _doc_lines()
               for match in DOC_PATH_RE.finditer(line) if not _doc_path(match[1]).is_file()]
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


PATH_NAME_RE = re.compile(rf"{DOC_PATH_RE.pattern}:(?P<name>{IDENT}(?:\.{IDENT})?)")


def test_every_path_colon_name_is_defined() -> None:
    """``path.py:name`` (faults.md's table of fault points): the name is defined there."""
    problems = [f"{doc}:{number}: {match[0]}" for doc, number, line in _doc_lines()
                for match in PATH_NAME_RE.finditer(line)
                if _doc_path(match[1]).is_file()
                and _resolve(defined_in(_doc_path(match[1])), match["name"]) is None]
    assert not problems, "cited names that are not defined there:\n" + "\n".join(problems)


def _dotted_problem(dotted: str) -> str | None:
    """None when ``vllm_neuron.a.b`` names a module or package, or a name defined in one
    (``Class.member`` too); a name a package's ``__all__`` lists counts as defined there
    (the package's documented face: ``vllm_neuron.manifest.emit_for_this_engine``)."""
    parts = dotted.split(".")
    if parts[-1] in FILE_SUFFIXES:
        return None  # a file name (vllm_neuron.prom.tmp), not a module
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file():
            break
    else:
        return "no such module"
    rest = parts[cut:]
    if not rest:
        return None
    defined = defined_in(module)
    if len(rest) == 1 and (rest[0] in defined.module or rest[0] in _all_of(module)):
        return None
    if len(rest) == 2 and _resolve(defined, ".".join(rest)):
        return None
    return f"{'.'.join(rest)} is not defined in {module.relative_to(ROOT)}"


def _all_of(module: Path) -> set[str]:
    for stmt in ast.parse(module.read_text()).body:
        if isinstance(stmt, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets):
            return {e.value for e in getattr(stmt.value, "elts", [])
                    if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def test_every_cited_module_exists() -> None:
    problems = [f"{doc}:{number}: {match[0]}: {problem}" for doc, number, line in _doc_lines()
                for match in DOTTED_RE.finditer(line)
                if (problem := _dotted_problem(match[0])) is not None]
    assert not problems, "cited modules that do not exist:\n" + "\n".join(problems)
