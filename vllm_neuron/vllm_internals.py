"""vLLM's private names this package reads, subclasses or replaces, behind one fence.

Why: vLLM has no stable Python API for a platform plugin; the classes the host platform
extends (``CpuPlatform``, ``CompilerInterface``, ``CPUWorker``), the layer internals the
rank-independent embedding reuses, its parallel-state accessors and its table of known
variables all move between releases. Imported bare, a moved one would stop the plugin at
import in every vLLM process (on a Neuron host too, where the plugin only steps aside). So
every such name is listed here (`FENCED`: what it is for, what happens without it) and read
only through `resolve`/`require`, which check that the name is still there, of the kind and
with the signatures (of the methods we override or call) this package was written against.
The canary test at the pinned vLLM checks the list itself.

Without one, vLLM does what it does on its own, with one warning per name and process: host
mode off (vLLM picks its platform), vLLM's own CPU compile, vLLM's own worker, its own
embedding layer, ranks from ``torch.distributed``. No fenced vLLM name feeds a cache key
(`feeds_key` is False for every one, and the canary says so): if one ever does, it must fail
closed as torch's do (``compile/toolchains/torch_internals.py``).

This module imports nothing of this package's and nothing of vLLM's at import: it is read by
the plugin's entry points, which vLLM imports in every process.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FENCED", "VllmName", "problem", "require", "resolve"]

logger = logging.getLogger("vllm_neuron")

_VOCAB = "vllm.model_executor.layers.vocab_parallel_embedding"
_NO_SHARED_EMBEDDING = ("the vocab-parallel embedding stays vLLM's (its piece compiles once per "
                        "tensor-parallel rank)")
_REGISTRY = "vllm.model_executor.models.registry"
_NO_MODEL_INFO = ("a new node's vLLM inspects its model class in a subprocess of its own, as "
                  "without this package (12-15 s on 2 cores)")
_NO_HOOKS = ("tensor-parallel ranks are read from torch.distributed and the launcher's "
             "variables (RANK, VLLM_DP_RANK)")


@dataclass(frozen=True)
class VllmName:
    """One private name: `module`'s attribute `name`. `params`: the parameter names of the
    callable we call (None: not called); `kind`: its type, if checked; `methods`: for a class,
    the parameter names of each method we override or call."""

    module: str
    name: str
    purpose: str
    without: str
    params: tuple[str, ...] | None = None
    kind: type | None = None
    methods: dict[str, tuple[str, ...]] = field(default_factory=dict)
    feeds_key: bool = False

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


_ENTRIES = (
    VllmName("vllm.platforms.cpu", "CpuPlatform", kind=type,
             methods={"check_and_update_config": ("vllm_config",), "get_compile_backend": ()},
             purpose="vLLM's CPU platform: the base of the host platform (plugin/platform.py)",
             without="host mode is off: the platform plugin names no platform and vLLM picks "
                     "its own"),
    VllmName("vllm.compilation.compiler_interface", "CompilerInterface", kind=type,
             methods={
                 "compile": ("self", "graph", "example_inputs", "compiler_config",
                             "compile_range", "key"),
                 "load": ("self", "handle", "graph", "example_inputs", "graph_index",
                          "compile_range"),
                 "initialize_cache": ("self", "cache_dir", "disable_cache", "prefix"),
                 "compute_hash": ("self", "vllm_config"),
             },
             purpose="the base of the compiler adaptor (plugin/compiler.py) vLLM hands every "
                     "piecewise graph to, with the calls vLLM makes on it",
             without="the host platform compiles as vLLM's CPU platform does (its own "
                     "compile mode and backend): nothing goes through this package's cache"),
    VllmName("vllm.config", "CompilationMode", kind=type,
             purpose="VLLM_COMPILE, the piecewise mode the host platform restores "
                     "(plugin/hooks.py configure_compilation)",
             without="as without CompilerInterface: vLLM's own compile"),
    VllmName("vllm.v1.worker.cpu_worker", "CPUWorker", kind=type,
             methods={"__init__": ("self", "vllm_config", "local_rank", "rank",
                                   "distributed_init_method", "is_driver_worker"),
                      "init_device": ("self",), "compile_or_warm_up_model": ("self",)},
             purpose="vLLM's CPU worker: the base of the host worker (plugin/worker.py)",
             without="the host worker is vLLM's own CPU worker: no snapshot forward context, "
                     "no manifest after warm-up, no early compile workers, vLLM's embedding"),
    VllmName("vllm.distributed.parallel_state", "get_tp_group", params=(),
             purpose="this rank's tensor-parallel group: its rank and size (identity.py: the "
                     "manifest's ranks, snapshots, a rank's share of the compile slots)",
             without=_NO_HOOKS),
    VllmName("vllm.distributed.parallel_state", "get_dp_group", params=(),
             purpose="this rank's data-parallel rank (identity.py)", without=_NO_HOOKS),
    VllmName("vllm.envs", "environment_variables", kind=dict,
             purpose="vLLM's table of known variables: this package's settings are added "
                     "(plugin/vllm_env.py)",
             without="vLLM may warn about VLLM_NEURON_* as unknown; Ray workers get only the "
                     "VLLM_* ones"),
    VllmName("vllm.model_executor.custom_op", "PluggableLayer", kind=type,
             methods={"register_oot": ("_decorated_layer_cls", "name")},
             purpose="vLLM's extension point that installs the rank-independent embedding "
                     "(plugin/vocab_embedding.py)", without=_NO_SHARED_EMBEDDING),
    VllmName("vllm.model_executor.custom_op", "op_registry_oot", kind=dict,
             purpose="what is already installed there (another platform's layer is kept)",
             without=_NO_SHARED_EMBEDDING),
    VllmName("vllm.distributed", "tensor_model_parallel_all_reduce", params=("input_",),
             purpose="the embedding's reduction, as vLLM's forward does it",
             without=_NO_SHARED_EMBEDDING),
    VllmName("vllm.model_executor.layers.quantization.utils.fp8_utils", "is_fp8",
             params=("x",), purpose="the embedding's FP8 reduction, as vLLM's forward",
             without=_NO_SHARED_EMBEDDING),
    VllmName(_VOCAB, "VocabParallelEmbedding", kind=type, methods={"forward": ("self", "input_")},
             purpose="the layer the rank-independent embedding extends (its forward's other "
                     "reads are checked in vocab_embedding.py)", without=_NO_SHARED_EMBEDDING),
    VllmName(_VOCAB, "VocabParallelEmbeddingShardIndices", kind=type,
             purpose="the shard bounds the embedding moves into a buffer",
             without=_NO_SHARED_EMBEDDING),
    VllmName(_REGISTRY, "_LazyRegisteredModel", kind=type, methods={"_get_cache_dir": ()},
             purpose="where vLLM keeps what it learned of each model class "
                     "($VLLM_CACHE_ROOT/modelinfos), carried to a deployment's new nodes "
                     "(plugin/model_info.py)", without=_NO_MODEL_INFO),
    VllmName(_REGISTRY, "_run_in_subprocess", params=("fn",),
             purpose="vLLM's inspection of a model class in a fresh interpreter (to keep CUDA "
                     "out of its first process): in host mode, where there is no CUDA, "
                     "replaced by the same call in the process that asks "
                     "(plugin/model_inspection.py); vLLM's registry is its only caller (the "
                     "canary scans vLLM's source)",
             without="vLLM inspects each model class new to the node in its subprocess (8-15 s "
                     "on 2 cores), as without this package"),
    VllmName(_REGISTRY, "_ModelInfo", kind=type,
             purpose="the fields of vLLM's model information and their types: a carried file "
                     "must have exactly these (plugin/model_info.py)", without=_NO_MODEL_INFO),
    VllmName("vllm.config.model", "AttnTypeStr",
             purpose="the choices of _ModelInfo.attn_type (declared under TYPE_CHECKING there)",
             without=_NO_MODEL_INFO),
    VllmName("vllm.config.pooler", "SequencePoolingType",
             purpose="the choices of _ModelInfo.default_seq_pooling_type", without=_NO_MODEL_INFO),
    VllmName("vllm.config.pooler", "TokenPoolingType",
             purpose="the choices of _ModelInfo.default_tok_pooling_type", without=_NO_MODEL_INFO),
    VllmName(_VOCAB, "get_masked_input_and_mask",
             params=("input_", "org_vocab_start_index", "org_vocab_end_index",
                     "num_org_vocab_padding", "added_vocab_start_index",
                     "added_vocab_end_index"),
             purpose="vLLM's masking, called with the bounds read from the buffer",
             without=_NO_SHARED_EMBEDDING),
)

FENCED: dict[str, VllmName] = {e.qualname: e for e in _ENTRIES}
"""Every private vLLM name this package touches, by qualified name."""

_lock = threading.Lock()
_warned: set[str] = set()


def _signature_problem(value: Any, expected: tuple[str, ...], what: str) -> str | None:
    if not callable(value):
        return f"{what} is not callable"
    try:
        params = tuple(inspect.signature(value).parameters)
    except (TypeError, ValueError):
        return f"{what} has no readable signature"
    if params != expected:
        return f"{what} takes ({', '.join(params)}), not ({', '.join(expected)})"
    return None


def problem(qualname: str) -> str | None:
    """Why the fenced `qualname` is not as this package was written against, or None."""
    entry = FENCED[qualname]
    try:
        module = importlib.import_module(entry.module)
    except ImportError as exc:
        return f"cannot be imported ({exc})"
    try:
        value = getattr(module, entry.name, None)
    except Exception as exc:  # noqa: BLE001 - a module __getattr__ that broke (vllm.envs)
        return f"cannot be read ({type(exc).__name__}: {exc})"
    if value is None:
        return "is missing"
    if entry.kind is not None and not isinstance(value, entry.kind):
        return f"is a {type(value).__name__}, not a {entry.kind.__name__}"
    if entry.params is not None:
        found = _signature_problem(value, entry.params, "it")
        if found is not None:
            return found
    for method, expected in entry.methods.items():
        found = _signature_problem(getattr(value, method, None), expected, f"its {method}")
        if found is not None:
            return found
    return None


def resolve(qualname: str) -> Any | None:
    """The fenced name `qualname` as vLLM has it now, or None when it is missing or changed
    (warned once per name and process, with what happens without it)."""
    entry = FENCED[qualname]
    why = problem(qualname)
    if why is None:
        return getattr(importlib.import_module(entry.module), entry.name)
    with _lock:
        first = qualname not in _warned
        _warned.add(qualname)
    if first:
        logger.warning("vllm_neuron: vLLM's %s %s; %s", qualname, why, entry.without)
    return None


def require(qualname: str) -> Any:
    """`resolve`, raising ImportError (naming the name) where a module cannot be defined
    without it; its importer catches that and degrades as `FENCED` says."""
    value = resolve(qualname)
    if value is None:
        raise ImportError(f"vLLM's {qualname} is not as vllm_neuron knows it "
                          f"({problem(qualname)}): {FENCED[qualname].without}")
    return value


def _forget() -> None:
    """Forget every warning (tests: a process starting anew)."""
    with _lock:
        _warned.clear()
