"""Stage 2: only the rank's gradient shard persists; each bucket is reduce-scattered during backward.

A bucket's full gradient lives in a staging buffer from its first gradient until its reduce-scatter
completes; the averaged result is folded into the persistent shard (4Ψ/N bytes in fp32). Every
backward pass reduces, micro-batches of gradient accumulation included, so per rank the model
states cost 4Ψ + 12Ψ/N bytes for fp32 Adam plus the staging buckets in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_zero.core.buckets import GradBucket
from lightning_zero.core.comm import Communicator
from lightning_zero.core.flat_buffer import FlatParamBuffer


class ShardGradBucket(GradBucket):
    """A bucket that keeps only this rank's shard of the averaged gradient."""

    staging: Tensor | None  # 1D, layout.padded_numel while the bucket is being filled or reduced
    _output: Tensor | None  # 1D, layout.shard_numel while the reduction is in flight

    def __init__(self, buffer: FlatParamBuffer, comm: Communicator, reduce_dtype: torch.dtype | None = None) -> None:
        super().__init__(buffer, comm, reduce_dtype)
        self._shard_grad: Tensor | None = None  # created by the first reduction: evaluation never holds it
        self.staging = None
        self._output = None

    @property
    def shard_grad(self) -> Tensor:  # type: ignore[override]
        if self._shard_grad is None:
            self._shard_grad = torch.zeros_like(self.buffer.shard)
        return self._shard_grad

    def _begin_filling(self) -> None:
        """Nothing to prepare: the staging buffer is created with the first gradient."""

    def _accumulate(self, slot: int, grad: Tensor) -> None:
        self._slot_view(self._staging(), slot).add_(grad)

    def _staging(self) -> Tensor:
        if self.staging is None:
            shard = self.buffer.shard
            self.staging = torch.zeros(self.buffer.layout.padded_numel, dtype=self.reduce_dtype, device=shard.device)
        return self.staging

    def _start_reduce(self) -> None:
        staging = self._staging()
        # Divide before summing, as DDP does, so the result matches it and fp16 sums stay in range.
        staging.div_(self.comm.world_size)
        # When zero_grad emptied every piece (the usual case) the result may land in the shard directly.
        in_place = self.reduce_dtype == self.buffer.shard.dtype and not any(self.live)
        self._output = (
            self.shard_grad
            if in_place
            else torch.empty(self.buffer.shard.numel(), dtype=self.reduce_dtype, device=staging.device)
        )
        self._work = self.comm.reduce_scatter(self._output, staging, async_op=True)

    def _release_staging(self) -> None:
        self.staging = None

    def _fold_reduction(self, globally_used: Sequence[bool]) -> None:
        # See [Note: gradient liveness]: overwrite what zero_grad emptied, add to what is live.
        assert self._output is not None
        live = self.live
        if self._output is self.shard_grad:
            pass  # nothing was live, so the reduction wrote the shard in place
        elif all(globally_used) and all(live):
            self.shard_grad.add_(self._output)
        elif all(globally_used) and not any(live):
            self.shard_grad.copy_(self._output)
        else:
            for slot, (used, was_live) in enumerate(zip(globally_used, live, strict=True)):
                if used:
                    view, part = self.buffer.owned(self.shard_grad, slot), self.buffer.owned(self._output, slot)
                    view.add_(part) if was_live else view.copy_(part)
        self.live = [used or was_live for used, was_live in zip(globally_used, live, strict=True)]
        self.staging, self._output = None, None

    def _discard_pass(self) -> None:
        # A reduction written in place only replaced gradients that were not live; nothing else changed.
        self.staging, self._output = None, None

    @property
    def nbytes(self) -> int:
        held = [t for t in (self._shard_grad, self.staging) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)
