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
Held gradients that rest on disk (see :class:`~lightning_zero.core.stage2.ShardGradBucket`) are read for their
store's turn and go back to disk after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import Tensor, nn

if TYPE_CHECKING:
    from lightning_zero.core.step import StepEntry

Transform = Callable[[Tensor], object]


@dataclass
class PagedGroup:
    """The live parameters of one paged store: their indices among the optimizer's entries."""

    indices: list[int]
    entries: list[StepEntry]
    applied: int = 0  # how many transforms the held gradients already carry


@dataclass
class PagedWork:
    """One paged store's part of a step (see :func:`~lightning_zero.core.offload.disk.run_paged`): its parameters,
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

    def __init__(self, entries: Sequence[StepEntry], scale: float | None) -> None:
        self.scale = scale
        self.transforms: list[Transform] = []
        groups: dict[int, PagedGroup] = {}
        for index, entry in enumerate(entries):
            if entry.store.paged and entry.bucket.live[entry.slot]:
                group = groups.setdefault(id(entry.store), PagedGroup([], []))
                group.indices.append(index)
                group.entries.append(entry)
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

    def drop(self, group: PagedGroup, grads: list[Tensor]) -> None:
        """End ``grads`` of ``group``: newly applied transforms stay in the held gradients."""
        clipped = group.applied < len(self.transforms)
        group.entries[0].store.release(self._held(group), grads, clipped, self.scale)
        group.applied = len(self.transforms)
        group.entries[0].bucket.settle(write=clipped or self.scale is not None)

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
        """What :func:`~lightning_zero.core.offload.disk.run_paged` steps, one store at a time."""
        return [
            PagedWork(
                group.entries[0].store,
                [(e.param, e.slot) for e in group.entries],
                lambda group=group: self.make(group),
                lambda grads, group=group: self.drop(group, grads),
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
