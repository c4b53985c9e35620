"""Stage 3: ranks that take different paths through the model are told so, instead of deadlocking.

[Note: divergent control flow at stage 3]
Every rank must gather the same units in the same order (see [Note: stage-3 backward plan]). A forward that
exits early on one rank, runs a unit a different number of times (generation), or routes through other units
breaks that: the gathers of different units are matched with each other, which deadlocks (different sizes) or,
worse, silently mixes two units' shards (equal sizes, as repeated blocks have). So before each unit's gather the
ranks exchange a tag of three integers (iteration, gather number in it, unit), in one small all-gather on the
gather group, and compare: where they differ, every rank raises the same :class:`DivergentControlFlowError`
naming the iteration, the gather and each rank's unit, before any shard moves. It costs one all-gather of
``24 x world_size`` bytes per unit gather.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_zero.core.comm import Communicator

_FIX = (
    "At stage 3 every rank must run the same modules in the same order in forward: no data-dependent early exit, "
    "routing or loop count that differs between ranks. For generation, keep every rank stepping the model until "
    "every rank is done (all-reduce a 'finished' flag each step), or gather the model with "
    "strategy.gathered_params() (or use stage 2) for it."
)


class DivergentControlFlowError(RuntimeError):
    """Ranks gathered different stage-3 units at the same point: their forwards took different paths."""


class GatherSequence:
    """Numbers every stage-3 gather and checks that all ranks gather the same unit at each. See the note above.

    Args:
        comm: the gather group.
        names: every unit's name, by index.
        device: where the tags live (the GPU with NCCL).
    """

    def __init__(self, comm: Communicator, names: Sequence[str], device: torch.device) -> None:
        self.comm = comm
        self.names = list(names)
        self.device = device
        self.iteration = 0
        self.count = 0

    def begin_iteration(self) -> None:
        self.iteration += 1
        self.count = 0

    def check(self, unit: int) -> None:
        """Before gathering unit ``unit``: raise on every rank unless every rank gathers it now (collective)."""
        self.count += 1
        tags = self.comm.exchange_tags([self.iteration, self.count, unit], self.device)
        if any(tag != tags[0] for tag in tags):
            raise DivergentControlFlowError(self._message(tags))

    def _message(self, tags: list[list[int]]) -> str:
        def where(rank: int, tag: list[int]) -> str:
            iteration, count, unit = tag
            name = self.names[unit] if 0 <= unit < len(self.names) else f"#{unit}"
            return f"rank {rank} gathers unit {name!r} (gather {count} of iteration {iteration})"

        ranks = "; ".join(where(rank, tag) for rank, tag in enumerate(tags))
        return f"ZeroStrategy(stage=3): the ranks took different paths through the model: {ranks}. {_FIX}"
