"""GradReducer: drives the buckets through backward: gradient hooks, launch order, the end of backward.

[Note: bucket order]
Buckets are reduced in a fixed order (their index: at stages 1 and 2 by their earliest registered parameter,
whose gradient roughly comes last, as backward roughly runs in reverse registration order; at stage 3 by
unit), whatever order their gradients arrive in: bucket ``i`` is launched only
after buckets ``0..i-1``. Ranks whose graphs differ (a parameter unused on one rank) therefore still
issue the same collectives in the same order. At the end of every reducing backward every bucket is
launched, complete or not (missing gradients count as zero), as DDP does, followed by one small
all-reduce of which parameters got a gradient on any rank in this pass. A rank whose backward reached
no trainable parameter at all fires no hook; it still runs this end of backward when the caller says
the backward is over (``ZeroEngine.finish_backward``, which the Lightning glue calls after every backward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_zero.core.comm import Communicator
from lightning_zero.core.step.buckets import BucketState, GradBucket

# Bucket reductions allowed in flight while backward runs. A launched bucket keeps its full-size staging buffer
# until it is waited for, so each one allowed in flight costs a unit's gradient in the reduce dtype on top of
# backward's activations. One suffices to overlap: bucket i's reduction runs while backward computes towards the
# next bucket's first gradient, and is waited for then, before that bucket makes its staging buffer (at the
# latest when a later bucket launches). (torch's gloo reduce-scatter never reports is_completed(), so completed
# reductions cannot be reaped earlier by polling.)
_IN_FLIGHT = 1


class GradReducer:
    """Drives buckets through backward: gradient hooks, launch order and the end-of-backward reduction.

    Args:
        buckets: in launch order (see [Note: bucket order]).
        comm: every rank (the agreement on used parameters).
        overlap_comm: launch a bucket's reduction as soon as it is complete instead of after backward.
        reduce_every_backward: stages 2 and 3 reduce in every backward; stage 1 only in backward passes that are
            not inside :meth:`no_sync` (gradient accumulation keeps full local gradients instead).
        on_backward_event: called from every gradient hook (the engine queues its end-of-backward call).
        on_bucket_ready: called with a bucket's index once all its gradients of the pass arrived.
        rider: a further agreement that rides in the end-of-backward all-reduce (of byte maxima): its ``payload()``
            is sent along, its ``verify(merged)`` gets the result (see [Note: agreeing on hyper-parameters]).
    """

    def __init__(
        self,
        buckets: Sequence[GradBucket],
        comm: Communicator,
        overlap_comm: bool,
        reduce_every_backward: bool,
        on_backward_event: Callable[[], None],
        on_bucket_ready: Callable[[int], None] | None = None,
        rider: AgreementRider | None = None,
    ) -> None:
        self.buckets = list(buckets)
        self.rider = rider
        self.comm = comm
        self.overlap_comm = overlap_comm
        self.reduce_every_backward = reduce_every_backward
        self.on_backward_event = on_backward_event
        self.on_bucket_ready = on_bucket_ready
        self._sync = True
        self._next_launch = 0
        self._handles: list[RemovableHandle] = []
        self._hooked = False
        self.register_hooks()

    def register_hooks(self) -> None:
        """Hook every parameter's gradient (again, after :meth:`remove_hooks`)."""
        if not self._hooked:
            self._hooked = True
            self._hook(range(len(self.buckets)))

    def add_buckets(self, buckets: Sequence[GradBucket]) -> None:
        """Buckets of parameters that became trainable after setup join the launch order at its end (see [Note:
        changes after setup]); their gradients are hooked while the others are."""
        first = len(self.buckets)
        self.buckets.extend(buckets)
        if self._hooked:
            self._hook(range(first, len(self.buckets)))

    def _hook(self, bucket_indices: range) -> None:
        for bucket_index in bucket_indices:
            for slot, param in enumerate(self.buckets[bucket_index].buffer.params):
                hook = partial(self._on_grad, bucket_index, slot)
                self._handles.append(param.register_post_accumulate_grad_hook(hook))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked = False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally (stage 1) instead of reducing."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @property
    def in_no_sync(self) -> bool:
        return not self._sync

    @property
    def reducing(self) -> bool:
        """Whether the backward pass now running (or about to run) reduces."""
        return self._sync or self.reduce_every_backward

    def _on_grad(self, bucket_index: int, slot: int, param: nn.Parameter) -> None:
        self.on_backward_event()
        assert param.grad is not None
        bucket = self.buckets[bucket_index]
        if bucket.state is BucketState.IDLE and self.reducing and self.overlap_comm and self._next_launch:
            # Its staging buffer is about to be made: the reduction in flight gives its own back first, so one
            # staging buffer lives at a time, not two (see _IN_FLIGHT).
            self.buckets[self._next_launch - 1].wait()
        bucket.add_grad(slot, param.grad)
        param.grad = None
        if bucket.ready and self.on_bucket_ready is not None:
            self.on_bucket_ready(bucket_index)
        if self.reducing and self.overlap_comm:
            self._launch_ready()

    def skip(self, bucket: GradBucket, slots: Sequence[int]) -> None:
        """``bucket``'s parameters ``slots`` get no gradient in this pass: launch what that completes, in order."""
        was_ready = bucket.ready
        for slot in slots:
            bucket.skip(slot)
        if bucket.ready and not was_ready and self.on_bucket_ready is not None:
            self.on_bucket_ready(self.buckets.index(bucket))
        if self.reducing and self.overlap_comm:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].ready:
            self.buckets[self._next_launch].launch()
            self._next_launch += 1
            # Keep at most _IN_FLIGHT reductions (and their staging buffers) alive during backward.
            if self._next_launch > _IN_FLIGHT:
                self.buckets[self._next_launch - 1 - _IN_FLIGHT].wait()

    def launch_remaining(self) -> None:
        """End of a reducing backward: launch every bucket not launched yet, in order, without waiting."""
        if not self.reducing:
            return
        for bucket in self.buckets[self._next_launch :]:
            bucket.launch()
        self._next_launch = len(self.buckets)

    def finish(self) -> None:
        """End of backward: agree on which parameters got a gradient (and what rides along) and fold every reduction
        in."""
        ridden = None
        if self.reducing and self.buckets:
            used, ridden = self._agree_on_used()
            for bucket, bucket_used in zip(self.buckets, used, strict=True):
                bucket.finish(bucket_used)
        for bucket in self.buckets:
            bucket.end_pass()
        self._next_launch = 0
        if ridden is not None and self.rider is not None:
            self.rider.verify(ridden)  # after the buckets are clean: it may raise

    def reset(self) -> None:
        """After a pass that raised. See [Note: bucket state]."""
        for bucket in self.buckets:
            bucket.reset()
        self._next_launch = 0

    def _agree_on_used(self) -> tuple[list[list[bool]], list[int]]:
        """Which parameters got a gradient on any rank since the last reduction, per bucket; and the rider's merged
        payload."""
        flags = [int(used) for bucket in self.buckets for used in bucket.locally_used]
        payload = self.rider.payload() if self.rider is not None else []
        device = self.buckets[0].device
        merged = torch.tensor(flags + payload, dtype=torch.uint8, device=device)
        self.comm.all_reduce(merged, op="max", label="agree")
        values = merged.tolist()
        merged_flags = [bool(v) for v in values[: len(flags)]]
        per_bucket, start = [], 0
        for bucket in self.buckets:
            per_bucket.append(merged_flags[start : start + len(bucket.locally_used)])
            start += len(bucket.locally_used)
        return per_bucket, values[len(flags) :]


class AgreementRider(Protocol):
    """A check that rides in the end-of-backward agreement (an all-reduce of byte maxima)."""

    def payload(self) -> list[int]: ...

    def verify(self, merged: Sequence[int]) -> None: ...
