"""How a bucket's gradients become this rank's averaged shard: the groups and the divisor of one reduction.

Without ``shard_size`` a reduction is one reduce-scatter over every rank. With it (see [Note: hybrid sharding]) the
reduce-scatter runs inside the shard group and the shard is then all-reduced across the replicate group; the
gradients are divided by the number of all ranks before either, as DDP divides, so the sum is the same average.
The replicate all-reduce starts once the reduce-scatter completed (a bucket waits for it while backward runs) and
is waited for only at the end of backward, after the ranks agreed on the used parameters in the world group: no
rank blocks on it while another still has to reach that agreement. ``quantize_gradients`` across nodes replaces both
hops (see [Note: quantized gradient reduction]) and keeps that timing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from lightning_zero.core.comm import Communicator, Work
from lightning_zero.core.step.quantized_reduction import NodeReduced, QuantizedReduction, QuantizedSlices


@dataclass(frozen=True)
class GradientReduction:
    """The groups of a gradient reduction.

    Attributes:
        shard: the reduce-scatter's group.
        replicate: the group the shard is all-reduced across afterwards (``None``: no replicas).
        world_size: what the gradients are divided by: every rank that contributes.
        quantized: with ``quantize_gradients`` across nodes, the two hops that replace both collectives (see [Note:
            quantized gradient reduction]); ``None``: the exact reduction above.
    """

    shard: Communicator
    replicate: Communicator | None = None
    quantized: QuantizedReduction | None = None

    @property
    def world_size(self) -> int:
        return self.shard.world_size * (self.replicate.world_size if self.replicate is not None else 1)

    def reduce_scatter(self, output: Tensor, input: Tensor, sizes: tuple[int, ...] | None) -> Work | NodeReduced:
        """Start the first hop: ``input`` (the whole bucket, divided; spent) reduce-scattered towards ``output``."""
        if self.quantized is not None:
            return self.quantized.start(output, input)
        return self.shard.reduce_scatter(output, input, async_op=True, sizes=sizes)  # type: ignore[return-value]

    def start_across_replicas(
        self, shard: Tensor, reduced: Work | NodeReduced, slices: Callable[[], QuantizedSlices]
    ) -> Work | None:
        """Once the first hop (``reduced``) completed: start summing the reduced ``shard`` (in place) across the
        replicas, or the quantized hop across nodes (``slices()``: the bucket's block plans and residuals, see
        [Note: error feedback]); ``None`` when there is nothing more to do."""
        if self.quantized is not None:
            return self.quantized.across(shard, reduced, slices())
        if self.replicate is None:
            return None
        return self.replicate.all_reduce(shard, async_op=True)
