"""NVMe offload: the master shard and the optimizer state in one unlinked file per rank, paged in per buffer.

[Note: paged optimizer steps]
``offload_optimizer="nvme"`` keeps each trainable buffer's fp32 master and its optimizer state in regions of a
:class:`SwapFile`. Between steps the optimizer's state dict holds, for each element-wise state tensor, an empty
placeholder of its dtype (scalars such as ``step`` stay). Inside the step window, :func:`run_paged` steps one
buffer at a time: a worker thread reads the next buffers' regions (read-ahead) while the optimizer steps this one
with only its parameters given gradients (torch's optimizers skip a parameter without one), the updated master is
rounded into the device shard, and another worker writes the regions back (write-behind). At most
:data:`PIPELINE_DEPTH` buffers are in host memory at once, so host memory holds a few buckets, never the whole
state. State the optimizer creates in its first step is given a region then. A failed read or write is agreed
across ranks (one all-reduce per step) and raised on every rank naming the file, the offset and the errno.
"""

from __future__ import annotations

import errno as errno_names
import mmap
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.core.comm import Communicator
from lightning_zero.core.flat_buffer import FlatParamBuffer
from lightning_zero.core.offload.host import HOST, host_release_grads, host_step_grads
from lightning_zero.core.paged_grads import PagedWork
from lightning_zero.core.store import ShardStore

PAGE = 4096  # O_DIRECT wants page-aligned buffers, offsets and lengths
PIPELINE_DEPTH = 3  # buffers in host memory at once during a paged step: read ahead, stepping, written behind


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
        self.staged: DiskStore | None = None  # the one store whose master is held in memory while loading
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


@dataclass
class Paged:
    """One buffer's regions in host memory during a paged step: the raw pages and typed views of them."""

    pages: dict[str, Tensor] = field(default_factory=dict)
    views: dict[str, Tensor] = field(default_factory=dict)


