"""The streamed safetensors writer writes exactly the bytes `safetensors.torch.save` does.

`encoding.write_tensor` streams the header and the tensor's memory instead of building the
file in memory (see `_write_safetensors`); the format is safetensors', so its output is
checked byte for byte against the library's own, for every dtype the library names.
"""

from __future__ import annotations

import io

import pytest
import safetensors.torch as st  # installed by the test extra: a missing one is a failure
import torch

from vllm_neuron.snapshot.encoding import decode_tensor, dtype_name, write_tensor

SHAPES = [(), (0,), (1,), (3,), (2, 3, 5), (7, 1, 4)]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Random bits of `dtype` (every bit pattern, not only numbers torch can make)."""
    count = 1
    for d in shape:
        count *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, dtype=torch.uint8).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (count * size,), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", sorted(set(st._TYPES.values()), key=str), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_streamed_bytes_equal_safetensors_save(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _tensor(dtype, shape)
    out = io.BytesIO()
    write_tensor(t, "safetensors", out)
    assert out.getvalue() == st.save({"tensor": t})
    back = decode_tensor(out.getvalue(), "safetensors", dtype_name(dtype), list(shape))
    as_bytes = [x.reshape(-1).view(torch.uint8) for x in (back, t)]
    assert back.dtype == dtype and torch.equal(*as_bytes)


def test_a_view_is_written_compact() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    view = base[1:3, ::2]  # not contiguous, an offset into a larger storage
    out = io.BytesIO()
    write_tensor(view, "safetensors", out)
    assert out.getvalue() == st.save({"tensor": view.contiguous()})
