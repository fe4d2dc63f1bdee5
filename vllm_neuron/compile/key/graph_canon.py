"""Canonical, process-independent forms of the graph and the example inputs a key hashes.

Why: every rank of a tensor-parallel job, every node and every restart must fingerprint the
same graph to the same ``graph`` and ``inputs`` components, and anything that changes the
compiled code must change them. So the graph is serialized canonically:

- node ops, names, targets (by qualified name; local functions and lambdas also by their
  bytecode), argument structure, and the node metadata that describes values (``val`` /
  ``example_value`` / ``tensor_meta``: dtype, shape, stride, device type);
- the *contents* of every tensor reachable through ``get_attr`` or ``call_module`` (weights
  baked into a graph are part of the compiled program);
- never stack traces, module stacks, timestamps, object ids or addresses: they differ
  between processes without changing the program.

Example inputs count by dtype, shape, stride and device type (``requires_grad`` does not
change the compiled code); symbolic sizes keep their symbolic name (``s0``).

Device indices are never part of the form: ``neuron:3``, ``cuda:1`` and ``xla:2`` are
normalised to index 0 wherever they appear (arguments, keyword arguments, metadata, inputs),
so all ranks of one node produce one key. What cannot be fingerprinted reliably raises
:class:`KeyComputationError` instead of being guessed.

MD5 is used as a content fingerprint, not for security, hence ``usedforsecurity=False``
(required on FIPS-enabled hosts).
"""

from __future__ import annotations

import enum
import hashlib
import json
import numbers
import re
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from vllm_neuron.compile.key.torch_ops import op_class, unreadable

__all__ = [
    "KeyComputationError",
    "digest_json",
    "graph_digest",
    "inputs_canon",
    "md5",
    "normalize_device",
]

# Node metadata that describes values; everything else (stack traces, module stacks,
# source_fn, timestamps, seq_nr, from_node ...) is provenance and differs between runs.
_VALUE_META_KEYS = ("val", "example_value", "tensor_meta")

_DEVICE_RE = re.compile(r"^(neuron|cuda|xla|privateuseone)(?::\d+)?$")


class KeyComputationError(ValueError):
    """The graph holds something that cannot be fingerprinted reliably.

    Raised rather than guessed: a key that ignores part of the program could hand one
    graph another graph's artifact. Callers may compile without the cache instead.
    """


def md5(data: Any = b"") -> Any:
    """An MD5 hasher: a content fingerprint, not a security measure."""
    return hashlib.md5(data, usedforsecurity=False)


