"""Which deployment an engine is (plugin/deployment.py): what makes its graphs is in the
digest, where the model was loaded from and what differs between pods is not."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from vllm_neuron.plugin.deployment import deployment_of, rank_in_deployment, ranks_of


class _HfConfig:
    def __init__(self, **values: Any) -> None:
        self.values = values

    def to_dict(self) -> dict[str, Any]:
        return dict(self.values)


def _config(*, path: str = "/models/a", tp: int = 2, hidden: int = 128,
            dtype: str = "float32", mode: int = 3, batched: int = 2048,
            endpoints: list[int] | None = None, max_len: int = 512) -> Any:  # fmt: skip
    hf = _HfConfig(_name_or_path=path, hidden_size=hidden, architectures=["LlamaForCausalLM"],
                   transformers_version="4.0")  # fmt: skip
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf, dtype=dtype, max_model_len=max_len,
                                     model=path),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=batched),
        compilation_config=SimpleNamespace(mode=mode, compile_sizes=[],
                                           compile_ranges_endpoints=endpoints),
    )


def test_pods_of_one_deployment_share_it_and_what_makes_graphs_changes_it():
    one = deployment_of(_config())
    assert one is not None and len(one) == 32 and int(one, 16) >= 0
    assert deployment_of(_config(path="/elsewhere/a-copy")) == one  # another pod's path
    for change in ({"tp": 1}, {"hidden": 256}, {"dtype": "bfloat16"}, {"mode": 0},
                   {"max_len": 4096}):
        assert deployment_of(_config(**change)) != one, change


def test_a_configuration_that_cannot_be_read_is_no_deployment():
    for remove in ("model_config.hf_config", "compilation_config.compile_sizes"):
        broken = _config()
        owner, name = remove.split(".")
        delattr(getattr(broken, owner), name)
        assert deployment_of(broken) is None, remove
    assert deployment_of(object()) is None


@pytest.mark.parametrize(("rank", "within"), [(0, 0), (1, 1), (2, 0), (5, 1)])
def test_data_parallel_engines_share_their_ranks_records(rank, within):
    assert ranks_of(_config()) == 2
    assert rank_in_deployment(_config(), rank) == within
