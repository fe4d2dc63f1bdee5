"""How one tensor becomes one file of a snapshot bundle, and back, bit for bit.

Three formats, chosen by ``VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_FORMAT``:

- ``pt`` (default): ``torch.save`` of the tensor alone; loaded with
  ``torch.load(weights_only=True)``, so a bundle from elsewhere cannot run code.
- ``npy``: numpy's format with the raw element bytes. bf16 and the fp8 dtypes have no numpy
  scalar type, so they are written as fixed-width raw bytes (descr ``|V2`` / ``|V1``); the
  dtype name in ``meta.json`` (which is also the ``ml_dtypes`` name) says how to read them
  back. numpy users can do ``np.load(f).view(ml_dtypes.bfloat16)``.
- ``safetensors``: one tensor named ``tensor`` per file (needs the ``safetensors`` package).

A dtype a format cannot hold raises :class:`SnapshotEncodingError` naming the formats that
can, before anything is written; nothing is ever converted silently.

Tensors are written compact and C-contiguous (a view of a larger buffer is copied first, so
``pt`` never drags the whole storage of a KV-cache slice into a file).
"""

from __future__ import annotations

import functools
import io
import json
import math
import re
import struct
import sys
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from vllm_neuron.envs.snapshot import FORMAT, SNAPSHOT_FORMATS, SnapshotFormat

if TYPE_CHECKING:
    import torch

__all__ = [
    "FORMATS",
    "RAW_BYTE_DTYPES",
    "SnapshotEncodingError",
    "SnapshotFormat",
    "check_encodable",
    "decode_tensor",
    "dtype_from_name",
    "dtype_name",
    "encode_tensor",
    "file_name",
    "supported_formats",
    "write_tensor",
]

# The format names are the settings' (the variable's accepted values), defined once there.
FORMATS: tuple[SnapshotFormat, ...] = SNAPSHOT_FORMATS
FORMAT_VARIABLE = FORMAT

# dtypes without a numpy scalar type that npy stores as raw fixed-width bytes; each name is
# also an ml_dtypes type, so numpy users can reinterpret the bytes themselves.
RAW_BYTE_DTYPES: frozenset[str] = frozenset(
    {
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    }
)

# torch dtype name -> numpy dtype for the types numpy has natively.
_NUMPY_NATIVE: dict[str, str] = {
    "bool": "bool",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
    "uint16": "uint16",
    "int32": "int32",
    "uint32": "uint32",
    "int64": "int64",
    "uint64": "uint64",
    "float16": "float16",
    "float32": "float32",
    "float64": "float64",
    "complex64": "complex64",
    "complex128": "complex128",
}

# What safetensors 0.4-0.8 stores (its BF16, F8_E4M3, F8_E4M3FNUZ, F8_E5M2, F8_E5M2FNUZ,
# C64 and unsigned types included); extended at run time from the installed version.
_SAFETENSORS_BASE: frozenset[str] = frozenset(
    {
        "bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
        "float16", "bfloat16", "float32", "float64", "complex64",
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
    }
)  # fmt: skip

_TENSOR_KEY = "tensor"


class SnapshotEncodingError(ValueError):
    """A tensor cannot be stored in (or read back from) the chosen format."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name meta.json records)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called ``name``; SnapshotEncodingError for anything else."""
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch

    value = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(value, torch.dtype):
        raise SnapshotEncodingError(f"{name!r} is not a torch dtype")
    return value


def file_name(stem: str, fmt: SnapshotFormat) -> str:
    return f"{stem}.{fmt}"


def _is_quantized_or_subbyte(name: str) -> bool:
    # qint8/quint8/...: quantized; int1..int7 / uint1..uint7: no storage layout in torch.
    return name.startswith(("qint", "quint")) or re.fullmatch(r"u?int[1-7]", name) is not None


@functools.lru_cache(maxsize=1)
def _safetensors_dtypes() -> frozenset[str]:
    try:
        # Lazy: safetensors is heavy and optional; only this path needs it.
        import safetensors.torch as st
    except ImportError:
        return frozenset()
    table = getattr(st, "_TYPES", None)
    if isinstance(table, dict):
        return _SAFETENSORS_BASE | {dtype_name(dt) for dt in table.values()}
    return _SAFETENSORS_BASE


