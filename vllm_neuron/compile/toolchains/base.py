"""What a toolchain is: FX graph in, artifact directory out, callable back.

The cache key, the locks, the tiers and the manifest never look inside an artifact; they
need only the four things this interface provides: the versions and flags that go into
the key, a ``compile`` that writes files into a directory the cache then publishes, and a
``load`` that turns a published directory back into a callable. Everything device-specific
stays behind it.

The metadata a compile returns (:class:`CompiledArtifact`) is a record of the storage
layer (tagged, versioned, frozen) so the cache can persist it with the files, as the
``meta`` of the entry's commit record, and hand it back to ``load`` in another process, on
another node, without pickling; `ARTIFACTS` reads it back (metadata written before records
were tagged reads as version 1).
"""

from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal, Protocol

from vllm_neuron.backends.records import Record, RecordCodec, Untagged
from vllm_neuron.compile.toolchains.torch_internals import FENCED, resolve

__all__ = [
    "ARTIFACTS",
    "CompiledArtifact",
    "CompilerKilled",
    "LoweredGraph",
    "Toolchain",
    "ToolchainError",
    "ToolchainKind",
    "ToolchainUnavailable",
    "format_shape",
    "require_torch",
    "restore_output_structure",
]

ToolchainKind = Literal["host", "neuron"]
ARTIFACT_TAG = "compiled-artifact"


class ToolchainError(RuntimeError):
    """A toolchain failed to compile or load a graph."""


class CompilerKilled(ToolchainError):
    """The compiler's process was ended by a signal (most often the kernel's out-of-memory
    killer, when compiles side by side took the node's memory): the node's fault at that
    moment, not the graph's - no failure note; the graph is compiled again in place."""


class ToolchainUnavailable(ToolchainError):
    """The toolchain's packages are not installed; the message says what to install."""


def require_torch(qualname: str) -> Any:
    """The fenced torch name `qualname` (toolchains/torch_internals.py), for a use torch
    gives no fallback for: ToolchainUnavailable naming it when it is missing or changed."""
    value = resolve(qualname)
    if value is None:
        raise ToolchainUnavailable(f"torch's private {qualname} is missing or changed (see "
                                   f"the warning): {FENCED[qualname].without}")
    return value


class CompiledArtifact(Record, frozen=True, kw_only=True, tag=ARTIFACT_TAG):
    """Metadata of one compiled graph, stored with its files.

    ``files`` are names relative to the entry directory (the entry moves between tiers).
    ``output_shapes`` has one string per flat output, ``"4, 8"`` style, ``""`` for a
    scalar. ``out_spec`` is the output pytree spec (``torch.utils._pytree.treespec_dumps``)
    so ``load`` returns the structure the graph returns, whatever the runtime hands back.
    """

    toolchain: str
    target: str
    files: tuple[str, ...]
    output_shapes: tuple[str, ...]
    out_spec: str
    num_inputs: int
    hlo_file: str | None = None
    # Positions of integer inputs (symbolic sizes, e.g. vLLM's token count) that the
    # compiled program reads from its tensor inputs' shapes instead; the loaded callable
    # takes all ``num_inputs`` and drops these.
    derived_inputs: tuple[int, ...] = ()
    # The CPU features the artifact's code may use (host: /proc/cpuinfo flags of the target
    # it was compiled for, cpu_target.py); a node lacking one never loads it.
    requires: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in (*self.files, *([self.hlo_file] if self.hlo_file else [])):
            parts = name.replace("\\", "/").split("/")
            if not name or os.path.isabs(name) or ".." in parts:
                raise ValueError(f"artifact file name {name!r} must be relative to the entry")


ARTIFACTS = RecordCodec(
    CompiledArtifact,
    untagged=Untagged(ARTIFACT_TAG, 1, "artifact metadata from before records had tags"),
)
"""Reads a `CompiledArtifact`: ``decode`` from bytes, ``convert`` from an entry's ``meta``."""


