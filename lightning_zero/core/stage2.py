"""Stage 2: only the rank's gradient shard persists; each bucket is reduce-scattered during backward.

A bucket's full gradient lives in a staging buffer from its first gradient until its reduce-scatter
completes; the averaged result is added into the persistent shard (4Ψ/N bytes in fp32). Every
backward pass reduces, micro-batches of gradient accumulation included, so per rank the model
states cost 4Ψ + 12Ψ/N bytes for fp32 Adam plus the staging buckets in flight.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_zero.core.buckets import GradBucket
from lightning_zero.core.comm import Communicator
from lightning_zero.core.flat_buffer import FlatParamBuffer


class ShardGradBucket(GradBucket):
    """A bucket that keeps only this rank's shard of the averaged gradient."""

    staging: Tensor | None  # 1D, layout.padded_numel while the bucket is being filled or reduced

    def __init__(self, buffer: FlatParamBuffer, comm: Communicator) -> None:
        super().__init__(buffer, comm)
        self.shard_grad = torch.zeros_like(buffer.shard)
        self.staging = None
        self._overwrite = False  # the shard holds nothing live, so the reduction may write it directly
        self._output: Tensor | None = None

    def _start_cycle(self) -> None:
        for view in self._dead_piece_views(self.shard_grad):
            view.zero_()
        self._overwrite = not any(self._live_before)

    def _accumulate(self, slot: int, grad: Tensor) -> None:
        if self.staging is None:
            self.staging = torch.zeros_like(self.buffer.data)
        self._slot_view(self.staging, slot).add_(grad)

    def _start_reduce(self) -> None:
        if self.staging is None:
            self.staging = torch.zeros_like(self.buffer.data)
        # Divide before summing, as DDP does, so the result matches it and fp16 sums stay in range.
        self.staging.div_(self.comm.world_size)
        self._output = self.shard_grad if self._overwrite else torch.empty_like(self.shard_grad)
        self._work = self.comm.reduce_scatter(self._output, self.staging, async_op=True)

    def _finish_reduce(self) -> None:
        self._work.wait()
        if self._output is not self.shard_grad:
            self.shard_grad.add_(self._output)
        self._work, self._output, self.staging = None, None, None
        self._overwrite = False

    @property
    def nbytes(self) -> int:
        staging = 0 if self.staging is None else self.staging.numel() * self.staging.element_size()
        return self.shard_grad.numel() * self.shard_grad.element_size() + staging