def digest_json(obj: Any) -> str:
    """MD5 of ``obj``'s canonical JSON (sorted keys, no whitespace)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return str(md5(text.encode("utf-8")).hexdigest())


def normalize_device(device: str) -> str:
    """``neuron:3`` -> ``neuron:0`` (also cuda, xla, privateuseone); other strings as is.

    A bare accelerator type (``neuron``) also maps to index 0: the index is a placement
    decision made after compilation and never part of the compiled program.
    """
    match = _DEVICE_RE.match(device)
    return f"{match.group(1)}:0" if match else device


# Canonical forms ---------------------------------------------------------------------------


def _type_name(obj: object) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _dim(value: Any) -> Any:
    """A size or stride entry: an int, or the string form of a symbolic size."""
    if isinstance(value, int):
        return value
    return str(value)


def _tensor_meta(t: torch.Tensor) -> list[Any]:
    """dtype, shape, stride, layout and device type; never requires_grad or the index."""
    try:
        stride: list[Any] | None = [_dim(s) for s in t.stride()]
    except (RuntimeError, NotImplementedError):  # sparse and other stride-less layouts
        stride = None
    return [
        "tensor",
        str(t.dtype),
        [_dim(s) for s in t.shape],
        stride,
        str(t.layout),
        normalize_device(str(t.device)),
    ]


def _is_a(obj: Any, *qualnames: str) -> bool:
    """Whether `obj` is of one of the fenced ``torch._ops`` classes torch has now
    (key/torch_ops.py)."""
    return isinstance(obj, tuple(c for c in map(op_class, qualnames) if c is not None))


def _callable_name(fn: Any) -> str:
    """A stable, address-free name for a call target."""
    if isinstance(fn, str):
        return fn
    if _is_a(fn, "torch._ops.OpOverload", "torch._ops.OpOverloadPacket"):
        return f"torch.ops.{fn}"
    if _is_a(fn, "torch._ops.HigherOrderOperator"):
        return f"torch.ops.higher_order.{fn.name()}"
    name: str | None = None
    try:
        name = torch.fx.node._get_qualified_name(fn)
    except Exception:  # lambdas without source, C callables without a module
        name = None
    if name is None:
        module = getattr(fn, "__module__", None) or ""
        qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
        if qualname is None:
            raise KeyComputationError(f"call target of type {_type_name(fn)} has no name")
        name = f"{module}.{qualname}"
    # Local functions and lambdas share qualified names across different bodies: add
    # the bytecode so two different lambdas never share a key.
    code = getattr(fn, "__code__", None)
    local_name = f"{name} {getattr(fn, '__qualname__', '')}"
    if ("<locals>" in local_name or "<lambda>" in local_name) and isinstance(code, types.CodeType):
        name += "#" + digest_json(_code_canon(code))
    return name


def _code_canon(code: types.CodeType) -> list[Any]:
    consts = [
        _code_canon(c) if isinstance(c, types.CodeType) else _canon(c, strict=False)
        for c in code.co_consts
    ]
    return [code.co_code.hex(), consts, list(code.co_names)]


def _canon(obj: Any, strict: bool) -> Any:
    """A JSON-able, process-independent form of an FX argument or metadata value.

    ``strict`` (arguments) raises on unknown types; metadata is lenient and records only
    the type name of values it does not understand.
    """
    if obj is None or isinstance(obj, (bool, int, float)):
        if isinstance(obj, float) and obj != obj:
            return ["float", "nan"]
        return obj
    if isinstance(obj, str):
        return normalize_device(obj)
    if isinstance(obj, torch.fx.Node):
        return ["node", obj.name]
    if isinstance(obj, torch.device):
        return ["device", normalize_device(str(obj))]
    if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
        return [type(obj).__name__, str(obj)]
    if isinstance(obj, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ["sym", str(obj)]
    if isinstance(obj, torch.Tensor):
        # In arguments a tensor is a constant of the program: its values count too.
        if strict:
            return [*_tensor_meta(obj), _tensor_content_digest(obj)]
        return _tensor_meta(obj)
    if type(obj).__name__ == "TensorMetadata" and hasattr(obj, "dtype"):
        # torch.fx.passes.shape_prop.TensorMetadata: keep what shapes the program,
        # drop requires_grad.
        return [
            "tensor_meta",
            str(obj.dtype),
            [_dim(s) for s in obj.shape],
            [_dim(s) for s in obj.stride],
            str(obj.memory_format),
            bool(obj.is_quantized),
            _canon(obj.qparams, strict=False),
        ]
    if isinstance(obj, enum.Enum):
        return ["enum", _type_name(obj), obj.name]
    if isinstance(obj, tuple):
        items = [_canon(x, strict) for x in obj]
        if hasattr(obj, "_fields"):  # namedtuple: the type is part of the meaning
            return ["namedtuple", _type_name(obj), items]
        return ["tuple", items]
    if isinstance(obj, list):
        return ["list", [_canon(x, strict) for x in obj]]
    if isinstance(obj, dict):
        pairs = [[_canon(k, strict), _canon(v, strict)] for k, v in obj.items()]
        pairs.sort(key=lambda kv: json.dumps(kv, sort_keys=True, allow_nan=True))
        return ["dict", pairs]
    if isinstance(obj, slice):
        return [
            "slice",
            _canon(obj.start, strict),
            _canon(obj.stop, strict),
            _canon(obj.step, strict),
        ]
    if isinstance(obj, complex):
        return ["complex", repr(obj)]
    if obj is Ellipsis:
        return ["ellipsis"]
    if isinstance(obj, numbers.Integral):  # numpy integers
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    if _is_a(obj, "torch._ops.OperatorBase", "torch._ops.OpOverloadPacket") or callable(obj):
        return ["callable", _callable_name(obj)]
    if strict:
        raise KeyComputationError(f"cannot fingerprint a graph argument of type {_type_name(obj)}")
    return ["opaque", _type_name(obj)]


# Graph -------------------------------------------------------------------------------------


def _tensor_content_digest(t: torch.Tensor) -> str:
    """MD5 of a tensor's bytes (values baked into the graph are part of the program)."""
    t = t.detach()
    if t.device.type == "meta" or isinstance(t, torch._subclasses.FakeTensor):
        return "no-data"
    if t.layout != torch.strided:
        raise KeyComputationError(f"cannot fingerprint a constant tensor with layout {t.layout}")
    if t.is_quantized:
        raise KeyComputationError("cannot fingerprint a quantized constant tensor")
    t = t.resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    return str(md5(flat.numpy().tobytes()).hexdigest())