def supported_formats(dtype: torch.dtype) -> tuple[SnapshotFormat, ...]:
    """The formats that store ``dtype`` bit-exactly, in preference order."""
    name = dtype_name(dtype)
    if _is_quantized_or_subbyte(name):
        return ()
    out: list[SnapshotFormat] = ["pt"]
    if name in _NUMPY_NATIVE or name in RAW_BYTE_DTYPES:
        out.append("npy")
    if name in _safetensors_dtypes():
        out.append("safetensors")
    return tuple(out)


def check_encodable(dtype: torch.dtype, fmt: SnapshotFormat, what: str = "a tensor") -> None:
    """Raise SnapshotEncodingError (naming the formats that work) if ``fmt`` cannot hold it."""
    if fmt not in FORMATS:
        raise SnapshotEncodingError(f"unknown snapshot format {fmt!r}; use one of {FORMATS}")
    formats = supported_formats(dtype)
    if fmt in formats:
        return
    name = dtype_name(dtype)
    if not formats:
        raise SnapshotEncodingError(
            f"{what} has dtype {name}, which no snapshot format can store "
            "(quantized and sub-byte dtypes have no portable byte layout); "
            "convert it in the model before the compiled graph"
        )
    reason = {
        "npy": "it has no numpy representation",
        "safetensors": "safetensors has no such dtype"
        + ("" if _safetensors_dtypes() else " (the safetensors package is not installed)"),
        "pt": "torch.save cannot store it",
    }[fmt]
    raise SnapshotEncodingError(
        f"{what} has dtype {name}, which the {fmt} format cannot store ({reason}); "
        f"re-run with {FORMAT_VARIABLE}={formats[0]} (formats that can: {', '.join(formats)})"
    )


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, C-contiguous, owning exactly its own bytes."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
        t = t.clone()
    return t


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view of a compact tensor (raw bytes ``|V<n>`` for bf16/fp8)."""
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch

    name = dtype_name(t.dtype)
    if name in RAW_BYTE_DTYPES:
        carrier = torch.uint16 if t.element_size() == 2 else torch.uint8
        return t.view(carrier).numpy().view(f"V{t.element_size()}")
    return t.numpy()


def write_tensor(t: torch.Tensor, fmt: SnapshotFormat, f: IO[bytes]) -> None:
    """Stream ``t`` into the open binary file ``f`` in ``fmt`` (the caller checked it)."""
    check_encodable(t.dtype, fmt)
    t = _compact(t)
    if fmt == "npy":
        np.lib.format.write_array(f, _numpy_view(t), allow_pickle=False)
    elif fmt == "pt":
        # Lazy: torch is heavy and optional; only this path needs it.
        import torch

        torch.save(t, f)
    else:
        _write_safetensors(t, f)


def _write_safetensors(t: torch.Tensor, f: IO[bytes]) -> None:
    """``t`` (compact) as a one-tensor safetensors file, streamed into ``f``.

    ``safetensors.torch.save`` builds the whole file in memory, twice (its serializer's
    buffer, then ``bytes`` of it), which made a 256 MiB bundle 3-4x slower than writing the
    tensors. So the header is written as safetensors writes it (its dtype names, compact
    JSON padded with spaces to 8 bytes, the length as a little-endian u64; a test checks
    the bytes equal ``save``'s) and the data straight from the tensor's memory. A dtype
    the installed safetensors names differently, or a big-endian host, goes through
    ``save``.
    """
    # Lazy: safetensors is heavy and optional; only this path needs it.
    import safetensors.torch as st
    import torch

    names = {dtype: name for name, dtype in getattr(st, "_TYPES", {}).items()}
    name = names.get(t.dtype)
    if name is None or sys.byteorder != "little":
        f.write(st.save({_TENSOR_KEY: t}))
        return
    data = t.reshape(-1).view(torch.uint8).numpy()  # the raw bytes, no copy
    header = json.dumps(
        {_TENSOR_KEY: {"dtype": name, "shape": list(t.shape), "data_offsets": [0, data.nbytes]}},
        separators=(",", ":"),
    ).encode()
    header += b" " * (-len(header) % 8)
    f.write(struct.pack("<Q", len(header)))
    f.write(header)
    f.write(data.data)


def encode_tensor(t: torch.Tensor, fmt: SnapshotFormat) -> bytes:
    """``t`` as the bytes of one ``fmt`` file."""
    buf = io.BytesIO()
    write_tensor(t, fmt, buf)
    return buf.getvalue()


def _read_npy(data: bytes | bytearray) -> np.ndarray:
    """A writable array over (a copy of) ``data``, without numpy's read-only frombuffer."""
    fp = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(fp)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fp)
        else:
            arr = np.load(io.BytesIO(data), allow_pickle=False)
            return np.array(arr, copy=True)
    except ValueError as exc:
        raise SnapshotEncodingError(f"not a valid .npy file: {exc}") from exc
    if dtype.hasobject:
        raise SnapshotEncodingError(".npy file holds Python objects; refusing to load it")
    count = math.prod(shape)
    offset = fp.tell()
    if len(data) - offset < count * dtype.itemsize:
        raise SnapshotEncodingError(
            f".npy file is truncated: {len(data) - offset} data bytes, "
            f"expected {count * dtype.itemsize}"
        )
    buf = data if isinstance(data, bytearray) else bytearray(data)
    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
    return arr.reshape(shape, order="F" if fortran else "C")


