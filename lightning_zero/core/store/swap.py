"""The rank's swap file: one unlinked file, written and read in page-aligned regions (``O_DIRECT`` where the file
system allows), with its I/O counted; and the tensor that rests in a region of it.

See [Note: paged optimizer steps] in core/store/disk.py for what rests there.
"""

from __future__ import annotations

import errno as errno_names
import mmap
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from lightning_zero.core.layout.host_memory import HOST


class Flushable(Protocol):
    """A store that holds its region's contents in memory for a while (a checkpoint load) and writes them back."""

    def flush(self) -> None: ...


PAGE = 4096  # O_DIRECT wants page-aligned buffers, offsets and lengths


class SwapIOError(RuntimeError):
    """A read or write of a swap file failed."""


def _padded(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def aligned_empty(nbytes: int) -> Tensor:
    """A uint8 host tensor of ``nbytes`` rounded up to a page, starting on a page boundary."""
    padded = _padded(max(nbytes, 1))
    raw = torch.empty(padded + PAGE, dtype=torch.uint8, device=HOST)
    start = (-raw.data_ptr()) % PAGE
    return raw[start : start + padded]


@dataclass(frozen=True)
class Region:
    """``nbytes`` (``padded`` on disk) at ``offset`` of a swap file."""

    offset: int
    nbytes: int
    padded: int


@dataclass
class IOCounts:
    """Bytes a swap file moved: ``read``/``written`` as the model states need them, ``*_padded`` as issued."""

    read: int = 0
    written: int = 0
    read_padded: int = 0
    written_padded: int = 0


class SwapFile:
    """One rank's file under ``directory``, without a name: created with ``O_TMPFILE`` (or created and unlinked
    at once), so no file is left behind after any exit, ``SIGKILL`` included. ``O_DIRECT`` where the file system
    takes it (not tmpfs), so pages do not pile up in the page cache."""

    def __init__(self, directory: str, rank: int) -> None:
        self.directory = directory
        self.label = f"the unlinked swap file of rank {rank} in {directory}"
        self.fd, self.direct = _open_unlinked(directory)
        self.size = 0
        self.counts = IOCounts()
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lightning-zero-swap")
        self.staged: Flushable | None = None  # the one store whose master is held in memory while loading
        self.map_reads = False  # reads for a save are read-only maps of the file (see mapped_reads)

    def allocate(self, nbytes: int) -> Region:
        region = Region(self.size, nbytes, _padded(nbytes))
        try:
            os.posix_fallocate(self.fd, region.offset, max(region.padded, PAGE))
        except OSError as error:
            raise self._error("preallocating", region.offset, error) from error
        self.size += max(region.padded, PAGE)
        return region

    def write(self, region: Region, page: Tensor) -> None:
        """Write ``page`` (from :func:`aligned_empty`, at least ``region.padded`` bytes) to ``region``."""
        self._transfer(os.pwritev, region, page, "writing")
        with self._lock:
            self.counts.written += region.nbytes
            self.counts.written_padded += region.padded

    def read(self, region: Region) -> Tensor:
        """A new page-aligned tensor holding ``region``'s bytes."""
        page = aligned_empty(region.padded)
        self._transfer(os.preadv, region, page, "reading")
        with self._lock:
            self.counts.read += region.nbytes
            self.counts.read_padded += region.padded
        return page

    def map(self, region: Region, dtype: torch.dtype, numel: int) -> Tensor:
        """A read-only tensor over ``numel`` elements of ``region``, mapped from the file: its pages are the page
        cache's (file-backed, reclaimable), not the process's anonymous memory. Only ever read it."""
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        pages = mmap.mmap(self.fd, numel * dtype.itemsize, mmap.MAP_SHARED, mmap.PROT_READ, offset=region.offset)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "not writable": it is only read (torch.save)
            return torch.frombuffer(pages, dtype=torch.uint8).view(dtype)  # keeps the map alive

    @contextmanager
    def mapped_reads(self) -> Iterator[None]:
        """Inside, stores give their state and masters as maps of the file (:meth:`map`) instead of copies: a
        checkpoint save then streams them from the file, without holding the rank's share in memory."""
        if self.staged is not None:
            self.staged.flush()
        previous, self.map_reads = self.map_reads, True
        try:
            yield
        finally:
            self.map_reads = previous

    def _transfer(self, call: Callable[..., int], region: Region, page: Tensor, what: str) -> None:
        view = memoryview(page.numpy())[: region.padded]
        done = 0
        while done < region.padded:
            try:
                moved = call(self.fd, [view[done:]], region.offset + done)
            except OSError as error:
                raise self._error(what, region.offset + done, error) from error
            if moved <= 0:
                raise self._error(what, region.offset + done, OSError(errno_names.EIO, "short transfer"))
            done += moved

    def _error(self, what: str, offset: int, error: OSError) -> SwapIOError:
        name = errno_names.errorcode.get(error.errno or 0, "?")
        return SwapIOError(
            f"offload: {what} {self.label} at offset {offset} failed: [errno {error.errno} {name}] "
            f"{error.strerror}. Check the disk behind nvme_path (free space, errors in dmesg)."
        )

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _open_unlinked(directory: str) -> tuple[int, bool]:
    """An unnamed read-write file in ``directory`` and whether it is open with ``O_DIRECT``."""
    direct = getattr(os, "O_DIRECT", 0)
    for flags in (direct, 0) if direct else (0,):
        try:
            fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | flags, 0o600)
        except (AttributeError, OSError):
            fd = _create_and_unlink(directory, flags)
            if fd < 0:
                continue
        if flags and not _direct_works(fd):
            os.close(fd)
            continue
        return fd, bool(flags)
    raise OSError(f"cannot create a file in {directory}")


