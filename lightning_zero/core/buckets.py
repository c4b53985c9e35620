"""Gradient buckets: collect gradients in backward and reduce-scatter each bucket as soon as it is complete.

[Note: bucket order]
Buckets are reduced in a fixed order (their index, roughly reverse registration order, which is
roughly backward order), whatever order their gradients arrive in: bucket ``i`` is launched only
after buckets ``0..i-1``. Ranks whose graphs differ (a parameter unused on one rank) therefore still
issue the same collectives in the same order. At the end of a reducing backward every bucket is
launched, complete or not (missing gradients count as zero), as DDP does, followed by one small
all-reduce of which parameters got a gradient on any rank in this pass.

[Note: gradient liveness]
torch's contract is that gradients accumulate until ``zero_grad``. The optimizer sees the reduced
gradient through its pieces (see [Note: parameter views and optimizer pieces]); ``zero_grad`` sets a
piece's ``grad`` to ``None`` or zeroes it in place, at any time, e.g. between the backward passes of
two optimizers. So a bucket looks at its pieces each time it folds a new reduction into its storage:
a piece whose ``grad`` is ``None`` holds nothing and is overwritten, a live one is added to. After
each reducing pass a piece gets ``grad`` = its slice of the reduced shard, unless its parameter got no
gradient on any rank in the pass and it held none before: then it stays ``None`` and the optimizer
skips it, as DDP leaves a globally unused parameter's gradient untouched.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_zero.core.comm import Communicator, Work
from lightning_zero.core.flat_buffer import FlatParamBuffer, ShardPiece
from lightning_zero.core.layout import Piece


class GradBucket(ABC):
    """The gradients of one :class:`FlatParamBuffer` and their reduction to this rank's shard."""

    buffer: FlatParamBuffer
    shard_grad: Tensor  # 1D, layout.shard_numel: the averaged gradient of this rank's shard

    def __init__(self, buffer: FlatParamBuffer, comm: Communicator, reduce_dtype: torch.dtype | None = None) -> None:
        self.buffer = buffer
        self.comm = comm
        # The dtype of the sum across ranks; the held gradient keeps the parameters' (see [Note: mixed-precision
        # model states]).
        self.reduce_dtype = reduce_dtype or buffer.data.dtype
        self.locally_used = [False] * len(buffer.params)  # got a gradient here since the last reduction
        self._arrived = [False] * len(buffer.params)  # got a gradient in the current backward pass
        self._missing = len(buffer.params)
        self._launched = False
        self._work: Work | None = None

    @property
    def ready(self) -> bool:
        return self._missing == 0

    def add_grad(self, slot: int, grad: Tensor) -> None:
        if self._launched:
            raise RuntimeError(
                f"a parameter of shape {self.buffer.layout.slots[slot].shape} received a second gradient after "
                "its bucket was reduced in this backward pass. Reentrant backward calls inside one pass (e.g. "
                "reentrant activation checkpointing) are not supported; use torch.utils.checkpoint with "
                "use_reentrant=False."
            )
        self._accumulate(slot, grad)
        self.locally_used[slot] = True
        if not self._arrived[slot]:
            self._arrived[slot] = True
            self._missing -= 1

    def launch(self) -> None:
        """Start the asynchronous reduce-scatter of this bucket."""
        self._launched = True
        self._start_reduce()

    def wait(self) -> None:
        """Wait for the reduction in flight, if any; the full-size staging memory can go right away."""
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._release_staging()

    def finish(self, globally_used: Sequence[bool]) -> None:
        """Fold the reduction in and hand it to the pieces. See [Note: gradient liveness]."""
        self.wait()
        self._fold_reduction(globally_used)
        self.locally_used = [False] * len(self.buffer.params)
        self._launched = False

    def end_pass(self) -> None:
        """Forget which gradients arrived in the backward pass that just ended."""
        self._arrived = [False] * len(self.buffer.params)
        self._missing = len(self.buffer.params)

    def _pieces(self) -> Iterator[tuple[Piece, ShardPiece, Tensor]]:
        """(piece, its optimizer tensor, its view of ``shard_grad``) for each parameter."""
        for piece, param in zip(self.buffer.pieces, self.buffer.piece_params, strict=True):
            yield piece, param, FlatParamBuffer.shard_view(self.shard_grad, piece)

    def _slot_view(self, flat: Tensor, slot: int) -> Tensor:
        entry = self.buffer.layout.slots[slot]
        return flat[entry.offset : entry.offset + entry.numel].view(entry.shape)

    @abstractmethod
    def _accumulate(self, slot: int, grad: Tensor) -> None:
        """Add a local gradient for the parameter in ``slot``."""

    @abstractmethod
    def _start_reduce(self) -> None: ...

    @abstractmethod
    def _release_staging(self) -> None:
        """Free what only the reduction in flight needed (stage 2's staging buffer)."""

    @abstractmethod
    def _fold_reduction(self, globally_used: Sequence[bool]) -> None: ...

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of gradient storage this bucket holds now."""


_IN_FLIGHT = 2  # bucket reductions allowed in flight while backward runs


class GradReducer:
    """Drives buckets through backward: gradient hooks, launch order and the end-of-backward flush.

    Args:
        buckets: in launch order (see [Note: bucket order]).
        comm: the shard group.
        overlap_comm: launch a bucket's reduction as soon as it is complete instead of after backward.
        reduce_every_backward: stage 2 reduces in every backward; stage 1 only in backward passes that are
            not inside :meth:`no_sync` (gradient accumulation keeps full local gradients instead).
    """

    def __init__(
        self,
        buckets: Sequence[GradBucket],
        comm: Communicator,
        overlap_comm: bool,
        reduce_every_backward: bool,
        on_bucket_ready: Callable[[int], None] | None = None,
        on_backward_end: Callable[[], None] | None = None,
    ) -> None:
        self.buckets = list(buckets)
        self.comm = comm
        self.overlap_comm = overlap_comm
        self.reduce_every_backward = reduce_every_backward
        self.on_bucket_ready = on_bucket_ready  # a bucket got all its gradients in this pass (stage 3 frees)
        self.on_backward_end = on_backward_end  # after the reductions of a pass finished
        self._sync = True
        self._next_launch = 0
        self._callback_queued = False
        self._handles: list[RemovableHandle] = []
        self.register_hooks()

    def register_hooks(self) -> None:
        """Hook every parameter's gradient (again, after :meth:`remove_hooks`)."""
        if self._handles:
            return
        for bucket_index, bucket in enumerate(self.buckets):
            for slot, param in enumerate(bucket.buffer.params):
                hook = partial(self._on_grad, bucket_index, slot)
                self._handles.append(param.register_post_accumulate_grad_hook(hook))

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally (stage 1) instead of reducing."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def _reducing(self) -> bool:
        return self._sync or self.reduce_every_backward

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def ensure_end_callback(self) -> None:
        """Make sure the end-of-backward flush runs after the backward pass in progress."""
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._callback_queued = True

    def _on_grad(self, bucket_index: int, slot: int, param: nn.Parameter) -> None:
        self.ensure_end_callback()
        assert param.grad is not None
        bucket = self.buckets[bucket_index]
        bucket.add_grad(slot, param.grad)
        param.grad = None
        if bucket.ready and self.on_bucket_ready is not None:
            self.on_bucket_ready(bucket_index)
        if self._reducing and self.overlap_comm:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].ready:
            self.buckets[self._next_launch].launch()
            self._next_launch += 1
            # Keep at most _IN_FLIGHT reductions (and their staging buffers) alive during backward.
            if self._next_launch > _IN_FLIGHT:
                self.buckets[self._next_launch - 1 - _IN_FLIGHT].wait()

    def _on_backward_end(self) -> None:
        self._callback_queued = False
        # A backward through frozen stage-3 units only (no trainable bucket) has nothing to reduce.
        if self._reducing and self.buckets:
            for bucket in self.buckets[self._next_launch :]:
                bucket.launch()
            globally_used = self._agree_on_used()
            for bucket, used in zip(self.buckets, globally_used, strict=True):
                bucket.finish(used)
        for bucket in self.buckets:
            bucket.end_pass()
        self._next_launch = 0
        if self.on_backward_end is not None:
            self.on_backward_end()

    def _agree_on_used(self) -> list[list[bool]]:
        """Which parameters got a gradient on any rank since the last reduction, per bucket."""
        flags = [used for bucket in self.buckets for used in bucket.locally_used]
        device = self.buckets[0].buffer.shard.device
        merged = torch.tensor(flags, dtype=torch.uint8, device=device)
        self.comm.all_reduce(merged, op="max")
        merged_flags = merged.bool().tolist()
        per_bucket, start = [], 0
        for bucket in self.buckets:
            per_bucket.append(merged_flags[start : start + len(bucket.locally_used)])
            start += len(bucket.locally_used)
        return per_bucket
