"""vllm_neuron.compile.key.cache_key: canonical, process-independent cache keys."""

from __future__ import annotations

import json
import operator
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx
from hypothesis import given
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from vllm_neuron.compile.key.cache_key import (
    COMPONENTS,
    CacheKey,
    compute_cache_key,
    explain_key_difference,
)
from vllm_neuron.compile.key.compiler_args import canonicalize_compiler_args
from vllm_neuron.compile.key.graph_canon import KeyComputationError, graph_digest, normalize_device

PROJECT_ROOT = Path(__file__).resolve().parents[3]

# Module definitions shared verbatim with the subprocess of the determinism test.
MODELS_SRC = textwrap.dedent(
    """
    import torch

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = torch.nn.Linear(8, 8)
            self.l2 = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = torch.relu(self.l1(x))
            return self.l2(h), h.sum()

    class WithBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.arange(8, dtype=torch.float32))

        def forward(self, x):
            return x * self.scale + 1

    def dynamo_graph(model, *inputs):
        captured = []

        def backend(gm, example_inputs):
            captured.append((gm, list(example_inputs)))
            return gm.forward

        torch._dynamo.reset()
        torch.compile(model, backend=backend)(*inputs)
        return captured[0]
    """
)
_models: dict[str, Any] = {}
exec(compile(MODELS_SRC, "<models>", "exec"), _models)
MLP: Callable[[], torch.nn.Module] = _models["MLP"]
WithBuffer: Callable[[], torch.nn.Module] = _models["WithBuffer"]
dynamo_graph: Callable[..., tuple[torch.fx.GraphModule, list[Any]]] = _models["dynamo_graph"]

KEY_ARGS: dict[str, Any] = dict(
    toolchain_versions={"torch": "2.13.0", "neuronx-cc": "2.0"},
    compiler_args=["--model-type=transformer", "-O1"],
    target="trn2",
    replica_groups=[[0, 1], [2, 3]],
)


def key_of(gm: torch.fx.GraphModule, inputs: Sequence[Any], **overrides: Any) -> CacheKey:
    return compute_cache_key(gm, inputs, **{**KEY_ARGS, **overrides})


@pytest.fixture(scope="module")
def mlp_graph() -> tuple[torch.fx.GraphModule, list[Any]]:
    torch.manual_seed(0)
    return dynamo_graph(MLP(), torch.randn(4, 8))


def test_key_shape(mlp_graph: tuple[torch.fx.GraphModule, list[Any]]) -> None:
    k = key_of(*mlp_graph)
    assert len(k.key) == 32 and all(c in "0123456789abcdef" for c in k.key)
    assert list(k.components) == list(COMPONENTS)
    assert all(len(v) == 32 for v in k.components.values())


def test_key_is_identical_in_a_separate_process(
    mlp_graph: tuple[torch.fx.GraphModule, list[Any]], tmp_path: Path
) -> None:
    """Ids, addresses, hash seeds and allocation order differ; the key must not."""
    torch.manual_seed(0)
    buffer_gm = torch.fx.symbolic_trace(WithBuffer())
    here = {
        "mlp": key_of(*mlp_graph).key,
        "buffer": key_of(buffer_gm, [torch.zeros(4, 8)]).key,
    }
    script = tmp_path / "child.py"
    script.write_text(
        MODELS_SRC
        + textwrap.dedent(
            f"""
            import json, sys
            from vllm_neuron.compile.key.cache_key import compute_cache_key
            junk = [torch.empty(n) for n in range(1, 50)]  # shift allocations and ids
            kw = json.loads({json.dumps(json.dumps(KEY_ARGS))})
            torch.manual_seed(0)
            gm, ex = dynamo_graph(MLP(), torch.randn(4, 8))
            torch.manual_seed(0)
            bgm = torch.fx.symbolic_trace(WithBuffer())
            print(json.dumps({{
                "mlp": compute_cache_key(gm, ex, **kw).key,
                "buffer": compute_cache_key(bgm, [torch.zeros(4, 8)], **kw).key,
            }}))
            """
        )
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(PROJECT_ROOT)}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def test_parameters_that_are_graph_inputs_do_not_change_the_key() -> None:
    """Dynamo lifts parameters to inputs: their values are runtime data, not program."""
    torch.manual_seed(0)
    a = key_of(*dynamo_graph(MLP(), torch.randn(4, 8)))
    torch.manual_seed(1)
    b = key_of(*dynamo_graph(MLP(), torch.randn(4, 8)))
    assert a == b


