"""Stage 1: full local gradients on every rank; each rank reduces into, and updates, only its shard.

A rank keeps a full-size gradient buffer (4Ψ bytes in fp32), so gradient accumulation needs no
communication until the last micro-batch. It is made by a step's first gradient and dropped by a ``zero_grad``
that empties every gradient in it, so the forward that follows does not hold it (DDP keeps its buckets). The
reduce-scatter writes the averaged shard in place into the rank's own segment of that buffer, so there is no
separate shard copy: 4Ψ + 4Ψ + 8Ψ/N bytes for fp32 Adam. After the optimizer updated the shard, the engine
all-gathers the parameters.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero.core.layout.flat_buffer import FlatParamBuffer
from lightning_zero.core.peak import Tracked
from lightning_zero.core.step.buckets import BucketState, GradBucket, part_of
from lightning_zero.core.step.reduction import GradientReduction


class FullGradBucket(GradBucket):
    """A bucket whose full local gradient persists between backward passes."""

    # Transient (see [Note: step peak ledger]): the bucket in a wider reduce_dtype and the reduction's output while
    # it runs; live reduced gradients kept across an accumulation.
    _staging: Tracked[Tensor | None] = Tracked("buckets")
    # (not counted while a part of _staging: see [Note: the result in the staging buffer])
    _output: Tracked[Tensor | None] = Tracked(
        "buckets", lambda bucket, t: _bytes(None if part_of(t, bucket._staging) else t)
    )
    _carry: Tracked[Tensor | None] = Tracked("buckets")

    def __init__(
        self, buffer: FlatParamBuffer, reduction: GradientReduction, reduce_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(buffer, reduction, reduce_dtype)
        self._full: Tensor | None = None  # made by the first gradient; dropped by a zero_grad that empties it all
        self._staging = None  # the bucket in reduce_dtype while a reduction in a wider dtype runs
        self._carry = None  # live reduced gradients kept across an accumulation (own segment)
        self._output = None
        self._reduced = False  # own segment holds an averaged result, the rest was sent away
        self._live_at_restart = [False] * len(buffer.params)  # live when accumulation restarted
        self._pass_continues_window = False  # the current pass adds to local sums of earlier passes

    @property
    def full_grad(self) -> Tensor:
        """1D, layout.padded_numel: local sums; after a reduction, the own segment holds the average."""
        if self._full is None:
            self._full = torch.zeros_like(self.buffer.data)
        return self._full

    @property
    def shard_grad(self) -> Tensor:  # type: ignore[override]
        lo, hi = self.buffer.bounds
        return self.full_grad[lo:hi]

    def clear(self, slots: Sequence[int], set_to_none: bool) -> None:
        super().clear(slots, set_to_none)
        for slot in slots:
            if set_to_none:
                self._live_at_restart[slot] = False
            if self._carry is not None:  # gradients set aside at the restart are cleared too
                self.buffer.owned(self._carry, slot).zero_()
            if not self._reduced and self._full is not None:  # and the local sums of an accumulation (no_sync)
                self._slot_view(self._full, slot).zero_()
                self.locally_used[slot] = False
        if self._holds_nothing:
            self._full = None  # as DDP's gradients after zero_grad(set_to_none=True), minus the bucket DDP keeps

    @property
    def _holds_nothing(self) -> bool:
        """No live gradient, no local sums, nothing set aside, no reduction running: the buffer can go."""
        return (
            self._reduced
            and self._carry is None
            and self.state is BucketState.IDLE
            and not any(self.live)
            and not any(self._live_at_restart)
        )

    def _begin_filling(self) -> None:
        self._pass_continues_window = any(self.locally_used)
        self._restart_accumulation()

    def _restart_accumulation(self) -> None:
        """Turn a reduced buffer back into a local one, keeping live gradients. See [Note: gradient liveness]."""
        if not self._reduced:
            return
        # The other segments were spent by the reduction; the own segment holds the average. The live part of
        # it is set aside and added to the next reduction's result (adding it to the local sums instead would
        # need it times world_size, which can overflow fp16); pieces that zero_grad emptied start from zero.
        self._live_at_restart = list(self.live)
        if any(self.live):
            self._carry = self.shard_grad.clone()
            for slot, live in enumerate(self.live):
                if not live:
                    self.buffer.owned(self._carry, slot).zero_()
        if self._full is not None:
            self._full.zero_()
        self._reduced = False

    def _accumulate(self, slot: int, grad: Tensor) -> None:
        self._slot_view(self.full_grad, slot).add_(grad)

    def _start_reduce(self) -> None:
        # Divide before summing, as DDP does, so the result matches it and fp16 sums stay in range.
        if self.reduce_dtype == self.full_grad.dtype:
            self.full_grad.div_(self.reduction.world_size)
            self._work = self.reduction.reduce_scatter(self.shard_grad, self.full_grad, self._sizes)
            return
        self._staging = self.full_grad.to(self.reduce_dtype).div_(self.reduction.world_size)
        self._output = self._wide_result(self._staging)
        self._work = self.reduction.reduce_scatter(self._output, self._staging, self._sizes)

    @property
    def _sizes(self) -> tuple[int, ...] | None:
        return self.buffer.layout.uneven_sizes

    def _release_staging(self) -> None:
        """Free the wide copy of the bucket (once the result in it is rounded in); the full gradient buffer itself
        persists by design."""
        if not part_of(self._output, self._staging):
            self._staging = None

    def _reduction_result(self) -> Tensor:
        return self._output if self._output is not None else self.shard_grad

    def _settle_reduced(self) -> None:
        """A reduction in a wider dtype is rounded into the own segment as soon as it completes: one wide result per
        bucket would otherwise wait for the end of backward."""
        if self._output is not None:
            self.shard_grad.copy_(self._output)
            self._output = self._staging = None

    def _fold_reduction(self, globally_used: Sequence[bool]) -> None:
        # The reduction wrote the own segment (in place, or in reduce_dtype to round into it now); live gradients
        # were set aside beforehand.
        if self._output is not None:
            self.shard_grad.copy_(self._output)
            self._output = self._staging = None
        if self._carry is not None:
            self.shard_grad.add_(self._carry)
            self._carry = None
        self._reduced = True
        self.live = [used or live for used, live in zip(globally_used, self._live_at_restart, strict=True)]
        self._live_at_restart = list(self.live)

    def _discard_pass(self) -> None:
        """Back to the gradients held after the last reduction; local sums of this window are lost."""
        if self._pass_continues_window:
            warnings.warn(
                "a backward pass raised at ZeRO stage 1 during gradient accumulation: the local gradients of the "
                "earlier micro-batches of this optimizer step are dropped with it (stage 1 sums them in one buffer).",
                stacklevel=3,
            )
        if self._full is not None:
            self._full.zero_()
        if self._carry is not None:
            self.shard_grad.copy_(self._carry)
        self._staging = self._output = self._carry = None
        self.live = list(self._live_at_restart)
        self.locally_used = [False] * len(self.buffer.params)
        self._reduced = True

    @property
    def nbytes(self) -> int:
        output = None if part_of(self._output, self._staging) else self._output  # (else counted with the staging)
        return sum(_bytes(t) for t in (self._full, self._staging, output, self._carry))


def _bytes(tensor: Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()
