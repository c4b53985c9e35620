"""``DirectFile`` writes exactly the bytes given, past the page cache where the file system allows it and buffered
where it refuses ``O_DIRECT`` (see [Note: rank files are written past the page cache])."""

from __future__ import annotations

import errno
import itertools
import os
from pathlib import Path

import pytest
import torch

from lightning_zero.checkpoint import direct_file
from lightning_zero.checkpoint.checksums import saved_file_digest
from lightning_zero.checkpoint.direct_file import ALIGNMENT, BUFFER_BYTES, DirectFile
from lightning_zero.checkpoint.metadata import file_digest

SIZES = [0, 1, ALIGNMENT - 1, ALIGNMENT, ALIGNMENT + 1, BUFFER_BYTES, BUFFER_BYTES + 3, 2 * BUFFER_BYTES + ALIGNMENT]


def _written(path: Path, data: bytes, pieces: int = 3) -> DirectFile:
    """Write ``data`` through a DirectFile in ``pieces`` writes of uneven sizes."""
    cuts = sorted({0, len(data), *(len(data) * k // (pieces + k) for k in range(1, pieces))})
    with DirectFile(path) as handle:
        for start, end in itertools.pairwise(cuts):
            assert handle.write(memoryview(data)[start:end]) == end - start
    return handle


@pytest.mark.parametrize("size", SIZES)
def test_the_file_holds_exactly_the_bytes_written(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    _written(tmp_path / "f", data)
    assert (tmp_path / "f").read_bytes() == data


def test_a_file_system_refusing_o_direct_at_the_open_gets_a_buffered_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT here: every file is buffered")
    real_open = os.open

    def refusing(path: str, flags: int, *args: int) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(direct_file.os, "open", refusing)
    data = os.urandom(BUFFER_BYTES + 5)
    assert not _written(tmp_path / "f", data).direct
    assert (tmp_path / "f").read_bytes() == data


def test_a_file_system_refusing_a_direct_write_goes_on_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT here: every file is buffered")
    real_write, writes = os.write, []

    def refusing_the_second(fd: int, data: memoryview) -> int:
        writes.append(len(data))
        if len(writes) == 2:  # the second buffer, after one went out
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(direct_file.os, "write", refusing_the_second)
    data = os.urandom(3 * BUFFER_BYTES + 7)
    handle = _written(tmp_path / "f", data)
    assert (tmp_path / "f").read_bytes() == data
    assert not handle.direct
    assert len(writes) == 5


def test_errors_other_than_a_refusal_are_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: memoryview) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_file.os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        _written(tmp_path / "f", os.urandom(BUFFER_BYTES))


def test_torch_save_into_it_loads_equal_with_the_crc_32_of_its_records(tmp_path: Path) -> None:
    state = {"w": torch.randn(3, 1000), "b": torch.arange(7), "h": torch.randn(5).to(torch.bfloat16), "n": 3}
    with DirectFile(tmp_path / "rank_0.pt") as handle:
        torch.save(state, handle)
    loaded = torch.load(tmp_path / "rank_0.pt")
    assert loaded["n"] == 3
    assert all(torch.equal(loaded[k], state[k]) for k in ("w", "b", "h"))
    assert saved_file_digest(tmp_path / "rank_0.pt") == file_digest(tmp_path / "rank_0.pt")


def test_no_memory_for_the_buffer_leaves_no_file_and_no_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_memory(*args: int) -> None:
        raise MemoryError("mmap")

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("no /proc/self/fd here to count descriptors")
    monkeypatch.setattr(direct_file.mmap, "mmap", no_memory)
    open_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(MemoryError):
        DirectFile(tmp_path / "f")
    assert not (tmp_path / "f").exists()
    assert len(os.listdir("/proc/self/fd")) == open_before
