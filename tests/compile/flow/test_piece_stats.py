"""`cache stats` counts what tensor parallelism cost: per piece of the model, the distinct
keys compiled for it, and the compiles beyond one per piece (per-rank variants).

The fold is checked on events as the cache writes them (through the real `Compiler` path
of a `TwoTierCache`), on an old segment whose lines predate pieces, and on events written
by real `CompileRuntime.compile(..., piece=...)` calls with the host toolchain, read back
by the command line in both its outputs.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from vllm_neuron.backends import RecordCodec, encode
from vllm_neuron.cli import main
from vllm_neuron.compile.entry.events import (
    CACHE_EVENTS,
    EVENTS_STREAM,
    CacheStats,
    Compiled,
    CompileFailed,
    read_stats,
)
from vllm_neuron.compile.flow.cache import TwoTierCache
from vllm_neuron.compile.runtime import CompileRuntime
from vllm_neuron.compile.toolchains.host import HostToolchain

FIRST = "[backbone] range 1-2048 subgraph 0"
SECOND = "[backbone] range 1-2048 subgraph 1"
K = [f"{i:032x}" for i in range(1, 7)]
OLD_EVENTS = Path(__file__).resolve().parents[1] / "data" / "records" / "events.jsonl"
EVENTS = RecordCodec(CACHE_EVENTS)  # how `read_stats` decodes each line


def compiled(key: str, piece: str = "") -> Compiled:
    return Compiled(key=key, at=0.0, seconds=1.0, toolchain="host", size=1, piece=piece)


def test_the_fold_counts_keys_beyond_one_per_piece() -> None:
    stats = CacheStats()
    for event in (
        compiled(K[1], FIRST),
        compiled(K[0], FIRST),  # two variants: one extra
        compiled(K[1], FIRST),  # the same key again (after an eviction): not extra
        compiled(K[2], SECOND),
        compiled(K[2], SECOND),  # one graph, compiled twice
        compiled(K[3]),
        compiled(K[4]),
    ):  # no piece: counted in neither
        stats.apply(event)
    assert stats.compiles == 7
    assert stats.pieces_compiled == 2 and stats.rank_specific_compiles == 1
    assert stats.keys_by_piece == {FIRST: [K[0], K[1]], SECOND: [K[2]]}  # keys sorted


def test_an_empty_fold_and_compiles_without_pieces_count_nothing() -> None:
    stats = CacheStats()
    assert (stats.pieces_compiled, stats.rank_specific_compiles, stats.keys_by_piece) == (0, 0, {})
    stats.apply(compiled(K[0])).apply(compiled(K[1]))
    assert (stats.pieces_compiled, stats.rank_specific_compiles, stats.keys_by_piece) == (0, 0, {})


def test_a_compile_without_piece_writes_the_line_it_always_wrote() -> None:
    line = json.loads(encode(compiled(K[0])))
    assert "piece" not in line and "v" not in line  # defaults are not written
    assert line == {
        "type": "compile",
        "key": K[0],
        "at": 0.0,
        "seconds": 1.0,
        "toolchain": "host",
        "size": 1,
    }
    assert json.loads(encode(compiled(K[0], FIRST)))["piece"] == FIRST
    assert EVENTS.decode(encode(compiled(K[0], FIRST))) == compiled(K[0], FIRST)


def test_an_old_line_without_piece_decodes_and_counts_no_piece(tmp_path: Path) -> None:
    old = [json.loads(line) for line in OLD_EVENTS.read_bytes().splitlines()]
    (line,) = [e for e in old if e["type"] == "compile"]
    assert "piece" not in line
    event = EVENTS.decode(json.dumps(line).encode())
    assert isinstance(event, Compiled) and event.piece == ""
    (failed,) = [e for e in old if e["type"] == "compile_failed"]
    failed_event = EVENTS.decode(json.dumps(failed).encode())
    assert isinstance(failed_event, CompileFailed) and failed_event.piece == ""
    os.makedirs(tmp_path / EVENTS_STREAM)
    (tmp_path / EVENTS_STREAM / "old.jsonl").write_bytes(OLD_EVENTS.read_bytes())
    stats = read_stats(str(tmp_path))
    assert stats.skipped_lines == 0 and stats.compiles == 1
    assert (stats.pieces_compiled, stats.rank_specific_compiles, stats.keys_by_piece) == (0, 0, {})


def test_the_cache_records_the_piece_on_compile_and_failure_events(tmp_path, compile_fn) -> None:
    d = str(tmp_path / "cache")
    rank0, rank1 = TwoTierCache(d), TwoTierCache(d)  # two processes' views of one node tier
    rank0.get_or_compile(K[0], compile_fn(K[0]), piece=FIRST)
    rank1.get_or_compile(K[1], compile_fn(K[1]), piece=FIRST)  # the piece's other variant
    rank0.get_or_compile(K[2], compile_fn(K[2]), piece=SECOND)
    assert rank1.get_or_compile(K[2], compile_fn(K[2]), piece=SECOND).source == "local"
    rank0.get_or_compile(K[3], compile_fn(K[3]))  # no piece (a plain torch.compile)
    with pytest.raises(ValueError, match="boom"):
        rank0.get_or_compile(K[4], compile_fn(K[4], fail="boom"), piece=SECOND)
    uncached = TwoTierCache(str(tmp_path / "off"), disabled=True)
    uncached.get_or_compile(K[5], compile_fn(K[5]), piece=SECOND)

    stats = read_stats(d)
    assert stats.compiles == 4 and stats.compile_failures == 1
    assert stats.keys_by_piece == {FIRST: [K[0], K[1]], SECOND: [K[2]]}  # a failure is no key
    assert (stats.pieces_compiled, stats.rank_specific_compiles) == (2, 1)
    events = [e for e in rank0.local_tier._events.read(CACHE_EVENTS).records
              if isinstance(e, CompileFailed)]  # fmt: skip
    assert [(e.key, e.piece) for e in events] == [(K[4], SECOND)]
    assert read_stats(str(tmp_path / "off")).keys_by_piece == {SECOND: [K[5]]}


# -- real compiles: what a TP=2 engine's ranks would leave in a node's cache -------------------


class Embed(torch.nn.Module):
    """A rank's bound baked into the graph as a constant, as vLLM's vocab-parallel
    embedding bakes each rank's vocabulary range into the first piece."""

    def __init__(self, start: int) -> None:
        super().__init__()
        self.start = start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - self.start