def _c_order(arr: np.ndarray) -> np.ndarray:
    # not np.ascontiguousarray: it turns a 0-d array into a 1-d one
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def decode_tensor(
    data: bytes | bytearray,
    fmt: SnapshotFormat,
    dtype: str,
    shape: Sequence[int],
    what: str = "tensor",
) -> torch.Tensor:
    """The tensor stored in ``data``; its dtype and shape must match the recorded ones."""
    # Lazy: torch is heavy and optional; only this path needs it.
    import torch

    expected = dtype_from_name(dtype)
    if fmt == "npy":
        arr = _read_npy(data)
        if dtype in RAW_BYTE_DTYPES:
            size = expected.itemsize
            if arr.dtype != np.dtype(f"V{size}"):
                raise SnapshotEncodingError(
                    f"{what}: expected raw |V{size} bytes for {dtype}, found {arr.dtype.str}"
                )
            carrier = np.uint16 if size == 2 else np.uint8
            t = torch.from_numpy(_c_order(arr).view(carrier)).view(expected)
        else:
            native = _NUMPY_NATIVE.get(dtype)
            if native is None or arr.dtype != np.dtype(native):
                raise SnapshotEncodingError(
                    f"{what}: meta.json says {dtype} but the .npy file holds {arr.dtype}"
                )
            t = torch.from_numpy(_c_order(arr))
    elif fmt == "pt":
        try:
            t = torch.load(io.BytesIO(bytes(data)), weights_only=True, map_location="cpu")
        except Exception as exc:
            raise SnapshotEncodingError(f"{what}: cannot load .pt file safely: {exc}") from exc
        if not isinstance(t, torch.Tensor):
            raise SnapshotEncodingError(f"{what}: .pt file holds {type(t).__name__}, not a tensor")
    elif fmt == "safetensors":
        try:
            # Lazy: safetensors is heavy and optional; only this path needs it.
            import safetensors.torch as st
        except ImportError as exc:
            raise SnapshotEncodingError(
                f"{what} is a .safetensors file; install safetensors to read it"
            ) from exc
        try:
            t = st.load(bytes(data))[_TENSOR_KEY]
        except Exception as exc:
            raise SnapshotEncodingError(f"{what}: cannot read .safetensors file: {exc}") from exc
    else:
        raise SnapshotEncodingError(f"unknown snapshot format {fmt!r}; use one of {FORMATS}")
    if t.dtype != expected:
        raise SnapshotEncodingError(f"{what}: meta.json says {dtype}, the file holds {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise SnapshotEncodingError(
            f"{what}: meta.json says shape {tuple(shape)}, the file holds {tuple(t.shape)}"
        )
    return t


def describe(value: Any) -> str:
    """A short human description of one positional input, for error messages."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{dtype_name(dtype)}[{', '.join(str(d) for d in shape)}]"
    return type(value).__name__
