"""Step gradients of paged stores, made one store at a time, never all at once.

[Note: paged step gradients]
A store whose optimizer state is paged in per buffer (``offload_optimizer="nvme"``) gets its step gradients
(cast, divided by the loss scale) the same way, so a step never holds the wide gradients of the whole shard:
:class:`PagedStepGrads` makes one store's gradients when they are needed and drops them right after. Whatever
needs all of them streams over the stores in the same way: the overflow check, the clipping norm (its terms
summed in the optimizer's parameter order, as for in-memory stores, so both give the same bits), and
``gradients()``. Clipping is recorded as a transform and applied to each store's gradients when they are made;
once applied, the clipped values go back into the held gradient (torch keeps a clipped gradient), so each
transform reaches each gradient exactly once, in the step or, for a step that does not come, when it is dropped.
Held gradients that rest on disk (see :class:`~lightning_zero.core.step.shard_bucket.ShardGradBucket`) are read for
their store's turn and go back to disk after it.

[Note: the write a free makes needless]
A held gradient resting on disk that a step changed (clipped, or divided by the loss scale and multiplied back) is
written back after its store's turn, so that what rests is what torch would leave in ``grad``. With
``free_gradients_after_step`` the end of the step empties it (see [Note: freeing gradients after the step]), so
that write is needless where every live gradient of the bucket is emptied: the store's turn in the step leaves what
rests as it was (a gradient shard's bytes fewer to write per step: 2 or 4 an element). Each group counts the
transforms that what rests carries (``rested``); a step that raises after some turns (an I/O error) makes the
held gradients that again (:meth:`PagedStepGrads.rewind`), so a retried step applies those transforms again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence, Set
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.core.comm import Communicator
from lightning_zero.core.step.entry import StepEntry
from lightning_zero.core.store.disk import PIPELINE_DEPTH, DiskStore, Paged
from lightning_zero.core.store.swap import SwapIOError

Transform = Callable[[Tensor], object]


@dataclass
class PagedGroup:
    """The live parameters of one paged store: their indices among the optimizer's entries."""

    indices: list[int]
    entries: list[StepEntry]
    applied: int = 0  # how many transforms the held gradients already carry
    rested: int = 0  # how many of them what rests on disk carries (see [Note: the write a free makes needless])
    emptied_after: bool = False  # the step's end empties every live gradient of the group's bucket


@dataclass
class PagedWork:
    """One paged store's part of a step (see :func:`run_paged`): its parameters,
    and how their step gradients are made, dropped and read ahead."""

    store: object
    params: list[tuple[nn.Parameter, int]]
    make_grads: Callable[[], list[Tensor]]
    drop_grads: Callable[[list[Tensor]], None]
    read_ahead: Callable[[], None] = field(default=lambda: None)


class PagedStepGrads:
    """The step gradients of an optimizer's paged stores. See [Note: paged step gradients].

    Args:
        entries: the optimizer's managed parameters (of every store).
        scale: what the held gradients are divided by.
    """

    def __init__(self, entries: Sequence[StepEntry], scale: float | None, freed: Set[int] = frozenset()) -> None:
        self.scale = scale
        self.transforms: list[Transform] = []
        groups: dict[int, PagedGroup] = {}
        for index, entry in enumerate(entries):
            if entry.store.paged and entry.bucket.live[entry.slot]:
                group = groups.setdefault(id(entry.store), PagedGroup([], []))
                group.indices.append(index)
                group.entries.append(entry)
        for group in groups.values():
            emptied = {e.slot for e in group.entries if id(e.param) in freed}
            group.emptied_after = all(slot in emptied for slot, live in enumerate(group.entries[0].bucket.live) if live)
        self.groups = list(groups.values())

    def __bool__(self) -> bool:
        return bool(self.groups)

    def make(self, group: PagedGroup) -> list[Tensor]:
        """The step gradients of ``group``, with every transform they do not carry yet applied."""
        store = group.entries[0].store
        grads = store.step_grads([e.slot for e in group.entries], self._held(group), self.scale)
        for transform in self.transforms[group.applied :]:
            for grad in grads:
                transform(grad)
        return grads

    def drop(self, group: PagedGroup, grads: list[Tensor], stepped: bool = False) -> None:
        """End ``grads`` of ``group``: newly applied transforms stay in the held gradients. ``stepped``: the
        optimizer just stepped on them (see [Note: the write a free makes needless])."""
        clipped = group.applied < len(self.transforms)
        changed = clipped or self.scale is not None
        group.entries[0].store.release(self._held(group), grads, clipped, self.scale)
        group.applied = len(self.transforms)
        rests = group.entries[0].bucket.settle(write=changed and not (stepped and group.emptied_after))
        if rests or not changed:
            group.rested = group.applied

    def rewind(self) -> None:
        """The step raised after some groups were dropped: their held gradients are what rests on disk, so the
        transforms not written with them reach them again when they are next made."""
        for group in self.groups:
            group.applied = group.rested

    def each(self) -> Iterator[tuple[list[int], list[Tensor]]]:
        """Every group's indices and step gradients, one group at a time."""
        for group in self.groups:
            grads = self.make(group)
            try:
                yield group.indices, grads
            finally:
                self.drop(group, grads)

    def transform(self, fn: Transform) -> None:
        """Apply ``fn`` in place to every step gradient (clipping), when each is next made."""
        self.transforms.append(fn)

    def work(self) -> list[PagedWork]:
        """What :func:`run_paged` steps, one store at a time."""
        return [
            PagedWork(
                group.entries[0].store,
                [(e.param, e.slot) for e in group.entries],
                lambda group=group: self.make(group),
                lambda grads, group=group: self.drop(group, grads, stepped=True),
                group.entries[0].bucket.read_ahead,
            )
            for group in self.groups
        ]

    def finish(self) -> None:
        """The step is over or will not come: transforms not applied yet reach the held gradients."""
        for group in self.groups:
            if group.applied < len(self.transforms):
                self.drop(group, self.make(group))
        self.groups = []

    @staticmethod
    def _held(group: PagedGroup) -> list[Tensor]:
        held = [e.bucket.held(e.slot) for e in group.entries]
        assert all(grad is not None for grad in held)
        return held  # type: ignore[return-value]


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