class DiskStore(ShardStore):
    """``offload_optimizer="nvme"``: the master shard and the optimizer state of one buffer in a swap file. See
    [Note: paged optimizer steps].

    Args:
        buffer: the parameters; call while it holds its full values (before ``buffer.cast``).
        master_dtype: the master's dtype (fp32).
        swap: the rank's swap file.
    """

    offloaded = True
    paged = True

    def __init__(self, buffer: FlatParamBuffer, master_dtype: torch.dtype, swap: SwapFile) -> None:
        super().__init__(buffer)
        self.swap = swap
        self.master_dtype = master_dtype
        lo, hi = buffer.bounds
        self.numel = hi - lo
        # region name -> (region, dtype); state regions are named "<optimizer id>/<state key>"
        self.regions: dict[str, tuple[Region, torch.dtype]] = {}
        self.slots_with: dict[str, set[int]] = {}  # state region -> the slots whose state it holds
        self._staged: Tensor | None = None  # the master in memory while a checkpoint loads into it
        self._sync_pending = False
        master = self._new_region("master", master_dtype)
        page = aligned_empty(master.padded)
        _typed(page, master_dtype, self.numel).copy_(buffer.data[lo:hi])
        swap.write(master, page)

    def _new_region(self, name: str, dtype: torch.dtype) -> Region:
        region = self.swap.allocate(self.numel * dtype.itemsize)
        self.regions[name] = (region, dtype)
        return region

    # ------------------------------------------------------------------ the step (see run_paged)
    def page_in(self, optimizer: Optimizer) -> Paged:
        """Read the master and ``optimizer``'s state regions (in a worker thread)."""
        paged = Paged()
        prefix = _prefix(optimizer)
        for name, (region, dtype) in self.regions.items():
            if name == "master" or name.startswith(prefix):
                paged.pages[name] = self.swap.read(region)
                paged.views[name] = _typed(paged.pages[name], dtype, self.numel)
        return paged

    def bind(self, paged: Paged, optimizer: Optimizer, entries: Sequence[tuple[nn.Parameter, int, Tensor]]) -> None:
        """Point the parameters, their gradients and their optimizer state at the paged-in regions."""
        master = paged.views["master"]
        self._apply_writes_at_rest(master)
        prefix = _prefix(optimizer)
        for param, slot, grad in entries:
            param.data = self.buffer.shaped(self.buffer.owned(master, slot), slot)
            stepped = grad is not None and not self.buffer.owned_elsewhere(slot)
            param.grad = self.buffer.shaped(grad, slot) if stepped else None
            state = optimizer.state.get(param)
            if not state:
                continue
            for name, view in paged.views.items():
                if name.startswith(prefix) and slot in self.slots_with[name]:
                    state[name.removeprefix(prefix)] = self.buffer.shaped(self.buffer.owned(view, slot), slot)

    def unbind(self, paged: Paged, optimizer: Optimizer, entries: Sequence[tuple[nn.Parameter, int, Tensor]]) -> None:
        """After the optimizer stepped: the new shard reaches the device, state moves into the regions (new state
        gets one), and the optimizer keeps placeholders."""
        self.buffer.assign_shard(paged.views["master"])
        self._sync_pending = False
        self._take_state(paged, optimizer, [(param, slot) for param, slot, _ in entries])
        for param, slot, _ in entries:
            param.grad = None
            param.data = self.step_view(slot)  # the page is freed once written back, not at the end of the step
        self.buffer.settle()  # offload_params="nvme": the new shard goes to its region too

    def page_out(self, paged: Paged) -> None:
        """Write the paged-in regions back (in a worker thread)."""
        for name, page in paged.pages.items():
            self.swap.write(self.regions[name][0], page)

    def _take_state(self, paged: Paged, optimizer: Optimizer, params: Sequence[tuple[nn.Parameter, int]]) -> None:
        prefix = _prefix(optimizer)
        for param, slot in params:
            state = optimizer.state.get(param)
            if not state:
                continue
            numel = self.buffer.pieces[slot].numel
            for key, value in list(state.items()):
                if not isinstance(value, Tensor) or value.dim() == 0 or value.numel() != numel:
                    continue
                name = prefix + key
                if name not in self.regions:
                    region = self._new_region(name, value.dtype)
                    paged.pages[name] = aligned_empty(region.padded)
                    paged.views[name] = _typed(paged.pages[name], value.dtype, self.numel).zero_()
                    self.slots_with[name] = set()
                elif name not in paged.pages:  # a region of this optimizer not paged in: state made outside a step
                    paged.pages[name] = self.swap.read(self.regions[name][0])
                    paged.views[name] = _typed(paged.pages[name], value.dtype, self.numel)
                target = self.buffer.owned(paged.views[name], slot)
                if target.data_ptr() != value.data_ptr() or numel == 0:
                    target.copy_(value.reshape(-1))  # whole-tensor owners step it in the parameter's shape
                self.slots_with[name].add(slot)
                state[key] = torch.empty(0, dtype=value.dtype, device=HOST)  # see [Note: paged optimizer steps]

    def _apply_writes_at_rest(self, master: Tensor) -> None:
        """Parameter values written between steps (stages 1 and 2, or a write-back at stage 3) reach the master."""
        if self.buffer.may_change_at_rest or self._sync_pending:
            shard = self.buffer.shard.to(HOST)
            torch.where(shard != master.to(shard.dtype), shard.to(master.dtype), master, out=master)

    # ------------------------------------------------------------------ outside the step
    def absorb_state(self, optimizer: Optimizer, params: Sequence[tuple[nn.Parameter, int]]) -> None:
        """Move in-memory state ``optimizer`` holds for ``params`` (loaded from a checkpoint) into the file."""
        if not any(
            isinstance(v, Tensor) and v.dim() > 0 and v.numel() > 0
            for p, _ in params
            for v in optimizer.state.get(p, {}).values()
        ):
            return
        self.flush()
        prefix = _prefix(optimizer)
        for name in [n for n in self.slots_with if n.startswith(prefix)]:
            kept = {slot for slot in self.slots_with[name] if _has_placeholder(optimizer, params, slot, name)}
            self.slots_with[name] = kept
        paged = Paged()
        self._take_state(paged, optimizer, params)
        self.page_out(paged)

    def read_state(self, optimizer: Optimizer, params: Sequence[tuple[nn.Parameter, int]]) -> dict[int, dict]:
        """The state of ``params`` with its element-wise tensors read from the file (copies; read-only maps of it
        inside :meth:`SwapFile.mapped_reads`), by ``id(param)``."""
        prefix = _prefix(optimizer)
        pages = {name: self._read(name) for name in self.regions if name.startswith(prefix)}
        mapped = self.swap.map_reads
        states: dict[int, dict] = {}
        for param, slot in params:
            state = optimizer.state.get(param)
            if not state:
                continue
            full = dict(state)
            for name, view in pages.items():
                if slot in self.slots_with[name]:
                    piece = self.buffer.owned(view, slot)
                    full[name.removeprefix(prefix)] = piece if mapped else piece.clone()
            states[id(param)] = full
        return states

    def forget_state(self, optimizer: Optimizer) -> None:
        """``optimizer``'s state was cleared: its regions hold nothing any more."""
        prefix = _prefix(optimizer)
        for name in self.slots_with:
            if name.startswith(prefix):
                self.slots_with[name].clear()

    def step_view(self, slot: int) -> Tensor:
        """A stand-in of the piece's size that holds no memory: the parameter is stepped in :func:`run_paged`,
        and ``optimizer.step()`` itself then sees it without a gradient."""
        return torch.empty((), dtype=self.master_dtype).expand(self.buffer.pieces[slot].numel)

    def best(self) -> Tensor:
        if self._staged is not None:
            return self._staged
        if self.swap.map_reads and not (self.buffer.may_change_at_rest or self._sync_pending):
            return self._read("master")  # nothing written at rest to apply: the file holds the values
        master = _typed(self.swap.read(self.regions["master"][0]), self.master_dtype, self.numel)
        self._apply_writes_at_rest(master)
        return master

    def _read(self, name: str) -> Tensor:
        """Region ``name``'s values: a copy, or a read-only map inside :meth:`SwapFile.mapped_reads`."""
        region, dtype = self.regions[name]
        if self.swap.map_reads:
            return self.swap.map(region, dtype, self.numel)
        return _typed(self.swap.read(region), dtype, self.numel)

    def step_grads(self, slots: Sequence[int], held: Sequence[Tensor], scale: float | None) -> list[Tensor]:
        return host_step_grads(self.buffer, self.master_dtype, slots, held, scale)

    def release(self, held: Sequence[Tensor], step_grads: Sequence[Tensor], clipped: bool, scale: float | None) -> None:
        host_release_grads(held, step_grads, clipped, scale)

    def finish(self) -> None:
        """Nothing to do: :meth:`unbind` rounded each paged-in master into the shard."""

    def sync_from_params(self) -> None:
        self.buffer.reattach()
        self._sync_pending = True  # applied when the master is next read

    def load_owned(self, slot: int, values: Tensor) -> None:
        if self._staged is None:
            if self.swap.staged is not None:
                self.swap.staged.flush()
            self._staged = self.best().clone()
            self.swap.staged = self
        self.buffer.owned(self._staged, slot).copy_(values)
        self.buffer.load_owned(slot, values)

    def flush(self) -> None:
        """Write a master staged by :meth:`load_owned` to the file."""
        if self._staged is None:
            return
        region = self.regions["master"][0]
        page = aligned_empty(region.padded)
        _typed(page, self.master_dtype, self.numel).copy_(self._staged)
        self.swap.write(region, page)
        self._staged = None
        self._sync_pending = False
        if self.swap.staged is self:
            self.swap.staged = None

    @property
    def offloaded_nbytes(self) -> int:
        return sum(region.nbytes for region, _ in self.regions.values())


