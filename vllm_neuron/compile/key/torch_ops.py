"""Torch's private operator classes the graph's canonical form reads, behind a fence.

Why: ``torch._ops`` is private; the graph component of the key names a call target by its
operator (``torch.ops.aten.add.Tensor``) when the target is one of these classes. The key
wing cannot use the toolchains' fence (toolchains/torch_internals.py: the two wings are
independent), so this is its sibling for the key's one concern, with the same rules: every
name listed (`FENCED`: what for, what happens without it), read only through `op_class`,
one warning per name and process. Without one, the key fails *closed*: the graph component
gains ``unknown:<name>`` (`unreadable`), so a graph keyed without it never shares an entry
with one keyed with it; with every name present the key is what it always was.
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import NamedTuple

__all__ = ["FENCED", "op_class", "unreadable"]

logger = logging.getLogger("vllm_neuron.compile")

_WITHOUT = ("a target of this class is named as any callable (its module and name), and the "
            "graph component says unknown:<name> (a key of its own)")


class Fenced(NamedTuple):
    """One class of `module` named `name`, read for `purpose`."""

    module: str
    name: str
    purpose: str
    without: str = _WITHOUT

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


FENCED: dict[str, Fenced] = {e.qualname: e for e in (
    Fenced("torch._ops", "OpOverload", "an operator overload, named torch.ops.<op>.<overload>"),
    Fenced("torch._ops", "OpOverloadPacket", "an operator packet, named torch.ops.<op>"),
    Fenced("torch._ops", "HigherOrderOperator",
           "a higher-order operator, named torch.ops.higher_order.<name>"),
    Fenced("torch._ops", "OperatorBase", "any operator: a graph argument named as a callable"),
)}  # fmt: skip
"""Every private torch name the key's canonical forms read, by qualified name."""

_lock = threading.Lock()
_warned: set[str] = set()


def _problem(entry: Fenced) -> str | None:
    try:
        value = getattr(importlib.import_module(entry.module), entry.name, None)
    except ImportError as exc:
        return f"cannot be imported ({exc})"
    if value is None:
        return "is missing"
    return None if isinstance(value, type) else f"is a {type(value).__name__}, not a class"


def op_class(qualname: str) -> type | None:
    """The fenced class `qualname`, or None when torch no longer has it (warned once; the
    key then says so: `unreadable`)."""
    entry = FENCED[qualname]
    problem = _problem(entry)
    if problem is None:
        value: type = getattr(importlib.import_module(entry.module), entry.name)
        return value
    with _lock:
        first = qualname not in _warned
        _warned.add(qualname)
    if first:
        logger.warning("vllm_neuron: torch's private %s %s; %s", qualname, problem,
                       entry.without)  # fmt: skip
    return None


def unreadable() -> str:
    """``unknown:<name>,...`` for the fenced classes torch does not have as expected now;
    empty when every one is there."""
    return ",".join(f"unknown:{q}" for q, e in sorted(FENCED.items()) if _problem(e) is not None)


def _forget() -> None:
    """Forget every warning (tests: a process starting anew)."""
    with _lock:
        _warned.clear()
