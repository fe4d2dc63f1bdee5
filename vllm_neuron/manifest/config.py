"""The manifest's `config`: from a live vLLM `VllmConfig`, or from the caller without vLLM."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

from .schema import ManifestConfig, Topology


def jsonable(value: Any) -> Any:
    """Coerce anything into JSON-able builtins (unknown objects become their str)."""
    return json.loads(json.dumps(value, default=str))


def vllm_config_to_json(vllm_config: Any) -> dict[str, Any]:
    """The full resolved VllmConfig, JSON-coerced with vLLM's own recipe: pydantic's
    ``TypeAdapter`` of the config's class, dumped in JSON mode with ``str`` as the fallback."""
    try:
        # Lazy: pydantic (vLLM's) is heavy and optional; only this path needs it.
        from pydantic import TypeAdapter

        dumped = TypeAdapter(type(vllm_config)).dump_python(vllm_config, mode="json", fallback=str)
        return dict(jsonable(dumped))
    except Exception:  # noqa: BLE001 - fall back to attribute walking on odd versions
        return dict(jsonable(_walk(vllm_config, depth=0)))


def _walk(obj: Any, depth: int) -> Any:
    if depth > 6 or obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, Mapping):
        return {str(k): _walk(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_walk(v, depth + 1) for v in obj]
    fields = getattr(obj, "__dataclass_fields__", None) or getattr(obj, "__dict__", None)
    if fields:
        return {k: _walk(getattr(obj, k, None), depth + 1) for k in fields if not k.startswith("_")}
    return str(obj)


def _get(obj: Any, *path: str, default: Any = None) -> Any:
    for name in path:
        obj = getattr(obj, name, None)
        if obj is None:
            return default
    return obj


def config_from_vllm(
    vllm_config: Any, *, target: str, neuron_config: Mapping[str, Any] | None = None
) -> ManifestConfig:
    """Model, parallelism and the resolved configs of a live engine."""
    parallel = _get(vllm_config, "parallel_config")
    tp = int(_get(parallel, "tensor_parallel_size", default=1))
    pp = int(_get(parallel, "pipeline_parallel_size", default=1))
    dp = int(_get(parallel, "data_parallel_size", default=1))
    dcp = int(_get(parallel, "decode_context_parallel_size", default=1))
    world = int(_get(parallel, "world_size", default=tp * pp))
    ep = tp * dp if _get(parallel, "enable_expert_parallel", default=False) else 1
    model_config = _get(vllm_config, "model_config")
    topology = Topology(
        world_size=world,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        data_parallel_size=dp,
        attention_dp_size=dp,
        ep_degree=ep,
        decode_context_parallel_size=dcp,
        has_collectives=world > 1,
    )
    return ManifestConfig(
        model=str(_get(model_config, "model", default="")),
        target=target,
        dtype=str(_get(model_config, "dtype", default="")),
        max_num_seqs=_get(vllm_config, "scheduler_config", "max_num_seqs"),
        max_model_len=_get(model_config, "max_model_len"),
        topology=topology,
        neuron_config=dict(jsonable(dict(neuron_config or {}))),
        vllm_config=vllm_config_to_json(vllm_config),
    )


def config_from_mapping(values: Mapping[str, Any]) -> ManifestConfig:
    """A config supplied by the caller (no vLLM): the keys of the manifest's ``config``
    (docs/manifest.md), JSON-coerced."""
    return msgspec.convert(jsonable(dict(values)), ManifestConfig)