class ShardOnDisk:
    """A stage-3 parameter shard at rest in a region of the swap file (``offload_params="nvme"``); see
    :class:`~lightning_zero.core.flat_buffer.ShardedBuffer`."""

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
        return _typed(self.swap.read(self.region), dtype, numel)

    def holds(self, shard: Tensor) -> bool:
        return self.region is not None

    def get_async(self, dtype: torch.dtype, numel: int) -> Future[Tensor]:
        """:meth:`get` on the swap file's worker threads (a read-ahead)."""
        return self.swap.pool.submit(self.get, dtype, numel)

    @property
    def nbytes(self) -> int:
        """Bytes of the region (0 before the first :meth:`put`)."""
        return self.region.nbytes if self.region is not None else 0


def run_paged(
    optimizer: Optimizer,
    work: Sequence[PagedWork],
    raw_step: Callable[[], Any],
    comm: Communicator,
    device: torch.device,
) -> None:
    """Step ``optimizer`` over paged stores, one store at a time, reading ahead and writing behind. See [Note:
    paged optimizer steps]. ``work`` holds each store with its parameters and their step gradients (made in its
    turn, see [Note: paged step gradients]); every parameter's ``grad`` must be ``None`` on entry (the others'
    too). Collective: ranks agree on I/O errors."""
    failure: BaseException | None = None
    try:
        _pipeline(optimizer, work, raw_step)
    except BaseException as error:  # agreed below, then raised on every rank
        failure = error
    failed = torch.tensor(int(failure is not None), dtype=torch.uint8, device=device)
    comm.all_reduce(failed, op="max")
    if failure is not None:
        raise failure
    if failed.item():
        raise SwapIOError("offload: another rank failed to read or write its swap file during the step (see its error)")


