"""Secondary shards (ZeRO++ hpZ): what a unit keeps of its gathered parameters between forward and backward.

[Note: secondary shards]
With ``secondary_shard_size=s`` a unit's forward ends not by freeing its gathered full buffers entirely: each rank
first copies its part of them within its *secondary group* (s consecutive ranks inside one node, see
core/comm/topology.py) into a tensor of its own, 1/s of each full buffer: the elements ``[j P/s, (j + 1) P/s)`` of a
buffer of P elements for the group's rank j (P is divisible by the gather group's size, so by s; with
``partition="parameter"``, whose buffers are not padded, the first ``P mod s`` parts are one element longer). The
backward's gather of the unit is then an all-gather of those slices inside the secondary group, so it never leaves
the node, and moves the same values as the primary gather would: results are bit for bit those of plain stage 3.
The slices are freed once that gather completed, and in any case where the scheduler forgets a backward's plan
(its end, an exception, the next iteration, ``reshard_all``): nothing stale outlives a step.

Only a forward whose outputs need gradients (one that records a backward plan entry) keeps slices, and only the
backward's gathers read them: forward's gathers stay primary (over the whole gather group), so whether a gather is
secondary depends only on the plan every rank derives alike (see [Note: stage-3 backward plan]). The root unit is
never resharded between its forward and backward, so it keeps none. Activation checkpointing's recomputation
gathers the unit inside backward, from the slices, like its backward would.

Memory: the slices of every unit whose backward has not run yet are alive at once, at most ``P_units / s`` elements
per rank at the end of forward (``memory_report()`` counts them with the parameters, the step peak under
``"secondary"``, ``estimate_memory(secondary_shard_size=)`` as every parameter's 1/s).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from lightning_zero.core.comm import Communicator, Work
from lightning_zero.core.layout.flat_buffer import ShardedBuffer, ShardedState


def secondary_sizes(numel: int, group_size: int) -> tuple[int, ...]:
    """Elements of each secondary group rank's slice of a full buffer of ``numel`` elements (the first ``numel mod
    group_size`` one longer)."""
    base, longer = divmod(numel, group_size)
    return tuple(base + (rank < longer) for rank in range(group_size))


class SecondaryShards:
    """This rank's slices of one unit's full buffers, kept from its forward until its backward gathered them.

    Args:
        comm: the secondary group (see core/comm/topology.py).
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.slices: list[Tensor] = []  # per buffer of the unit, 1D; empty while none are kept
        self.quantized: list[bool] = []  # per buffer: the slices hold values of a quantized gather (quantize_weights)

    @property
    def held(self) -> bool:
        return bool(self.slices)

    @property
    def nbytes(self) -> int:
        return sum(part.numel() * part.element_size() for part in self.slices)

    def _sizes(self, buffer: ShardedBuffer) -> tuple[int, ...]:
        return secondary_sizes(buffer.layout.padded_numel, self.comm.world_size)

    def keep(self, buffers: Sequence[ShardedBuffer]) -> None:
        """Copy this rank's slices out of the gathered ``buffers`` (a no-op when kept already: the values are the
        same until the step)."""
        if self.held:
            return
        assert all(b.state is ShardedState.GATHERED for b in buffers), "secondary slices are cut from gathered buffers"
        for buffer in buffers:
            sizes = self._sizes(buffer)
            start = sum(sizes[: self.comm.rank])
            self.slices.append(buffer.data[start : start + sizes[self.comm.rank]].clone())
            self.quantized.append(buffer.quantized)

    def start_gather(self, buffers: Sequence[ShardedBuffer]) -> list[Work | None]:
        """Start gathering every buffer's full values from the group's slices (the slices stay until :meth:`drop`,
        after the gathers completed)."""
        works = []
        for buffer, part, quantized in zip(buffers, self.slices, self.quantized, strict=True):
            sizes = self._sizes(buffer)
            works.append(buffer.start_gather_from(part, self.comm, sizes if len(set(sizes)) > 1 else None))
            # Exact copies travel inside the node, of values that a quantized gather made: never written back.
            buffer.quantized = quantized
        return works

    def drop(self) -> None:
        self.slices, self.quantized = [], []