def test_shape_change_changes_graph_and_inputs() -> None:
    torch.manual_seed(0)
    a = key_of(*dynamo_graph(MLP(), torch.randn(4, 8)))
    b = key_of(*dynamo_graph(MLP(), torch.randn(2, 8)))
    assert explain_key_difference(a, b) == ["graph", "inputs"]


def test_weights_baked_in_through_get_attr_are_hashed() -> None:
    m = WithBuffer()
    gm = torch.fx.symbolic_trace(m)
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    before = key_of(gm, [torch.zeros(4, 8)])
    assert key_of(torch.fx.symbolic_trace(WithBuffer()), [torch.zeros(4, 8)]) == before
    scale = gm.get_buffer("scale")
    with torch.no_grad():
        scale[3] += 1e-3
    after = key_of(gm, [torch.zeros(4, 8)])
    assert explain_key_difference(before, after) == ["graph"]


def test_weights_of_called_submodules_are_hashed() -> None:
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(MLP())
    assert any(n.op == "call_module" for n in gm.graph.nodes)
    before = graph_digest(gm)
    torch.manual_seed(0)
    assert graph_digest(torch.fx.symbolic_trace(MLP())) == before
    bias = gm.get_parameter("l2.bias")
    with torch.no_grad():
        bias[0] += 1.0
    assert graph_digest(gm) != before


def test_bf16_and_bool_constants_are_hashed() -> None:
    for dtype in (torch.bfloat16, torch.bool, torch.int64):
        g = WithBuffer()
        g.scale = torch.ones(8, dtype=dtype)
        gm = torch.fx.symbolic_trace(g)
        other = WithBuffer()
        other.scale = torch.zeros(8, dtype=dtype)
        assert graph_digest(gm) != graph_digest(torch.fx.symbolic_trace(other))


