"""A rank file leaves the page cache once it is on the disk: see [Note: a written rank file leaves the page cache]."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint import saving


def _resident_pages(file: Path) -> tuple[int, int]:
    """(pages of ``file`` in the page cache, pages of ``file``), from ``mincore`` over a mapping of it."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = file.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(file, "rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
        vector = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        if libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
            pytest.skip(f"mincore failed: {os.strerror(ctypes.get_errno())}")
        return sum(page & 1 for page in vector), pages


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux's")
def test_a_written_rank_file_is_dropped_from_the_page_cache(tmp_path: Path) -> None:
    state = {"w": torch.randn(2**20), "m": torch.randn(2**20)}  # 8 MiB
    kept = tmp_path / "kept.pt"
    torch.save(state, kept)
    resident, pages = _resident_pages(kept)
    if resident < pages // 2:
        pytest.skip("this file system does not keep written files in the page cache")
    written = tmp_path / "rank_0.pt"
    saving._write(written, state)
    resident, pages = _resident_pages(written)
    assert resident <= pages // 10, f"{resident} of {pages} pages of the rank file still in the page cache"
    assert torch.equal(torch.load(written)["w"], state["w"])  # read back from the disk


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise is Linux's")
def test_a_snapshot_file_is_dropped_from_the_page_cache_once_synced(tmp_path: Path) -> None:
    state = {"w": torch.randn(2**21)}  # 8 MiB, written into the page cache as a snapshot's file is
    written = tmp_path / "rank_0.pt"
    saving._write(written, state, sync=False)
    resident, pages = _resident_pages(written)
    if resident < pages // 2:
        pytest.skip("this file system does not keep written files in the page cache")
    saving._sync(written, drop=True)  # as finish_save does
    resident, pages = _resident_pages(written)
    assert resident <= pages // 10, f"{resident} of {pages} pages of the snapshot file still in the page cache"