def _create_and_unlink(directory: str, flags: int) -> int:
    import tempfile

    try:
        fd, path = tempfile.mkstemp(prefix=".lightning-zero-swap-", dir=directory)
    except OSError:
        return -1
    os.unlink(path)
    if flags:
        os.close(fd)
        return -1  # a reopened name would outlive a crash between open and unlink; take the plain descriptor
    return fd


def _direct_works(fd: int) -> bool:
    page = aligned_empty(PAGE)
    try:
        os.pwritev(fd, [memoryview(page.numpy())], 0)
        os.ftruncate(fd, 0)
    except OSError:
        return False
    return True


def typed_view(page: Tensor, dtype: torch.dtype, numel: int) -> Tensor:
    return page[: numel * dtype.itemsize].view(dtype)


class RestingTensor:
    """A shard resting in a region of the swap file, read ahead and written behind on the file's worker threads: a
    stage-3 parameter shard (``offload_params="nvme"``, see :class:`~lightning_zero.core.layout.flat_buffer.
    ShardedBuffer`) or a held gradient shard (see :class:`~lightning_zero.core.step.shard_bucket.ShardGradBucket`)."""

    def __init__(self, swap: SwapFile) -> None:
        self.swap = swap
        self.region: Region | None = None

    def put(self, shard: Tensor) -> None:
        nbytes = shard.numel() * shard.element_size()
        if self.region is None or self.region.nbytes != nbytes:
            self.region = self.swap.allocate(nbytes)
        page = aligned_empty(self.region.padded)
        page[:nbytes].copy_(shard.detach().to(HOST).contiguous().view(-1).view(torch.uint8))
        self.swap.write(self.region, page)

    def get(self, dtype: torch.dtype, numel: int) -> Tensor:
        assert self.region is not None, "a shard is read from disk only after it was written there"
        return typed_view(self.swap.read(self.region), dtype, numel)

    def holds(self, shard: Tensor) -> bool:
        return self.region is not None

    def get_async(self, dtype: torch.dtype, numel: int) -> Future[Tensor]:
        """:meth:`get` on the swap file's worker threads (a read-ahead)."""
        return self.swap.pool.submit(self.get, dtype, numel)

    @property
    def nbytes(self) -> int:
        """Bytes of the region (0 before the first :meth:`put`)."""
        return self.region.nbytes if self.region is not None else 0
