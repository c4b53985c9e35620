"""Stage 2: only the rank's gradient shard persists; each bucket is reduce-scattered during backward.

A bucket's full gradient lives in a staging buffer from its first gradient until its reduce-scatter
completes; the averaged result is folded into the shard (4Ψ/N bytes in fp32), as soon as it completes where
nothing is live. Every backward pass reduces, micro-batches of gradient accumulation included, so per rank the
model states cost 4Ψ + 12Ψ/N bytes for fp32 Adam plus the staging buckets in flight. The shard lives from the
reduction that makes it until a ``zero_grad`` empties every piece of it (as FSDP2 frees its gradients), so the
forward that follows does not hold it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import torch
from torch import Tensor

from lightning_zero.core.layout.flat_buffer import FlatParamBuffer, ShardStorage
from lightning_zero.core.peak import Tracked
from lightning_zero.core.step.buckets import BucketState, GradBucket, part_of
from lightning_zero.core.step.reduction import GradientReduction


class ShardGradBucket(GradBucket):
    """A bucket that keeps only this rank's shard of the averaged gradient.

    With ``resting`` (stage 3 with ``offload_params`` and ``offload_optimizer`` both ``"nvme"``) the shard rests in
    the swap file between uses, as the parameters and the optimizer state do: it is written, in its own dtype, as
    soon as its reduction completes and read back when it is stepped on, so no gradient shard stays in memory after
    backward. Where live gradients are added to (gradient accumulation) the reduction's result rests in a second
    region until the end of backward folds it in (a pass that raises must leave the held gradients as they were).
    See [Note: paged step gradients].
    """

    # 1D, layout.padded_numel while the bucket is being filled or reduced
    staging: Tracked[Tensor | None] = Tracked("buckets")
    # 1D, shard_numel while the reduction is in flight; not counted where it is the held shard itself (a reduction
    # in place) or this rank's part of the staging buffer (see [Note: the result in the staging buffer])
    _output: Tracked[Tensor | None] = Tracked("buckets", lambda bucket, t: 0 if _within(t, bucket) else _nbytes(t))

    def __init__(
        self,
        buffer: FlatParamBuffer,
        reduction: GradientReduction,
        reduce_dtype: torch.dtype | None = None,
        resting: tuple[ShardStorage, ShardStorage] | None = None,
    ) -> None:
        super().__init__(buffer, reduction, reduce_dtype)
        # Made by a reduction, dropped by a zero_grad that empties every piece: forward and evaluation hold none.
        self._shard_grad: Tensor | None = None
        self.staging = None
        self._output = None
        self._in_place = False  # the reduction in flight writes the shard itself
        self.resting = resting  # where the shard and an accumulating reduction's result rest (None: in memory)
        self._on_disk = False  # the shard's values are in its region (and not in memory)
        self._output_on_disk = False
        self._reading: Future[Tensor] | None = None
        self._clean = False  # the shard in memory was just read from its region and not changed since

    @property
    def shard_grad(self) -> Tensor:  # type: ignore[override]
        if self._shard_grad is None:
            if self._on_disk:
                assert self.resting is not None
                reading, self._reading = self._reading, None
                self._shard_grad = reading.result() if reading else self.resting[0].get(*self._shape)
                self._on_disk, self._clean = False, True
            else:
                self._shard_grad = torch.zeros(self._shape[1], dtype=self._shape[0], device=self.device)
        return self._shard_grad

    @property
    def _shape(self) -> tuple[torch.dtype, int]:
        return self.buffer.data.dtype, self.buffer.shard_numel

    def settle(self, write: bool = True) -> bool:
        """``resting``: the shard goes to its region and leaves memory; a no-op otherwise. ``write=False``: the
        caller did not change it (or drops what it changed), so a shard read from its region and not changed by the
        bucket since is not written again. Returns whether what rests is the shard as it was in memory."""
        self._wait_reading()
        if self.resting is None or self._shard_grad is None:
            return True
        wrote = write or not self._clean
        if wrote:
            self.resting[0].put(self._shard_grad)
        self._shard_grad, self._on_disk, self._clean = None, True, False
        return wrote

    def _wait_reading(self) -> None:
        """Let a read-ahead finish (its buffer is dropped): never leave a read writing into freed memory."""
        if self._reading is not None:
            self._reading.result()
            self._reading = None

    def read_ahead(self) -> None:
        if self._on_disk and self._shard_grad is None and self._reading is None:
            assert self.resting is not None
            self._reading = self.resting[0].get_async(*self._shape)

    def clear(self, slots: Sequence[int], set_to_none: bool) -> None:
        super().clear(slots, set_to_none)
        self._clean = self._clean and set_to_none
        if set_to_none and self.resting is None and self.state is BucketState.IDLE and not any(self.live):
            self._shard_grad = None  # holds nothing live: the next reduction makes it (see [Note: gradient liveness])

    def _begin_filling(self) -> None:
        """Nothing to prepare: the staging buffer is created with the first gradient."""

    def _accumulate(self, slot: int, grad: Tensor) -> None:
        self._slot_view(self._staging(), slot).add_(grad)

    def _staging(self) -> Tensor:
        if self.staging is None:
            padded = self.buffer.layout.padded_numel
            self.staging = torch.zeros(padded, dtype=self.reduce_dtype, device=self.device)
        return self.staging

    def _start_reduce(self) -> None:
        staging = self._staging()
        # Divide before summing, as DDP does, so the result matches it and fp16 sums stay in range.
        staging.div_(self.reduction.world_size)
        # When zero_grad emptied every piece (the usual case) the result may land in the shard directly.
        self._in_place = self.reduce_dtype == self.buffer.data.dtype and not any(self.live)
        if self._in_place:
            if self._shard_grad is None:  # every value is replaced: nothing to read from disk, nothing to zero
                self._wait_reading()
                self._shard_grad = torch.empty(self._shape[1], dtype=self._shape[0], device=self.device)
                self._on_disk = False
            self._output = self.shard_grad
            self._clean = False
        else:
            self._output = self._wide_result(staging)
        self._work = self.reduction.reduce_scatter(self._output, staging, self.buffer.layout.uneven_sizes)

    def _rounded_in_at_wait(self) -> bool:
        """:meth:`_fold_now` rounds the result in: also nothing is live and nothing rests on disk."""
        return super()._rounded_in_at_wait() and self.resting is None and not any(self.live)

    def _release_staging(self) -> None:
        if not part_of(self._output, self.staging):
            self.staging = None  # (holding the result: freed once it is rounded in, see _fold_now)

    def _reduction_result(self) -> Tensor:
        assert self._output is not None
        return self._output

    def _settle_reduced(self) -> None:
        if self.resting is None:
            if self._output is not None and not self._in_place and not any(self.live):
                self._fold_now()
            return
        if self._output is None:
            return
        if self._in_place:
            self.settle()
        elif not any(self.live):  # every held value is replaced (see _fold_reduction): the result is the shard
            self._replace_shard(self._output)
            self._in_place = True
        else:
            self.resting[1].put(self._output)
            self._output_on_disk = True
        self._output = None

    def _fold_now(self) -> None:
        """A reduction in a wider dtype replaces every held value (none is live): round it into the shard as soon as
        it completes, so the wide result does not wait for the end of backward (one per bucket would pile up to a
        wide copy of every gradient shard). Pieces the end of backward finds unused stay not live, so what lands in
        them is never read."""
        assert self._output is not None
        if self._shard_grad is None:
            self._shard_grad = self._output.to(self._shape[0])
        else:
            self._shard_grad.copy_(self._output)
        self._output, self._in_place, self._clean = None, True, False
        self.staging = None

    def _replace_shard(self, values: Tensor) -> None:
        """``resting``: the shard becomes ``values`` in its own dtype and goes to its region (nothing is read)."""
        self._wait_reading()
        self._shard_grad, self._on_disk, self._clean = values.to(self._shape[0]), False, False
        self.settle()

    def _fold_reduction(self, globally_used: Sequence[bool]) -> None:
        # See [Note: gradient liveness]: overwrite what zero_grad emptied, add to what is live.
        live = self.live
        if not self._in_place:  # (in place: nothing was live, so the reduction wrote the shard itself)
            output = self._take_output()
            if all(globally_used) and all(live):
                self.shard_grad.add_(output)
            elif all(globally_used) and not any(live):
                self.shard_grad.copy_(output)
            else:
                for slot, (used, was_live) in enumerate(zip(globally_used, live, strict=True)):
                    if used:
                        view, part = self.buffer.owned(self.shard_grad, slot), self.buffer.owned(output, slot)
                        view.add_(part) if was_live else view.copy_(part)
            self._clean = False
            self.settle()
        self.live = [used or was_live for used, was_live in zip(globally_used, live, strict=True)]
        self._discard_pass()

    def _take_output(self) -> Tensor:
        if self._output_on_disk:
            assert self.resting is not None
            self._output_on_disk = False
            return self.resting[1].get(self.reduce_dtype, self._shape[1])
        assert self._output is not None
        return self._output

    def _discard_pass(self) -> None:
        # A reduction written in place only replaced gradients that were not live; nothing else changed.
        self.staging, self._output, self._in_place, self._output_on_disk = None, None, False, False

    @property
    def nbytes(self) -> int:
        output = None if _within(self._output, self) else self._output  # (else counted with what it is part of)
        held = [t for t in (self._shard_grad, self.staging, output) if t is not None]
        return sum(t.numel() * t.element_size() for t in {id(t): t for t in held}.values())

    @property
    def offloaded_nbytes(self) -> int:
        """The shard's region, and the accumulation region once used (``resting``)."""
        if self.resting is None:
            return 0
        return sum(storage.nbytes for storage in self.resting)


def _nbytes(tensor: Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def _within(output: Tensor | None, bucket: ShardGradBucket) -> bool:
    """``output`` is memory the bucket counts otherwise: its held shard, or a part of its staging buffer."""
    return output is not None and (output is bucket._shard_grad or part_of(output, bucket.staging))
