"""Sharded saves that finish in the background while training goes on.

[Note: asynchronous sharded saves]
With Lightning's ``AsyncCheckpointIO`` plugin a sharded save is split in two (see checkpoint/saving.py):

* :func:`begin_save`, on the training thread: the ranks agree on a name for the new directory, and each rank takes
  a *snapshot* of what its files will hold: its shards and optimizer state are copied into host memory (state that
  rests in the swap file, with ``offload_*="nvme"``, is written straight into the new file instead, i.e. into the
  page cache). The next step waits for this alone.
* :func:`finish_save`, on one worker thread a rank: the files are written and flushed to the disk, the ranks agree
  that every file is there and rank 0 commits the directory, all or nothing, exactly as a synchronous save does.
  Its collectives run over a process group of its own (created at the first asynchronous save, where every rank
  saves), so they never interleave with the training thread's.

One save is in flight at a time: a new save first waits for the previous one to commit, so at most one snapshot
(the rank's share of the model states) is held. Its copies are kept after the write and refilled by the next save
(a copy into memory already mapped costs a third of a clone's time), so a rank holds one copy of its files'
tensors in host memory (``snapshot_bytes``) to the end of ``fit``. They are made ahead of the first save
(:meth:`BackgroundSaves.prepare`, at the start of the first training step after an optimizer step, once the
optimizer state exists): the worker thread allocates them and touches every page, so the first save's step waits
for a refill as every later one does, not for the allocation and the page faults (1.1-2.7 s for 1.1 GiB on a
shared CPU host). A save that comes first allocates what it lacks itself. A checkpoint
removed while a save is in flight (``ModelCheckpoint(save_top_k=k)`` deleting the oldest) is removed only after
that save committed, so a crash at any moment leaves the last committed checkpoint. The training thread learns
the outcome at agreed points only:
each training step's start while a save is in flight (a 4-byte all-reduce of "done here", so that every rank sees
the save finished at the same step), the next save, and the end of ``fit``. A failed write (a full disk on one
rank) is agreed inside :func:`finish_save`, so every rank raises the same ``CheckpointError``, naming the rank and
the file, at the same step.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_zero.checkpoint.saving import PendingSave, begin_save, finish_save, remove_sharded, snapshot_copies
from lightning_zero.core.comm import Communicator
from lightning_zero.core.named_state import NamedState


class BackgroundSaves:
    """At most one sharded save in flight, finished by a worker thread over a process group of its own."""

    def __init__(self) -> None:
        self._comm: Communicator | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future[None] | None = None
        self._pending: PendingSave | None = None
        self._removals: list[Path] = []
        self._staging: list[torch.Tensor] = []  # the last snapshot's copies (or those made ahead), refilled by the next
        self._preparing: Future[list[torch.Tensor]] | None = None  # copies being made ahead of the first save
        self._prepared = False  # prepare() ran this fit (once is enough)
        self._committed = False  # the save in flight committed (its removals are done or made by the caller)
        self._lock = threading.Lock()
        self.saves = 0  # started
        self.peak_snapshot_bytes = 0  # the largest snapshot held, this rank
        self.allocated_in_saves = 0  # bytes of snapshot copies that saves had to allocate (none made ahead fit)

    def __reduce__(self) -> tuple[type[BackgroundSaves], tuple[()]]:
        """A copy in another process (a strategy pickled for ``start_method="spawn"``) starts with no save."""
        return BackgroundSaves, ()

    @property
    def in_flight(self) -> bool:
        """Whether a save was started and its outcome not taken yet (the same on every rank)."""
        return self._future is not None

    @property
    def snapshot_bytes(self) -> int:
        """Bytes this rank holds now in snapshot copies (kept for the next save until :meth:`close`)."""
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self._staging}.values())

    def start(self, state: NamedState, path: str | Path, extra: dict[str, Any], **options: Any) -> None:
        """Snapshot ``state`` for a save to ``path`` and finish it in the background (collective). Waits first for
        a save in flight (and raises its error)."""
        self.wait()
        self._take_prepared(wait=True)
        if self._comm is None:  # collective: every rank makes its first asynchronous save here
            self._comm = state.world.split([list(state.world.ranks)], "checkpoint")
        extra = _copied(extra)
        with state.saving():  # state resting in the swap file is read from maps of it
            pending = begin_save(state, path, extra, snapshot=True, staging=self._staging, **options)
        if pending.staged:
            self._staging = pending.staged
        self.saves += 1
        self.peak_snapshot_bytes = max(self.peak_snapshot_bytes, pending.snapshot_bytes)
        self.allocated_in_saves += pending.allocated_bytes
        self._pending, self._committed = pending, False
        device = torch.cuda.current_device() if _cuda() else None
        self._future = self._worker().submit(self._finish, pending, device)

    @property
    def unprepared(self) -> bool:
        """No copies were made ahead this fit, and no save made them yet (:meth:`prepare` would make them)."""
        return not (self._prepared or self._staging or self._future is not None)

    def prepare(self, state: NamedState) -> None:
        """Make the copies that the first save's snapshot of ``state`` will need, on the worker thread, while
        training goes on (local, no collective; once a fit, and only before its first save): see [Note:
        asynchronous sharded saves]. Call it once the optimizer state exists (after an optimizer step)."""
        if not self.unprepared:
            return
        self._prepared = True
        copies = snapshot_copies(state)
        if copies:
            self._preparing = self._worker().submit(_allocated, copies)

    def _take_prepared(self, wait: bool) -> None:
        """Hold the copies made ahead once they are made (``wait``: wait for them); an allocation that failed is
        left to the save (which raises where memory is short)."""
        if self._preparing is None or not (wait or self._preparing.done()):
            return
        preparing, self._preparing = self._preparing, None
        try:
            made = preparing.result()
        except Exception:  # the save allocates what it lacks, and reports its own error
            return
        self._staging = made
        self.peak_snapshot_bytes = max(self.peak_snapshot_bytes, self.snapshot_bytes)

    def _worker(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning-zero-save")
        return self._executor

    def _finish(self, pending: PendingSave, device: int | None) -> None:
        if device is not None:
            torch.cuda.set_device(device)  # NCCL stages this thread's objects on the rank's device
        assert self._comm is not None
        finish_save(pending, self._comm)  # raises on every rank where any failed: nothing is removed then
        with self._lock:
            removals, self._removals, self._committed = self._removals, [], True
        if self._comm.rank == 0:
            for path in removals:
                remove_sharded(path)
        self._comm.barrier()  # once the save's outcome is taken on any rank, its removals are done

    def remove_later(self, path: str | Path) -> bool:
        """Queue ``path`` for removal once the save in flight committed (``True``), or ``False`` where none is in
        flight or it committed already: remove it now. A save that failed removes nothing (its error is raised at
        the next poll)."""
        with self._lock:
            if self._future is None or self._committed:
                return False
            self._removals.append(Path(path))
            return True

    def poll(self, world: Communicator) -> None:
        """At a training step's start: take the outcome of the save in flight if it finished on every rank (a
        4-byte all-reduce, only while one is in flight); raises its error on every rank."""
        self._take_prepared(wait=False)
        if self._future is None:
            return
        done = torch.tensor([int(self._future.done())], dtype=torch.int32)
        world.all_reduce(done, op="min", label="agree")
        if done.item():
            self.wait()

    def wait(self) -> None:
        """Wait for the save in flight (if any) and raise its error."""
        future, self._future = self._future, None
        if future is None:
            return
        try:
            future.result()
        finally:
            self._pending = None

    def close(self) -> None:
        """Wait for the save in flight and end the worker thread; raises the save's error."""
        try:
            self.wait()
        finally:
            self._staging, self._preparing, self._prepared = [], None, False
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _copied(extra: dict[str, Any]) -> dict[str, Any]:
    """``extra`` (Lightning's loops, callbacks, schedulers) with its tensors copied: the save writes it later."""
    return apply_to_collection(extra, torch.Tensor, lambda t: t.detach().clone())


def _allocated(copies: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """New host tensors of these shapes and dtypes, every page written once (the faults taken here, not in the
    step that fills them)."""
    made = []
    for shape, dtype in copies:
        tensor = torch.empty(shape, dtype=dtype)
        if tensor.numel():
            tensor.view(-1).view(torch.uint8)[::_PAGE].zero_()
        made.append(tensor)
    return made


_PAGE = 4096
