"""A fetch's copy checks where a file lies on the descriptor it copies from (issue 39).

`copy_verified` once checked an entry's directories by path (`realpath`) and then opened
each file by name: a writer of the shared folder who swaps the entry's directory for a link
in between leads the copy to node-local files. Here the swap is made deterministically,
inside the open itself (just before the real `open_regular`), which is the latest moment a
check by path could have come before; the linked target holds the very bytes the entry
records, so only where they were read from tells - and they must never be copied.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from vllm_neuron.backends import IntegrityError, open_store, regular, verified_copy
from vllm_neuron.backends.digests import digest_bytes
from vllm_neuron.backends.testing_ops import BIG, publish

FILES = {"big.neff": BIG, "small.bin": b"s" * 100}
EXPECTED = {rel: digest_bytes(data) for rel, data in FILES.items()}


@pytest.mark.parametrize("rel", ["big.neff", "small.bin"])  # the kernel path, the stream path
def test_an_entry_directory_swapped_for_a_link_before_the_open_is_never_copied_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rel: str) -> None:  # fmt: skip
    src, dst = open_store(tmp_path / "src"), open_store(tmp_path / "dst")
    prefix = publish(src, "e", FILES)
    entry = src.local_path(prefix)
    assert entry is not None
    outside = tmp_path / "node-local"  # the same bytes, outside the tier
    shutil.copytree(entry, outside)
    real = regular.open_regular
    swapped: list[str] = []

    def swap_then_open(path: str) -> tuple[int, int]:
        if not swapped:
            os.rename(entry, f"{entry}.moved")
            os.symlink(outside, entry)
            swapped.append(path)
        return real(path)

    monkeypatch.setattr(regular, "open_regular", swap_then_open)
    monkeypatch.setattr(verified_copy, "open_regular", swap_then_open, raising=False)
    with dst.stage("e") as staging:
        with pytest.raises(IntegrityError, match="resolves outside the tier") as raised:
            verified_copy.copy_verified(src, prefix, staging, {rel: EXPECTED[rel]}, workers=1)
        landed = dst.local_path(staging.key(rel))
        assert landed is not None and not os.path.exists(landed)  # nothing was copied
    assert swapped == [os.path.join(entry, rel)] and raised.value.rel == rel
    assert dst.published("e") is None
