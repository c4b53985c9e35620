"""Gradient buckets: one buffer group's gradients, collected in backward and reduce-scattered as one (the order and
timing of their reductions: ``core/step/reducer.py``).

[Note: gradient liveness]
torch's contract is that gradients accumulate until ``zero_grad``. A bucket holds, per parameter, the
reduced gradient of this rank's piece and whether it is live (what the optimizer would see as ``grad``).
``optimizer.zero_grad()`` empties (``set_to_none``) or zeroes the live gradients of its parameters, at
any time, e.g. between the backward passes of two optimizers. Each time a bucket folds a new reduction
in, a gradient that is not live is overwritten and a live one is added to. After each reducing pass a
parameter's gradient is live unless it got no gradient on any rank in the pass and held none before:
then it stays empty and the optimizer skips the parameter, as DDP leaves a globally unused parameter's
gradient untouched.

[Note: bucket state]
A bucket is ``IDLE`` between backward passes, ``FILLING`` once a gradient of the current pass arrived, and
``LAUNCHED`` while its reduction is in flight; the end of backward folds the result in and makes it
``IDLE`` again. A pass that raised leaves a bucket ``FILLING`` or ``LAUNCHED``: :meth:`GradBucket.reset`
(run by ``ZeroEngine.begin_iteration``) waits for its reduction and drops what the failed pass added, so the
next pass starts clean and the gradients held before it are kept.

[Note: the result in the staging buffer]
Where gradients are summed in a wider dtype than they are held in (bf16-mixed's fp32 sums), a bucket reduce-scatters
a wide staging copy and rounds the result into its held gradient as soon as the reduction completes. Where nothing
follows the reduce-scatter (no all-reduce across replicas, no quantized hop across nodes; at stages 2-3 also nothing
live to add to and nothing resting on disk) the reduce-scatter writes its result into this rank's own part of the
staging copy instead of a buffer of its own: the staging copy lives until the result is rounded in anyway, so a
bucket in flight holds it alone, not also a wide result of ``reduce_bytes * Ψ_bucket / N``. Gloo's reduce-scatter
reads its inputs into a buffer of its own before it writes the output, and NCCL reduces in place where the output is
the input's part at ``rank * count``; tests/distributed/test_step_peak.py sets the two ways against each other bit
for bit. Elsewhere the result needs a buffer of its own: an all-reduce across replicas runs on it until the end of
backward, and a view would keep the whole staging copy alive that long.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from enum import Enum, auto

import torch
from torch import Tensor

from lightning_zero.core.comm import Work
from lightning_zero.core.layout.flat_buffer import FlatParamBuffer
from lightning_zero.core.peak import DETACHED, PeakLedger, Tracked
from lightning_zero.core.step.quantized_reduction import GRADIENT_BLOCK, NodeReduced, QuantizedSlices
from lightning_zero.core.step.reduction import GradientReduction


class BucketState(Enum):
    """Where a bucket is in a backward pass. See [Note: bucket state]."""

    IDLE = auto()
    FILLING = auto()
    LAUNCHED = auto()


class GradBucket(ABC):
    """The gradients of one :class:`FlatParamBuffer` and their reduction to this rank's shard."""

    buffer: FlatParamBuffer
    shard_grad: Tensor  # 1D, layout.shard_numel: the averaged gradient of this rank's shard
    ledger: PeakLedger = DETACHED  # counts the transient buffers (see [Note: step peak ledger])
    # A quantized reduction in flight holds buffers of its own (its nbytes; see [Note: quantized gradient reduction]).
    _work: Tracked[Work | NodeReduced | None] = Tracked("buckets", lambda bucket, work: getattr(work, "nbytes", 0))
    _replica_work: Tracked[Work | None] = Tracked("buckets", lambda bucket, work: getattr(work, "nbytes", 0))

    def __init__(
        self, buffer: FlatParamBuffer, reduction: GradientReduction, reduce_dtype: torch.dtype | None = None
    ) -> None:
        self.buffer = buffer
        self.reduction = reduction
        self.comm = reduction.shard  # the reduce-scatter's group
        # The dtype of the sum across ranks; the held gradient keeps the parameters' (see [Note: mixed-precision
        # model states]).
        self.reduce_dtype = reduce_dtype or buffer.data.dtype
        self.state = BucketState.IDLE
        self.live = [False] * len(buffer.params)  # per parameter: holds a reduced gradient (see gradient liveness)
        self.locally_used = [False] * len(buffer.params)  # got a gradient here since the last reduction
        self._arrived = [False] * len(buffer.params)  # got a gradient in the current backward pass
        self._missing = len(buffer.params)
        self._work = None
        self._replica_work = None  # the all-reduce across replicas (see core/step/reduction.py)
        self._quantized: QuantizedSlices | None = None  # block plans and residuals, with quantize_gradients

    @property
    def ready(self) -> bool:
        return self._missing == 0

    @property
    def device(self) -> torch.device:
        """Where the gradients are reduced (the device collectives run on)."""
        return self.buffer.data.device

    def settle(self, write: bool = True) -> bool:
        """Let a gradient shard that rests on disk leave memory (see :class:`ShardGradBucket`); a no-op here.
        Returns whether the held values are what rests (here: they never leave memory)."""
        return True

    def read_ahead(self) -> None:
        """Start reading a gradient shard that rests on disk (see :class:`ShardGradBucket`); a no-op here."""
        return

    @property
    def offloaded_nbytes(self) -> int:
        """Bytes of gradient storage on disk."""
        return 0

    def held(self, slot: int) -> Tensor | None:
        """The live reduced gradient of parameter ``slot``'s piece, or ``None``."""
        return self.buffer.owned(self.shard_grad, slot) if self.live[slot] else None

    def clear(self, slots: Sequence[int], set_to_none: bool) -> None:
        """``zero_grad`` for parameters ``slots``: empty their gradients, or zero them and keep them live."""
        for slot in slots:
            if not self.live[slot]:
                continue
            if set_to_none:
                self.live[slot] = False
            else:
                self.buffer.owned(self.shard_grad, slot).zero_()

    def add_grad(self, slot: int, grad: Tensor) -> None:
        if self.state is BucketState.LAUNCHED:
            raise RuntimeError(
                f"a parameter of shape {self.buffer.layout.slots[slot].shape} received a second gradient after "
                "its bucket was reduced in this backward pass: it is used in two places, one of them inside a "
                "reentrant activation checkpoint, whose backward is a pass of its own that gives it a gradient "
                "again. Use torch.utils.checkpoint(..., use_reentrant=False), or ZeroStrategy(overlap_comm=False), "
                "which reduces at the end of backward."
            )
        if self.state is BucketState.IDLE:
            self._begin_filling()
            self.state = BucketState.FILLING
        self._accumulate(slot, grad)
        self.locally_used[slot] = True
        if not self._arrived[slot]:
            self._arrived[slot] = True
            self._missing -= 1

    def skip(self, slot: int) -> None:
        """Parameter ``slot`` gets no gradient in this pass (the graph does not reach it): the bucket no longer
        waits for it. See [Note: units a backward passes over]."""
        if self.state is not BucketState.LAUNCHED and not self._arrived[slot]:
            self._arrived[slot] = True
            self._missing -= 1

    def launch(self) -> None:
        """Start the asynchronous reduce-scatter of this bucket."""
        if self.state is BucketState.IDLE:
            self._begin_filling()
        self.state = BucketState.LAUNCHED
        self._start_reduce()

    def wait(self) -> None:
        """Wait for the reduce-scatter in flight, if any; the full-size staging memory can go right away, and the
        all-reduce across replicas starts (waited for by :meth:`finish`)."""
        if self._work is not None:
            work = self._work
            work.wait()
            self._work = None
            self._release_staging()
            self._replica_work = self.reduction.start_across_replicas(self._reduction_result(), work, self._slices)
            if self._replica_work is None:
                self._settle_reduced()

    def _slices(self) -> QuantizedSlices:
        """The bucket's state for quantized reductions (see [Note: quantized gradient reduction]), made once: every
        slice's block plan, and the residuals of error feedback."""
        if self._quantized is None:
            self._quantized = QuantizedSlices(self.buffer.block_plans(GRADIENT_BLOCK, exact_vectors=False))
        return self._quantized

    def drop_feedback(self) -> None:
        """Forget error feedback's residuals (the engine is released)."""
        if self._quantized is not None:
            self._quantized.residual = None

    @property
    def feedback_nbytes(self) -> int:
        """Bytes of error feedback's residuals (``quantize_gradients`` across nodes; see [Note: error feedback])."""
        return 0 if self._quantized is None else self._quantized.nbytes

    def _wait_replicas(self) -> None:
        if self._replica_work is not None:
            self._replica_work.wait()
            self._replica_work = None
            self._settle_reduced()

    def finish(self, globally_used: Sequence[bool]) -> None:
        """Fold the reduction in and mark what is live. See [Note: gradient liveness]."""
        self.wait()
        self._wait_replicas()
        self._fold_reduction(globally_used)
        self.locally_used = [False] * len(self.buffer.params)
        self.end_pass()

    def end_pass(self) -> None:
        """Forget which gradients arrived in the backward pass that just ended."""
        self._arrived = [False] * len(self.buffer.params)
        self._missing = len(self.buffer.params)
        self.state = BucketState.IDLE

    def reset(self) -> None:
        """After a pass that raised: wait for its reduction and drop what it added. See [Note: bucket state]."""
        if self.state is BucketState.IDLE:
            return
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._replica_work is not None:
            self._replica_work.wait()
            self._replica_work = None
        self._discard_pass()
        self.end_pass()

    def _wide_result(self, staging: Tensor) -> Tensor:
        """Where the reduce-scatter of the wide ``staging`` writes: this rank's part of ``staging`` itself where the
        result is rounded in as soon as it completes, a buffer of its own otherwise (see [Note: the result in the
        staging buffer])."""
        if self._rounded_in_at_wait():
            low, high = self.buffer.bounds
            return staging[low:high]
        return torch.empty(self.buffer.shard_numel, dtype=self.reduce_dtype, device=staging.device)

    def _rounded_in_at_wait(self) -> bool:
        """Nothing follows the reduce-scatter: no all-reduce across replicas, no quantized hop across nodes."""
        return self.reduction.replicate is None and self.reduction.quantized is None

    def _slot_view(self, flat: Tensor, slot: int) -> Tensor:
        entry = self.buffer.layout.slots[slot]
        return flat[entry.offset : entry.offset + entry.numel].view(entry.shape)

    @abstractmethod
    def _begin_filling(self) -> None:
        """The first gradient of a pass (or a launch without any) is about to arrive."""

    @abstractmethod
    def _accumulate(self, slot: int, grad: Tensor) -> None:
        """Add a local gradient for the parameter in ``slot``."""

    @abstractmethod
    def _start_reduce(self) -> None: ...

    @abstractmethod
    def _release_staging(self) -> None:
        """Free what only the reduce-scatter needed (stage 2's staging buffer)."""

    @abstractmethod
    def _reduction_result(self) -> Tensor:
        """The reduce-scatter's result: this rank's shard of the bucket's gradient sum."""

    def _settle_reduced(self) -> None:  # noqa: B027 (a hook: most buckets keep the result in memory)
        """The reduction is complete (across replicas too): where it rests on disk, write it there."""

    @abstractmethod
    def _fold_reduction(self, globally_used: Sequence[bool]) -> None: ...

    @abstractmethod
    def _discard_pass(self) -> None:
        """Drop the local gradients and reduction of a pass that did not finish."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of gradient storage this bucket holds now."""


def part_of(part: Tensor | None, whole: Tensor | None) -> bool:
    """``part`` is a view into ``whole``: its bytes are ``whole``'s."""
    return part is not None and whole is not None and part._base is whole
