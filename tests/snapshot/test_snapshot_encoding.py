"""Encoding: every dtype torch has, in every format, bit-exact or a clear error."""

from __future__ import annotations

import io
import pickle

import ml_dtypes
import numpy as np
import pytest
import torch

from vllm_neuron.snapshot.encoding import (
    FORMATS,
    RAW_BYTE_DTYPES,
    SnapshotEncodingError,
    check_encodable,
    decode_tensor,
    dtype_name,
    encode_tensor,
    supported_formats,
)


def all_torch_dtypes() -> list[torch.dtype]:
    found = {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    return sorted(found, key=str)


ALL_DTYPES = all_torch_dtypes()
FP8 = [d for d in ALL_DTYPES if dtype_name(d).startswith("float8_")]
# What the issue names explicitly: these must round-trip in every format that claims them.
MUST_WORK = {
    "pt": ["float32", "float16", "bfloat16", *map(dtype_name, FP8), "int8", "int16", "int32",
           "int64", "uint8", "bool"],
    "npy": ["float32", "float16", "bfloat16", *map(dtype_name, FP8), "int8", "int16", "int32",
            "int64", "uint8", "bool"],
    "safetensors": ["float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8",
                    "int16", "int32", "int64", "uint8", "bool"],
}  # fmt: skip


def test_this_torch_has_the_fp8_variants() -> None:
    names = {dtype_name(d) for d in FP8}
    assert {"float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"} <= names
    assert names <= RAW_BYTE_DTYPES | {"float8_e8m0fnu"}


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5)) -> torch.Tensor:
    """Every bit pattern is fair game (NaNs, infs, subnormals): built from random bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = int(np.prod(shape)) * itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=dtype_name)
def test_round_trip_bit_exact_or_clear_error(dtype: torch.dtype, fmt: str) -> None:
    name = dtype_name(dtype)
    try:
        t = random_tensor(dtype)
    except (RuntimeError, TypeError):
        # quantized / sub-byte dtypes cannot even be viewed from bytes; the encoder refuses them
        with pytest.raises(SnapshotEncodingError, match="no snapshot format"):
            check_encodable(dtype, fmt)  # type: ignore[arg-type]
        return
    if fmt in supported_formats(dtype):
        data = encode_tensor(t, fmt)
        back = decode_tensor(data, fmt, name, list(t.shape))
        assert back.dtype == dtype and back.shape == t.shape
        assert bits(back) == bits(t)
    else:
        assert name not in MUST_WORK[fmt]
        with pytest.raises(SnapshotEncodingError) as info:
            encode_tensor(t, fmt)  # type: ignore[arg-type]
        text = str(info.value)
        assert name in text
        others = supported_formats(dtype)
        if others:  # the message says which format to use instead
            assert f"VLLM_NEURON_RUNTIME_INPUT_SNAPSHOT_FORMAT={others[0]}" in text
        else:
            assert "no snapshot format" in text


@pytest.mark.parametrize("fmt", FORMATS)
def test_required_dtypes_are_supported(fmt: str) -> None:
    for name in MUST_WORK[fmt]:
        assert fmt in supported_formats(getattr(torch, name)), name


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(), (0,), (0, 4), (1,), (2, 3, 4)])
def test_shapes_including_scalars_and_empty(fmt: str, shape: tuple[int, ...]) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        t = random_tensor(dtype, shape)
        back = decode_tensor(encode_tensor(t, fmt), fmt, dtype_name(dtype), list(shape))  # type: ignore[arg-type]
        assert back.shape == t.shape and bits(back) == bits(t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, *FP8], ids=dtype_name)
def test_npy_stores_raw_fixed_width_bytes_readable_with_ml_dtypes(dtype: torch.dtype) -> None:
    t = random_tensor(dtype)
    data = encode_tensor(t, "npy")
    size = t.element_size()
    assert f"'descr': '|V{size}'".encode() in data[:128]
    raw = np.load(io.BytesIO(data))  # plain numpy: opaque void, the dtype is in meta.json
    assert raw.dtype == np.dtype(f"V{size}")
    as_ml = raw.view(getattr(ml_dtypes, dtype_name(dtype)))
    ref = t.float().numpy()
    got = as_ml.astype(np.float32)
    assert np.array_equal(got, ref, equal_nan=True)


def test_npy_native_dtypes_are_plain_numpy() -> None:
    t = random_tensor(torch.int32)
    arr = np.load(io.BytesIO(encode_tensor(t, "npy")))
    assert arr.dtype == np.int32 and np.array_equal(arr, t.numpy())


def test_views_are_written_compact() -> None:
    big = torch.arange(1_000_000, dtype=torch.float32)
    view = big[10:20]
    assert len(encode_tensor(view, "pt")) < 10_000  # not the whole 4 MB storage
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous
    for fmt in FORMATS:
        back = decode_tensor(encode_tensor(t, fmt), fmt, "float32", [4, 3])
        assert torch.equal(back, t)


def test_pt_loads_with_weights_only() -> None:
    class Evil:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("pwned",))

    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(SnapshotEncodingError, match="safely"):
        decode_tensor(buf.getvalue(), "pt", "float32", [1])


def test_decode_checks_meta_against_the_file() -> None:
    t = random_tensor(torch.float32)
    for fmt in FORMATS:
        data = encode_tensor(t, fmt)
        with pytest.raises(SnapshotEncodingError, match="meta.json says"):
            decode_tensor(data, fmt, "float16", [3, 5])
        with pytest.raises(SnapshotEncodingError, match="shape"):
            decode_tensor(data, fmt, "float32", [5, 3])
    raw = encode_tensor(random_tensor(torch.bfloat16), "npy")
    with pytest.raises(SnapshotEncodingError, match=r"\|V1"):
        decode_tensor(raw, "npy", "float8_e5m2", [3, 5])
    with pytest.raises(SnapshotEncodingError, match="truncated"):
        decode_tensor(raw[:-4], "npy", "bfloat16", [3, 5])
    with pytest.raises(SnapshotEncodingError, match="not a torch dtype"):
        decode_tensor(raw, "npy", "os.system", [3, 5])


def test_npy_refuses_object_arrays() -> None:
    buf = io.BytesIO()
    np.save(buf, np.array([object()], dtype=object), allow_pickle=True)
    with pytest.raises(SnapshotEncodingError, match="objects"):
        decode_tensor(buf.getvalue(), "npy", "float32", [1])