def _device_graph(device: Any, kw_device: str) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ones, (4,), {"device": device})
    z = graph.call_function(torch.Tensor.to, (x, kw_device))
    graph.output(graph.call_function(operator.add, (y, z)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_device_index_is_not_part_of_the_key() -> None:
    inputs = [torch.zeros(4)]
    rank0 = key_of(_device_graph(torch.device("xla:0"), "neuron:0"), inputs)
    rank3 = key_of(_device_graph(torch.device("xla:3"), "neuron:3"), inputs)
    bare = key_of(_device_graph(torch.device("xla"), "neuron"), inputs)
    cpu = key_of(_device_graph(torch.device("cpu"), "neuron:3"), inputs)
    assert rank0 == rank3 == bare
    assert explain_key_difference(rank0, cpu) == ["graph"]


@pytest.mark.parametrize(
    "given_,expected",
    [
        ("neuron:7", "neuron:0"),
        ("cuda:1", "cuda:0"),
        ("xla:2", "xla:0"),
        ("privateuseone:5", "privateuseone:0"),
        ("neuron", "neuron:0"),
        ("cpu", "cpu"),
        ("neuron:x", "neuron:x"),
        ("my_neuron:1", "my_neuron:1"),
    ],
)
def test_normalize_device(given_: str, expected: str) -> None:
    assert normalize_device(given_) == expected


def test_provenance_metadata_is_ignored_but_value_metadata_counts(
    mlp_graph: tuple[torch.fx.GraphModule, list[Any]],
) -> None:
    torch.manual_seed(0)
    gm, inputs = dynamo_graph(MLP(), torch.randn(4, 8))
    before = graph_digest(gm)
    for node in gm.graph.nodes:
        node.meta["stack_trace"] = f"File /home/rank{id(node)}/model.py, line 1"
        node.meta["nn_module_stack"] = {"x": (str(id(node)), object)}
        node.meta["seq_nr"] = id(node)
    assert graph_digest(gm) == before
    relu = next(n for n in gm.graph.nodes if n.name == "h")
    relu.meta["example_value"] = relu.meta["example_value"].to(torch.float16)
    assert graph_digest(gm) != before


def test_input_metadata_dtype_shape_stride_but_not_requires_grad() -> None:
    gm = torch.fx.symbolic_trace(WithBuffer())
    base = key_of(gm, [torch.zeros(4, 8)])
    assert key_of(gm, [torch.zeros(4, 8, requires_grad=True)]) == base
    assert key_of(gm, [torch.ones(4, 8)]) == base  # values of inputs are runtime data
    for other in (
        torch.zeros(4, 8, dtype=torch.float16),
        torch.zeros(2, 8),
        torch.zeros(8, 4).t(),  # same shape, transposed strides
    ):
        assert explain_key_difference(base, key_of(gm, [other])) == ["inputs"]


def test_symbolic_input_sizes_use_their_symbolic_name() -> None:
    def fake(shape: tuple[int, ...]) -> torch.Tensor:
        mode = FakeTensorMode(shape_env=ShapeEnv())
        ctx: StatelessSymbolicContext[Any, Any] = StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]
        )
        return mode.from_tensor(torch.zeros(shape), symbolic_context=ctx)

    gm = torch.fx.symbolic_trace(WithBuffer())
    a, b = fake((4, 8)), fake((6, 8))
    assert isinstance(a.shape[0], torch.SymInt)
    assert key_of(gm, [a]) == key_of(gm, [b])  # both "s0, 8"
    assert key_of(gm, [a]) != key_of(gm, [torch.zeros(4, 8)])


def test_other_components_are_isolated(mlp_graph: tuple[torch.fx.GraphModule, list[Any]]) -> None:
    base = key_of(*mlp_graph)
    cases: dict[str, dict[str, Any]] = {
        "versions": {"toolchain_versions": {"torch": "2.13.0", "neuronx-cc": "2.1"}},
        "compiler_args": {"compiler_args": ["--model-type=transformer", "-O2"]},
        "target": {"target": "trn1"},
        "replica_groups": {"replica_groups": [[0, 2], [1, 3]]},
    }
    for component, override in cases.items():
        other = key_of(*mlp_graph, **override)
        assert other.key != base.key
        assert explain_key_difference(base, other) == [component]
    assert explain_key_difference(base, key_of(*mlp_graph, replica_groups=None)) == [
        "replica_groups"
    ]


def test_explain_key_difference_reports_missing_components() -> None:
    a = {"graph": "1", "inputs": "2", "extra": "x"}
    b = {"graph": "1", "inputs": "3", "target": "t"}
    assert explain_key_difference(a, b) == ["inputs", "target", "extra"]
    assert explain_key_difference(a, dict(a)) == []


def test_lambdas_with_the_same_name_do_not_collide() -> None:
    def graph_with(fn: Callable[[Any], Any]) -> torch.fx.GraphModule:
        graph = torch.fx.Graph()
        graph.output(graph.call_function(fn, (graph.placeholder("x"),)))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    fns = [lambda x: x + 1, lambda x: x * 2]
    assert graph_digest(graph_with(fns[0])) != graph_digest(graph_with(fns[1]))


def test_unfingerprintable_arguments_fail_loudly() -> None:
    graph = torch.fx.Graph()
    add = graph.call_function(operator.add, (graph.placeholder("x"), 1))
    graph.output(add)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    add.args = (add.args[0], object())  # type: ignore[assignment]  # after codegen
    with pytest.raises(KeyComputationError, match="builtins.object"):
        graph_digest(gm)


