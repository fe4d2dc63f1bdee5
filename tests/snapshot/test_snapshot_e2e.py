"""End to end: compile through backend="vllm_neuron" (host toolchain, real Inductor), capture
a targeted decode step by token rule, replay it from the compile cache, then break it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from vllm_neuron.cli import main
from vllm_neuron.snapshot import SnapshotForwardContext, forward_context, reset_snapshot_config
from vllm_neuron.snapshot.bundles import list_bundles, load_bundle, open_snapshot_root
from vllm_neuron.snapshot.encoding import decode_tensor, encode_tensor

PROMPT_LEN = 7
TARGET_STEP = 3  # decode step k generates position PROMPT_LEN + k
REQ = "req-abc-1234abcd"


class TinyDecoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


@dataclass
class Run:
    root: Path
    cache_root: Path
    steps: list[torch.Tensor]  # the activations fed at each forward (prefill first)
    outputs: list[torch.Tensor]


@pytest.fixture(scope="module")
def decode_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    from vllm_neuron import assembly, envs

    cache_root = tmp_path_factory.mktemp("vllm-cache")
    env = {
        "VLLM_CACHE_ROOT": str(cache_root),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor")),
        "VLLM_NEURON_TOOLCHAIN": "host",
        "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_ENABLE": "1",
        "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_CAPTURE_TOKEN": str(PROMPT_LEN + TARGET_STEP),
        "VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_FORMAT": "npy",
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        mp.delenv("VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_DIR", raising=False)
        mp.delenv("VLLM_NEURON_MANIFEST_DIR", raising=False)
        mp.delenv("RANK", raising=False)
        envs.reset_for_tests()
        reset_snapshot_config()
        assembly.reset_runtime()
        torch._dynamo.reset()
        try:
            torch.manual_seed(0)
            model = TinyDecoder().eval()
            compiled = torch.compile(model, backend="vllm_neuron", dynamic=False)
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                compiled(torch.randn(1, 16, generator=gen))  # warm-up: compiles, not counted
                steps, outputs = [], []
                for step in range(6):
                    x = torch.randn(1, 16, generator=gen)
                    pos = 0 if step == 0 else PROMPT_LEN + step - 1
                    ctx = SnapshotForwardContext.build(step, [REQ], [pos], is_decode=step > 0)
                    with forward_context(ctx):
                        outputs.append(compiled(x))
                    steps.append(x)
                    torch.testing.assert_close(outputs[-1], model(x))
            yield Run(cache_root / "neuron" / "snapshots", cache_root, steps, outputs)
        finally:
            assembly.reset_runtime()
            torch._dynamo.reset()
            envs.reset_for_tests()
            reset_snapshot_config()


@pytest.mark.slow
def test_token_rule_captures_the_targeted_decode_step(decode_run: Run) -> None:
    listing = list_bundles(open_snapshot_root(str(decode_run.root)))
    (info,) = listing.bundles
    assert info.selected_by == ("token",)
    assert info.call_index == TARGET_STEP and info.global_step == TARGET_STEP
    bundle = load_bundle(open_snapshot_root(str(decode_run.root)), info.prefix)
    meta = bundle.meta
    assert meta.toolchain == "host" and meta.req_ids == [REQ]
    assert meta.matches[0].target == PROMPT_LEN + TARGET_STEP
    inputs = bundle.load_inputs()
    x = decode_run.steps[TARGET_STEP]
    assert any(isinstance(t, torch.Tensor) and torch.equal(t, x) for t in inputs)
    (out,) = bundle.load_outputs()
    assert torch.equal(out, decode_run.outputs[TARGET_STEP])
    # the compile cache entry the bundle names is there to replay from
    assert (decode_run.cache_root / "neuron" / "compile_cache" / meta.compilation_hash).is_dir()


@pytest.mark.slow
def test_replay_passes_then_a_perturbed_input_fails(
    decode_run: Run, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm_neuron import envs

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(decode_run.cache_root))
    envs.reset_for_tests()
    store = open_snapshot_root(str(decode_run.root))
    (info,) = list_bundles(store).bundles
    bundle_dir = decode_run.root / info.prefix

    for runner in ("auto", "eager"):
        code = main(["snapshot", "replay", str(bundle_dir), "--runner", runner])
        out = capsys.readouterr().out
        assert code == 0, out
        assert f"runner: {'cache' if runner == 'auto' else 'eager'}" in out
        assert "pass" in out and "PASS: 1 of 1" in out

    bundle = load_bundle(store, info.prefix)
    x = decode_run.steps[TARGET_STEP]
    index = next(i for i, t in enumerate(bundle.load_inputs())
                 if isinstance(t, torch.Tensor) and torch.equal(t, x))  # fmt: skip
    spec = bundle.meta.inputs[index]
    path = bundle_dir / (spec.file or "")
    original = path.read_bytes()
    try:
        t = decode_tensor(original, "npy", spec.dtype or "", spec.shape or []).clone()
        t[0, 5] += 0.25  # one element of the activation
        path.write_bytes(encode_tensor(t, "npy"))
        code = main(["snapshot", "replay", str(bundle_dir), "--runner", "cache"])
        out = capsys.readouterr().out
        assert code == 1, out
        assert "FAIL" in out
    finally:
        path.write_bytes(original)
    assert os.path.getsize(path) == len(original)
    assert main(["snapshot", "replay", str(bundle_dir)]) == 0




@pytest.mark.slow
def test_the_cache_runner_loads_as_a_serving_process_and_leaves_nothing_in_tmpdir(
    decode_run: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the entry's verified unpacked copy, as a hit loads: torch's own loader would
    leave an ``aotinductor_*`` directory in TMPDIR for every replay."""
    import tempfile

    from vllm_neuron.snapshot.runners import _cache_runner

    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    store = open_snapshot_root(str(decode_run.root))
    (info,) = list_bundles(store).bundles
    bundle = load_bundle(store, info.prefix)
    tier = decode_run.cache_root / "neuron" / "compile_cache"
    run = _cache_runner(bundle.meta.compilation_hash, str(tier))  # kept alive, as a server's
    assert callable(run)
    assert os.listdir(tmp_path / "tmp") == []
