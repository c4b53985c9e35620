"""The step gradients of one optimizer: made from the held, reduced gradients before its step (cast, divided by the
loss scale), clipped in place, and given back to the stores after it (see [Note: the step window] in
optimizer_step.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set

import torch
from torch import Tensor

from lightning_zero.core.peak import DETACHED, PeakLedger, Tracked
from lightning_zero.core.step.entry import StepEntry
from lightning_zero.core.step.paged import PagedStepGrads


def _wide_nbytes(step_grads: StepGrads, grads: Sequence[Tensor | None]) -> int:
    """Bytes of step gradients that are copies (wide, of a master), not the held gradients themselves."""
    if not grads:
        return 0
    storages = {  # by address: a view's untyped_storage() is a new object each time, its id may be reused
        g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
        for g, e in zip(grads, step_grads.entries, strict=False)
        if g is not None and not _same_storage(g, e.bucket.held(e.slot))
    }
    return sum(storages.values())


class StepGrads:
    """The step gradients of an optimizer's managed parameters (:attr:`entries`, set by its step): those of
    in-memory stores made at once, one per entry; those of paged stores when needed (see [Note: paged step
    gradients])."""

    ledger: PeakLedger = DETACHED  # counts the wide ones (see [Note: step peak ledger])
    made: Tracked[list[Tensor | None]] = Tracked("temporaries", _wide_nbytes)  # per entry (paged: None)

    def __init__(self) -> None:
        self.entries: list[StepEntry] = []
        self.freed_after_step: Set[int] = frozenset()  # ids of parameters whose gradients the step's end empties
        self.scale: float | None = None  # what the held gradients were divided by
        self.clipped = False
        self.made = []
        self.paged = PagedStepGrads([], None)

    def make(self, scale: float | None) -> None:
        """Make the step gradients of the held ones divided by ``scale``, not clipped yet."""
        grads: list[Tensor | None] = [None] * len(self.entries)
        by_store: dict[int, list[int]] = {}
        for index, entry in enumerate(self.entries):
            if entry.bucket.live[entry.slot] and not entry.store.paged:
                by_store.setdefault(id(entry.store), []).append(index)
        for indices in by_store.values():
            store = self.entries[indices[0]].store
            held = [self._held(index) for index in indices]
            made = store.step_grads([self.entries[i].slot for i in indices], held, scale)
            for index, grad in zip(indices, made, strict=True):
                grads[index] = grad
        self.made = grads
        self.paged = PagedStepGrads(self.entries, scale, self.freed_after_step)  # see [Note: paged step gradients]
        self.scale, self.clipped = scale, False

    def _held(self, index: int) -> Tensor:
        entry = self.entries[index]
        held = entry.bucket.held(entry.slot)
        assert held is not None
        return held

    def overflow(self, device: torch.device) -> Tensor:
        """A uint8 flag on ``device``: whether a step gradient holds an inf or a NaN."""
        overflow = torch.zeros((), dtype=torch.uint8, device=device)
        for grad in self.made:
            if grad is not None:
                overflow |= (~torch.isfinite(grad).all()).to(device)  # no host sync per tensor on the device
        for _, grads in self.paged.each():
            for grad in grads:
                overflow |= (~torch.isfinite(grad).all()).to(device)  # paged: on the host
        return overflow

    def transform(self, fn: Callable[[Tensor], object]) -> None:
        """Clip every step gradient in place: now where they are in memory, when made for paged stores."""
        self.clipped = True
        for grad in self.made:
            if grad is not None:
                fn(grad)
        self.paged.transform(fn)

    def per_gradient(self, fn: Callable[[Tensor], Tensor]) -> list[Tensor]:
        """``fn`` of every non-empty step gradient, in the order of the entries (paged stores streamed)."""
        by_index = self.per_entry(fn)
        return [by_index[i] for i in sorted(by_index)]

    def per_entry(self, fn: Callable[[Tensor], Tensor]) -> dict[int, Tensor]:
        """``fn`` of every non-empty step gradient, by the index of its entry (paged stores streamed)."""
        by_index: dict[int, Tensor] = {i: fn(g) for i, g in enumerate(self.made) if g is not None and g.numel()}
        for indices, grads in self.paged.each():
            by_index.update((i, fn(g)) for i, g in zip(indices, grads, strict=True) if g.numel())
        return by_index

    def current(self) -> list[Tensor]:
        """Every step gradient, in the order of the entries (copies for paged stores)."""
        by_index = {i: g for i, g in enumerate(self.made) if g is not None}
        for indices, grads in self.paged.each():
            by_index.update((i, g.clone()) for i, g in zip(indices, grads, strict=True))
        return [by_index[i] for i in sorted(by_index)]

    def release(self) -> None:
        """Give the step gradients back to their stores (clipped values reach the held gradients) and drop them."""
        self.paged.finish()
        by_store: dict[int, list[int]] = {}
        for index, grad in enumerate(self.made):
            if grad is not None:
                by_store.setdefault(id(self.entries[index].store), []).append(index)
        for indices in by_store.values():
            store = self.entries[indices[0]].store
            held = [self._held(i) for i in indices]
            store.release(held, [self.made[i] for i in indices], self.clipped, self.scale)  # type: ignore[misc]
        self.made = []

    @property
    def nbytes(self) -> int:
        """Bytes of step gradients held now (wide copies of the masters' gradients exist only during a step)."""
        return _wide_nbytes(self, self.made)


def _same_storage(a: Tensor, b: Tensor | None) -> bool:
    return b is not None and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