def format_shape(shape: Sequence[Any]) -> str:
    """``(4, 8)`` -> ``"4, 8"``; ``()`` -> ``""``; symbolic sizes keep their name."""
    return ", ".join(str(d) for d in shape)


def restore_output_structure(result: Any, out_spec: str, expected_leaves: int) -> Any:
    """Re-shape a runtime's outputs into the graph's recorded output structure.

    Runtimes differ in what they hand back (a list, a tuple, a bare tensor for one
    output); a torch.compile backend must return exactly what the graph returns. The
    leaves are flattened, counted against the compile-time arity, and re-packed.
    """
    treespec_loads, tree_leaves, tree_unflatten = _pytree()
    spec = treespec_loads(out_spec)
    leaves = tree_leaves(result)
    if len(leaves) != expected_leaves or spec.num_leaves != expected_leaves:
        raise ToolchainError(
            f"compiled graph returned {len(leaves)} outputs, expected {expected_leaves}"
        )
    return tree_unflatten(leaves, spec)


@functools.cache
def _pytree() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """torch's pytree functions a graph's every call uses (read once: a hot path)."""
    return (require_torch("torch.utils._pytree.treespec_loads"),
            require_torch("torch.utils._pytree.tree_leaves"),
            require_torch("torch.utils._pytree.tree_unflatten"))  # fmt: skip


class LoweredGraph(Protocol):
    """A graph `Toolchain.lower` has prepared for its compiler."""

    def compile(self, out_dir: str) -> CompiledArtifact:
        """Run the compiler, writing every artifact file into ``out_dir`` (as
        `Toolchain.compile` does); safe to call from any thread."""
        ...


class Toolchain(ABC):
    """Turns a traced FX graph into an artifact directory and loads it back."""

    name: ClassVar[ToolchainKind]
    target: str

    @abstractmethod
    def versions(self) -> dict[str, str]:
        """Versions of everything whose change makes old artifacts unusable."""

    @abstractmethod
    def compiler_args(self) -> list[str]:
        """The flags this toolchain compiles with (canonicalised by the key)."""

    @abstractmethod
    def compile(self, gm: Any, example_inputs: Sequence[Any], out_dir: str) -> CompiledArtifact:
        """Compile ``gm`` for ``example_inputs``, writing every artifact file into
        ``out_dir`` (which the caller then publishes atomically)."""

    def lower(self, gm: Any, example_inputs: Sequence[Any], work_dir: str) -> LoweredGraph | None:
        """The part of `compile` that must run where ``gm`` was traced (in the tracing
        thread), its results kept in ``work_dir``; the rest - the compiler, a process of its
        own - is the returned graph's `LoweredGraph.compile`, which any thread may run, so
        a process traces on while its graphs compile (compile/flow/cache.py,
        `TwoTierCache.begin`). None: this toolchain compiles only in one piece (`compile`)."""
        return None

    @abstractmethod
    def load(self, entry_dir: str, meta: CompiledArtifact) -> Callable[..., Any]:
        """A callable taking the same flat inputs as the graph and returning what the
        graph returns."""

    def package_of(self, meta: CompiledArtifact) -> str | None:
        """The artifact file that `load` unpacks on every load (an archive), when this
        toolchain can load an unpacked copy of it instead (`load_unpacked`); None: it loads
        its files as they are. The cache keeps one verified copy per entry
        (compile/tiers/unpacked.py)."""
        return None

    def load_unpacked(self, directory: str, meta: CompiledArtifact) -> Callable[..., Any]:
        """`load`, from ``directory``, which holds the members of `package_of(meta)` named as
        in the archive."""
        raise ToolchainError(f"the {self.name} toolchain loads no unpacked package")

    def check_meta(self, meta: CompiledArtifact) -> None:
        """Refuse an artifact made by another toolchain or for another target."""
        if meta.toolchain != self.name or meta.target != self.target:
            raise ToolchainError(
                f"artifact was built by {meta.toolchain}/{meta.target}, "
                f"this toolchain is {self.name}/{self.target}"
            )
