"""Fold an engine's ledger: one graph per key, with the global ranks that traced it.

The fold works a segment at a time, because a segment has exactly one writer and a
writer's lines carry one TP rank: such a segment adds that one rank to every key it names.
The ranks of a TP group trace the same graphs, so their segments name the same set of keys
and are merged as one set operation per segment instead of one per line; decoding reads
only ``key``/``rank``/``global_rank`` (the decoder skips the rest without building it), and
a key's details (input shapes, compiler flags) are decoded only from the first segment
that names it. A segment whose lines carry several ranks is folded line by line. Either
way the result is the same: for every key, the union of the mapped ranks of its lines,
and the details of its first line (segment order, then line order). Ranks are kept per
(key, piece) pair, because one graph can be several pieces of the model and a rank may
trace it as one of them only; a key's ranks are the union over its pairs, and lines that
name no piece add to the key's ranks only.

Only the segments of one engine run are folded (``ledger/<prefix>/<run>/``, every process of
the run writes there): a segment of any other run under the prefix, such as one left by a
server killed before its emit, is not read, and is reported in ``LedgerFold.stale`` for the
emit to remove.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import countOf

from vllm_neuron.backends import Record, RecordCodec, Store, join
from vllm_neuron.envs import run_id

from .ledger import LEDGER_DIR, LedgerEntry, ledger_stream
from .schema import Piece, PieceTrace

SEGMENT_SUFFIX = ".jsonl"


class LedgerKey(Record, frozen=True, tag="ledger"):
    """The fold's view of a ledger line: who traced which graph, nothing else."""

    key: str
    rank: int
    global_rank: int | None = None
    piece: Piece | None = None


_KEYS = RecordCodec([LedgerKey])
_LINES = RecordCodec([LedgerEntry])
_KEY_OF = operator.attrgetter("key")
_RANK_OF = operator.attrgetter("rank")
_GLOBAL_RANK_OF = operator.attrgetter("global_rank")
_PIECE_OF = operator.attrgetter("piece")
_Traced = tuple[str, Piece | None]  # (key, piece) of a line


@dataclass(frozen=True)
class FoldedGraph:
    """One key of the ledger: its first line's details, the sorted global ranks, and the
    pieces its lines named, each with the sorted global ranks that traced it as that piece."""

    input_shapes: list[str]
    compiler_flags: str
    ranks: list[int]
    has_details: bool = True
    pieces: list[PieceTrace] = field(default_factory=list)


@dataclass
class LedgerFold:
    """The state of a fold; feed it segments with `add_segment`, then read `graphs()`."""

    tp_ranks: Sequence[int] | None = None
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    # Segments under the prefix that belong to other runs (keys), left out of the fold.
    stale: list[str] = field(default_factory=list)
    _by_keys: dict[frozenset[_Traced], set[int]] = field(default_factory=dict)
    _by_key: dict[_Traced, set[int]] = field(default_factory=dict)
    _details: dict[str, LedgerEntry] = field(default_factory=dict)

    def global_rank(self, rank: int, global_rank: int | None) -> int:
        """A line's global rank: the writer's own record of it, else its TP-local rank
        mapped through the TP group's global ranks (unmapped when out of range)."""
        if global_rank is not None:
            return global_rank
        mapping = self.tp_ranks
        if mapping is not None and 0 <= rank < len(mapping):
            return int(mapping[rank])
        return rank

    def add_segment(self, data: bytes, name: str = "") -> None:
        """Fold one segment's bytes (every line of one writer)."""
        decoded = _KEYS.decode_lines(data)
        if decoded.skipped:
            self.skipped += decoded.skipped
            self.errors.extend(f"{name} {error}".strip() for error in decoded.errors[:3])
        views: list[LedgerKey] = decoded.records
        if not views:
            return
        keys = frozenset(map(_KEY_OF, views))
        if not self._details.keys() >= keys:
            self._add_details(data)
        first, count = views[0], len(views)
        if (
            countOf(map(_RANK_OF, views), first.rank) == count
            and countOf(map(_GLOBAL_RANK_OF, views), first.global_rank) == count
        ):
            # One writer, one rank (the usual segment): one set operation for all its keys.
            rank = self.global_rank(first.rank, first.global_rank)
            traced = frozenset(zip(map(_KEY_OF, views), map(_PIECE_OF, views), strict=True))
            self._by_keys.setdefault(traced, set()).add(rank)
            return
        by_key, mapped = self._by_key, self.global_rank
        for view in views:
            pair = (view.key, view.piece)
            ranks = by_key.get(pair)
            if ranks is None:
                ranks = by_key[pair] = set()
            ranks.add(mapped(view.rank, view.global_rank))

    def _add_details(self, data: bytes) -> None:
        details = self._details
        for entry in _LINES.decode_lines(data).records:
            if entry.key not in details:
                details[entry.key] = entry

    def graphs(self) -> dict[str, FoldedGraph]:
        """Every key folded so far (a key whose lines carried no decodable details keeps
        its ranks, with empty shapes and flags and ``has_details`` False)."""
        traced: dict[_Traced, set[int]] = {}
        groups: list[tuple[frozenset[_Traced] | tuple[_Traced], set[int]]] = list(
            self._by_keys.items()
        )
        groups += [((pair,), r) for pair, r in self._by_key.items()]
        for pairs, group_ranks in groups:
            for pair in pairs:
                have = traced.get(pair)
                # Shared until a second group names the pair (never mutated in place).
                traced[pair] = group_ranks if have is None else have | group_ranks
        ranks: dict[str, set[int]] = {}
        pieces: dict[str, list[PieceTrace]] = {}
        for (key, piece), pair_ranks in traced.items():
            have = ranks.get(key)
            ranks[key] = pair_ranks if have is None else have | pair_ranks
            if piece is not None:
                pieces.setdefault(key, []).append(PieceTrace(piece=piece,
                                                             ranks=sorted(pair_ranks)))
        ordered: dict[int, list[int]] = {}  # id(set) -> sorted, once per distinct set
        out: dict[str, FoldedGraph] = {}
        for key, key_ranks in ranks.items():
            sorted_ranks = ordered.get(id(key_ranks))
            if sorted_ranks is None:
                sorted_ranks = ordered[id(key_ranks)] = sorted(key_ranks)
            key_pieces = sorted(pieces.get(key, ()), key=_PIECE_OF)
            entry = self._details.get(key)
            if entry is None:
                out[key] = FoldedGraph([], "", list(sorted_ranks), has_details=False,
                                       pieces=key_pieces)
            else:
                out[key] = FoldedGraph(entry.input_shapes, entry.compiler_flags,
                                       list(sorted_ranks), pieces=key_pieces)
        return out


def fold_ledger(
    store: Store,
    prefix: str,
    tp_ranks: Sequence[int] | None = None,
    *,
    run: str | None = None,
) -> LedgerFold:
    """Fold every segment of run `run` (default: this process's run) of engine `prefix`.

    One listing of the whole prefix (one request on a remote store) serves both sides: this
    run's segments are read and folded, every other segment is only named in ``stale``.
    """
    mine = ledger_stream(prefix, run_id() if run is None else run) + "/"
    fold = LedgerFold(tp_ranks=tp_ranks)
    for key in store.list(join(LEDGER_DIR, prefix)):
        if not key.endswith(SEGMENT_SUFFIX):
            continue
        if not key.startswith(mine) or "/" in key[len(mine):]:
            fold.stale.append(key)
            continue
        data = store.read(key)
        if data:
            fold.add_segment(data, key)
    return fold
