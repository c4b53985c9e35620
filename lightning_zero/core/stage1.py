"""Stage 1: full local gradients on every rank; each rank reduces into, and updates, only its shard.

A rank keeps a full-size gradient buffer (4Ψ bytes in fp32), so gradient accumulation needs no
communication until the last micro-batch. The reduce-scatter writes the averaged shard in place into
the rank's own segment of that buffer, so there is no separate shard copy: 4Ψ + 4Ψ + 8Ψ/N bytes for
fp32 Adam. After the optimizer updated the shard, the engine all-gathers the parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero.core.buckets import GradBucket
from lightning_zero.core.comm import Communicator
from lightning_zero.core.flat_buffer import FlatParamBuffer


class FullGradBucket(GradBucket):
    """A bucket whose full local gradient persists between backward passes."""

    full_grad: Tensor  # 1D, layout.padded_numel: local sums; after a reduction, own segment = average

    def __init__(self, buffer: FlatParamBuffer, comm: Communicator) -> None:
        super().__init__(buffer, comm)
        self.full_grad = torch.zeros_like(buffer.data)
        lo, hi = buffer.layout.shard_bounds(buffer.rank)
        self.shard_grad = self.full_grad[lo:hi]
        self._reduced = False  # own segment holds an averaged result, the rest was sent away
        self._live = [False] * len(buffer.params)  # pieces that held a gradient when accumulation restarted

    def _restart_accumulation(self) -> None:
        """Turn a reduced buffer back into a local one, keeping live gradients. See [Note: gradient liveness]."""
        if not self._reduced:
            return
        # The other segments were spent by the reduction; the own segment holds the average. Scaling
        # the live part by world_size makes it a local contribution that the next reduction (sum /
        # world_size) returns unchanged; pieces that zero_grad emptied start again from zero.
        lo, hi = self.buffer.layout.shard_bounds(self.buffer.rank)
        self.full_grad[:lo].zero_()
        self.full_grad[hi:].zero_()
        self._live = [param.grad is not None for _, param, _ in self._pieces()]
        for (_, _, view), live in zip(self._pieces(), self._live, strict=True):
            if not live:
                view.zero_()
        self.shard_grad.mul_(self.comm.world_size)
        self._reduced = False

    def _accumulate(self, slot: int, grad: Tensor) -> None:
        self._restart_accumulation()
        self._slot_view(self.full_grad, slot).add_(grad)

    def _start_reduce(self) -> None:
        self._restart_accumulation()
        # Divide before summing, as DDP does, so the result matches it and fp16 sums stay in range.
        self.full_grad.div_(self.comm.world_size)
        self._work = self.comm.reduce_scatter(self.shard_grad, self.full_grad, async_op=True)

    def _release_staging(self) -> None:
        """Nothing to free: the full gradient buffer persists by design."""

    def _fold_reduction(self, globally_used: Sequence[bool]) -> None:
        # The reduction already wrote the own segment in place; live gradients were folded in beforehand.
        self._reduced = True
        for (piece, param, view), live in zip(self._pieces(), self._live, strict=True):
            param.grad = view if globally_used[piece.slot] or live else None

    @property
    def nbytes(self) -> int:
        return self.full_grad.numel() * self.full_grad.element_size()