def test_cache_key_survives_msgspec_roundtrip(
    mlp_graph: tuple[torch.fx.GraphModule, list[Any]],
) -> None:
    import msgspec

    k = key_of(*mlp_graph)
    assert msgspec.json.decode(msgspec.json.encode(k), type=CacheKey) == k


# Compiler arguments ------------------------------------------------------------------------

_flag_names = st.lists(
    st.from_regex(r"--[a-z][a-z0-9-]{0,10}", fullmatch=True).filter(
        lambda f: (
            f.replace("_", "-")
            not in {"--output", "--logfile", "--log-file", "--workdir", "--work-dir", "--cache-dir"}
        )
    ),
    min_size=1,
    max_size=6,
    unique=True,
)
_values = st.one_of(st.none(), st.from_regex(r"[A-Za-z0-9_.,/]{1,8}", fullmatch=True))


def _render(units: list[tuple[str, str | None]], styles: list[bool]) -> list[str]:
    args: list[str] = []
    for (flag, value), joined in zip(units, styles, strict=True):
        if value is None:
            args.append(flag)
        elif joined:
            args.append(f"{flag}={value}")
        else:
            args.extend([flag, value])
    return args


@given(
    flags=_flag_names,
    data=st.data(),
)
def test_compiler_args_canonical_form_ignores_order_style_and_output_flags(
    flags: list[str], data: st.DataObject
) -> None:
    units = [(f, data.draw(_values)) for f in flags]
    styles_a = data.draw(st.lists(st.booleans(), min_size=len(units), max_size=len(units)))
    styles_b = data.draw(st.lists(st.booleans(), min_size=len(units), max_size=len(units)))
    shuffled = data.draw(st.permutations(list(zip(units, styles_b, strict=True))))
    outputs = data.draw(
        st.lists(
            st.tuples(
                st.sampled_from(["--output", "--logfile", "--workdir", "--cache_dir"]),
                st.from_regex(r"/[a-z0-9/]{1,12}", fullmatch=True),
                st.booleans(),
            ),
            max_size=3,
        )
    )
    a = _render(units, styles_a)
    b = _render([u for u, _ in shuffled], [s for _, s in shuffled])
    for flag, path, joined in outputs:
        b = [*b, f"{flag}={path}"] if joined else [flag, path, *b]
    assert canonicalize_compiler_args(a) == canonicalize_compiler_args(b)
    # ...and a changed value is a different canonical form.
    valued = [i for i, (_, v) in enumerate(units) if v is not None]
    if valued:
        i = valued[0]
        changed = list(units)
        changed[i] = (units[i][0], f"{units[i][1]}x")
        assert canonicalize_compiler_args(_render(changed, styles_a)) != (
            canonicalize_compiler_args(a)
        )


def test_compiler_args_examples() -> None:
    assert canonicalize_compiler_args(
        ["-O1", "--model-type", "transformer", "--output", "/tmp/r3/x.neff", "--auto-cast=none"]
    ) == ["--auto-cast=none", "--model-type=transformer", "-O1"]
    # A negative number is a value, not a flag.
    assert canonicalize_compiler_args(["--shift", "-1"]) == ["--shift=-1"]
    # Machine-specific paths in other flags are kept: they may change the program.
    assert canonicalize_compiler_args(["--config", "/etc/a.json"]) == ["--config=/etc/a.json"]


# Speed -------------------------------------------------------------------------------------


class _Chain(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(333):
            x = torch.relu(x * 1.5 + 1.0)
        return x


def test_key_time_for_a_1000_node_graph(capsys: pytest.CaptureFixture[str]) -> None:
    gm, inputs = dynamo_graph(_Chain(), torch.randn(4, 8))
    assert len(gm.graph.nodes) >= 1000
    start = time.perf_counter()
    rounds = 5
    for _ in range(rounds):
        key_of(gm, inputs)
    per_key = (time.perf_counter() - start) / rounds
    with capsys.disabled():
        print(f"\n[key] {len(gm.graph.nodes)}-node dynamo graph: {per_key * 1000:.1f} ms per key")