def _pipeline(optimizer: Optimizer, work: Sequence[PagedWork], raw_step: Callable[[], Any]) -> None:
    if not work:
        return
    swap = work[0].store.swap  # type: ignore[attr-defined]
    if swap.staged is not None:
        swap.staged.flush()
    reads: dict[int, Future[Paged]] = {}
    writes: dict[int, Future[None]] = {}

    def read(index: int) -> None:
        work[index].read_ahead()
        reads[index] = swap.pool.submit(work[index].store.page_in, optimizer)  # type: ignore[attr-defined]

    try:
        for index in range(min(PIPELINE_DEPTH - 1, len(work))):
            read(index)
        for index, item in enumerate(work):
            store: DiskStore = item.store  # type: ignore[assignment]
            paged = reads.pop(index).result()
            ahead = index + PIPELINE_DEPTH - 1
            if ahead < len(work):
                if index - 1 in writes:  # at most PIPELINE_DEPTH buffers in memory: the oldest is written first
                    writes.pop(index - 1).result()
                read(ahead)
            grads = item.make_grads()
            entries = [(param, slot, grad) for (param, slot), grad in zip(item.params, grads, strict=True)]
            store.bind(paged, optimizer, entries)
            try:
                raw_step()
            finally:
                store.unbind(paged, optimizer, entries)
                item.drop_grads(grads)
            writes[index] = swap.pool.submit(store.page_out, paged)
        for future in writes.values():
            future.result()
    finally:
        for future in [*reads.values(), *writes.values()]:
            future.cancel()


def _prefix(optimizer: Optimizer) -> str:
    return f"{id(optimizer)}/"


def _typed(page: Tensor, dtype: torch.dtype, numel: int) -> Tensor:
    return page[: numel * dtype.itemsize].view(dtype)


def _has_placeholder(optimizer: Optimizer, params: Sequence[tuple[nn.Parameter, int]], slot: int, name: str) -> bool:
    key = name.split("/", 1)[1]
    for param, param_slot in params:
        if param_slot == slot:
            value = optimizer.state.get(param, {}).get(key)
            return isinstance(value, Tensor) and value.numel() == 0
    return False
