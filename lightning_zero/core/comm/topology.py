"""Which ranks talk: the process groups an engine uses, created once and named by their job.

The shard group carries every reduction and agreement. Stage 3 gathers unit parameters over a second group of
the same ranks, so that the order of gathers (fixed by the order units run in) and the order of gradient
reductions (fixed by bucket index) never have to interleave identically on every rank: a rank whose backward
needs fewer units than another's still issues the same gathers and the same reductions, each in its own order
(see [Note: stage-3 backward plan]).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_zero.core.comm.communicator import CommStats, Communicator


@dataclass(frozen=True)
class Topology:
    """The communicators of one engine.

    Attributes:
        shard: the ranks that split the state; reductions, agreements and stage-1/2 parameter gathers.
        gather: the same ranks in a group of their own for stage-3 unit gathers (``shard`` below stage 3).
    """

    shard: Communicator
    gather: Communicator

    @classmethod
    def build(cls, shard: Communicator, stage: int) -> Topology:
        """A topology over ``shard``'s ranks (collective at stage 3 the first time: it creates a group)."""
        if stage < 3:
            return cls(shard, shard)
        return cls(shard, shard.companion())

    def take_stats(self) -> CommStats:
        """What every group of the topology sent since the last call (and start counting again)."""
        stats = self.shard.stats.reset()
        if self.gather is not self.shard:
            stats = stats.merged(self.gather.stats.reset())
        return stats
