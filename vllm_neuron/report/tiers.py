"""Each compile-cache tier's entries, for the report: what `cache ls` shows, with the notes
left around them.

Why the inventory's reader and not the files: `compile.inventory.list_entries` knows the
publication protocol (a rename store's directories, S3's commit records), broken
publications and records that do not read, and checks every file's size as each local hit
does; read through the `Store`, a local tier, a remote folder and an ``s3://`` tier list
alike. Checksums are not read here: that is `cache verify`, which reads every byte.

An entry's problems are the inventory's (its record, its publication, its files' sizes),
the hosts that fetched it and could not load it (load-failure notes), and, for an entry
withdrawn from service, its quarantine note: a withdrawn entry is no longer published, so
its note is all that is left of it, and it is listed by that note. Both kinds are read
through the registry of per-key notes (`compile/entry/notes.py`: `LOAD_FAILURES`,
`QUARANTINE`), which says where each lives and how it reads.

The commit record does not name the piece of the model an entry is; the report knows it
where it was recorded: the local tiers' compile events (``Compiled.piece``) and the
engines' manifests (``graphs[].pieces``) - `piece_index`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vllm_neuron.backends import Record, Store, open_store
from vllm_neuron.compile.entry.notes import LOAD_FAILURES, QUARANTINE, QuarantineNote
from vllm_neuron.compile.tiers.inventory import list_entries
from vllm_neuron.compile.trust.policy import signer_of
from vllm_neuron.manifest.schema import Manifest

__all__ = ["EntryRow", "TierEntries", "piece_index", "read_entries"]


@dataclass(frozen=True)
class EntryRow:
    """One entry of a tier (or one withdrawn from it: `withdrawn` is when)."""

    key: str
    size: int = 0
    files: int = 0
    created: float = 0.0  # epoch seconds; 0 when the record does not read
    toolchain: str = "?"
    target: str = "?"
    pieces: tuple[str, ...] = ()
    signer: str | None = None  # the key id its entry.sig names (not verified here)
    problems: tuple[str, ...] = ()
    withdrawn: float | None = None  # quarantined at (epoch seconds): no longer published


@dataclass(frozen=True)
class TierEntries:
    """A tier's entries, problems first, then newest first; or why they could not be read."""

    rows: tuple[EntryRow, ...] = ()
    error: str | None = None

    @property
    def live(self) -> tuple[EntryRow, ...]:
        """The published entries (not the quarantined ones)."""
        return tuple(r for r in self.rows if r.withdrawn is None)

    def totals(self) -> dict[str, int]:
        """The numbers above the table (each a ``data-total`` on the page)."""
        live = self.live
        return {
            "entries": len(live),
            "bytes": sum(r.size for r in live),
            "with_problems": sum(1 for r in live if r.problems),
            "signed": sum(1 for r in live if r.signer is not None),
            "quarantined": len(self.rows) - len(live),
        }


def piece_index(events: Iterable[Record], manifests: Iterable[Manifest]) -> dict[str, set[str]]:
    """Key -> the pieces of the model it was compiled as, from compile events (a failed
    compile names its piece too) and manifests' graphs."""
    out: dict[str, set[str]] = {}
    for event in events:
        piece, key = getattr(event, "piece", ""), getattr(event, "key", "")
        if piece and key:
            out.setdefault(key, set()).add(piece)
    for manifest in manifests:
        for graph in manifest.graphs:
            for trace in graph.traces:
                out.setdefault(graph.graph_hash, set()).add(trace.piece.label())
    return out


def _order(row: EntryRow) -> tuple[int, float, str]:
    """Live entries with a problem, then quarantined ones, then the rest; newest first."""
    rank = 1 if row.withdrawn is not None else (0 if row.problems else 2)
    return rank, -(row.withdrawn or row.created), row.key


def _quarantined(store: Store, live: set[str]) -> list[QuarantineNote]:
    """The notes of entries withdrawn and not published again (a note that does not read
    is skipped: a report shows what it can)."""
    return [note for key, notes in QUARANTINE.read_all(store).items() if key not in live
            for note in notes]  # fmt: skip


def read_entries(location: str, pieces: Mapping[str, set[str]]) -> TierEntries:
    """The entries of the tier at `location`, through its store; `pieces` from
    `piece_index`. A tier that cannot be listed is an `error`, never a failed report."""
    try:
        store = open_store(location, create=False)
        listed = list_entries(store, sizes=True)
        notes = LOAD_FAILURES.read_all(store)
        rows = [
            EntryRow(key=e.key, size=e.size, files=e.files, created=e.created,
                     toolchain=e.toolchain, target=e.target,
                     pieces=tuple(sorted(pieces.get(e.key, ()))),
                     signer=signer_of(store, e.key),
                     problems=tuple([e.problem] if e.problem else [])
                     + tuple(f"did not load on {n.host}: {n.error}"
                             for n in notes.get(e.key, ())))
            for e in listed
        ]  # fmt: skip
        rows += [EntryRow(key=n.key, pieces=tuple(sorted(pieces.get(n.key, ()))),
                          problems=(f"quarantined: {n.reason}",), withdrawn=n.at)
                 for n in _quarantined(store, {e.key for e in listed})]  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - a report shows what it can read
        return TierEntries(error=f"{type(exc).__name__}: {exc}")
    return TierEntries(tuple(sorted(rows, key=_order)))