class _GraphHasher:
    """Walks one GraphModule (and the modules it reaches) into a canonical structure."""

    def __init__(self) -> None:
        # Memo keyed by id() within one computation only; ids never enter the hash.
        self._memo: dict[int, str] = {}

    def attr(self, obj: Any, where: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return [_tensor_meta(obj), _tensor_content_digest(obj)]
        if isinstance(obj, torch.fx.GraphModule):
            return ["graph", self.graph(obj)]
        if isinstance(obj, torch.nn.Module):
            return self.module(obj)
        if isinstance(obj, torch.ScriptObject):
            flatten = getattr(obj, "__obj_flatten__", None)
            if flatten is None:
                raise KeyComputationError(f"cannot fingerprint script object at {where!r}")
            return ["script_object", _canon(flatten(), strict=True)]
        try:
            return ["value", _canon(obj, strict=True)]
        except KeyComputationError as exc:
            raise KeyComputationError(f"{exc} (attribute {where!r})") from None

    def module(self, mod: torch.nn.Module) -> Any:
        """A called submodule: its type, configuration and every parameter and buffer."""
        state = [
            [name, self.attr(value, name)]
            for name, value in sorted(mod.state_dict(keep_vars=True).items())
        ]
        kinds = [[name, _type_name(m)] for name, m in mod.named_modules()]
        return ["module", _type_name(mod), mod.extra_repr(), kinds, state]

    def graph(self, gm: torch.fx.GraphModule) -> str:
        cached = self._memo.get(id(gm))
        if cached is not None:
            return cached
        nodes: list[Any] = []
        for node in gm.graph.nodes:
            entry: list[Any] = [
                node.op,
                node.name,
                _callable_name(node.target),
                _canon(node.args, strict=True),
                _canon(dict(node.kwargs), strict=True),
                [
                    [k, _canon(node.meta[k], strict=False)]
                    for k in _VALUE_META_KEYS
                    if k in node.meta
                ],
            ]
            if node.op == "get_attr":
                entry.append(self.attr(_fetch_attr(gm, node.target), node.target))
            elif node.op == "call_module":
                entry.append(self.attr(gm.get_submodule(node.target), node.target))
            nodes.append(entry)
        unread = unreadable()  # a torch without a fenced class: a key of its own
        digest = digest_json(["fx", _codegen_canon(gm), nodes, *([unread] if unread else [])])
        self._memo[id(gm)] = digest
        return digest


def _fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for atom in target.split("."):
        if not hasattr(obj, atom):
            raise KeyComputationError(f"get_attr target {target!r} does not exist")
        obj = getattr(obj, atom)
    return obj


def _codegen_canon(gm: torch.fx.GraphModule) -> Any:
    """The calling convention: exported graphs flatten inputs/outputs through a pytree."""
    codegen = getattr(gm.graph, "_codegen", None)
    info = getattr(codegen, "pytree_info", None)
    if info is None:
        return _type_name(codegen) if codegen is not None else None
    return [_type_name(codegen), str(info.in_spec), str(info.out_spec)]


def graph_digest(gm: torch.fx.GraphModule) -> str:
    """The ``graph`` component alone (useful to compare graphs across processes)."""
    return _GraphHasher().graph(gm)


# Example inputs --------------------------------------------------------------------------


def inputs_canon(example_inputs: Sequence[Any]) -> list[Any]:
    """The ``inputs`` component's form: tensor metadata (never values), or the constant."""
    out: list[Any] = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            out.append(_tensor_meta(x))
        else:
            out.append(_canon(x, strict=True))
    return out