class Scale(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


@pytest.fixture(scope="module")
def tp_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, list[str]]]:
    """Ranks 0 and 1 compile two pieces into one tier: the first differs by rank, the
    second is one graph (rank 1 hits rank 0's entry). Returns the tier and the keys."""
    d = str(tmp_path_factory.mktemp("tp-cache"))
    x = [torch.zeros(4, 8)]
    scale = torch.fx.symbolic_trace(Scale())
    keys: dict[str, list[str]] = {FIRST: [], SECOND: []}
    for rank, start in ((0, 0), (1, 224)):
        runtime = CompileRuntime(TwoTierCache(d, defer_compiles=False), HostToolchain())
        _, first = runtime.compile(torch.fx.symbolic_trace(Embed(start)), x, piece=FIRST)
        _, second = runtime.compile(scale, x, piece=SECOND)
        assert (first.piece, second.piece) == (FIRST, SECOND)  # listeners see it too
        assert first.result.source == "compiled"
        assert second.result.source == ("compiled" if rank == 0 else "local")
        keys[FIRST].append(first.key)
        keys[SECOND].append(second.key)
    assert keys[FIRST][0] != keys[FIRST][1] and keys[SECOND][0] == keys[SECOND][1]
    return d, keys


def test_cache_stats_says_what_tp_cost(
    tp_cache: tuple[str, dict[str, list[str]]], capsys: pytest.CaptureFixture[str]
) -> None:
    d, keys = tp_cache
    assert main(["cache", "--cache-dir", d, "stats", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["compiles"] == 3
    assert (doc["pieces_compiled"], doc["rank_specific_compiles"]) == (2, 1)
    assert doc["keys_by_piece"] == {FIRST: sorted(keys[FIRST]), SECOND: [keys[SECOND][0]]}
    assert main(["cache", "--cache-dir", d, "stats"]) == 0
    human = capsys.readouterr().out
    assert re.search(
        r"^per-rank variants\s+1 extra compile\(s\) over 2 piece\(s\)$", human, re.MULTILINE
    ), human
