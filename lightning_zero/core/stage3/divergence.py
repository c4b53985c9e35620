"""Stage 3: ranks that take different paths through the model are told so, instead of deadlocking.

[Note: divergent control flow at stage 3]
Every rank must gather the same units in the same order (see [Note: stage-3 backward plan]). A forward that
exits early on one rank, runs a unit a different number of times (generation), or routes through other units
breaks that: the gathers of different units are matched with each other, which aborts the process (gloo, different
sizes: "Received data size doesn't match expected size", measured), hangs, or, worse, silently mixes two units'
shards (equal sizes, as repeated blocks have). So before each unit's gather in forward (and any gather outside a
backward plan) the ranks exchange a tag of three integers (iteration, gather number in it, unit), in one small
all-gather on the gather group, and compare: where they differ, every rank raises the same
:class:`DivergentControlFlowError` naming the iteration, the gather and each rank's unit, before any shard moves.
It costs one all-gather of ``24 x world_size`` bytes per forward unit gather, into tensors made once.

The tag cannot travel inside the unit's own all-gather: a unit's gather writes straight into its flat buffer (no
copy in or out), and a mismatched gather of another size aborts the process before any tag could be read, so the
check must complete before the gather is issued. A backward's gathers need no tags: they follow the plan (see
[Note: stage-3 backward plan]), so a backward that differs between ranks (a loss reaching some units or none)
issues the same gathers in the same order, and is legal. What must agree is the plan itself, the units whose
forwards recorded an entry: forwards that used the same gathered units in another order (prefetch gathered them
in the agreed order) record different plans. So when a plan opens (every rank announces its backward) the ranks
exchange one more tag, (iteration, ``-1 - len(plan)``, CRC-32 of the plan's units): a rank still gathering in
forward, or one whose forward recorded other units, differs from it. Where tags differ, the ranks exchange a
description of what each was doing (an all-gather of Python objects, on the error path only) for the message.

[Note: evaluation loops of different lengths]
Lightning's prediction loop does not pad the last batches (its sampler never repeats a sample), and a user's own
sampler may give the ranks different numbers of evaluation batches: DDP evaluates without a collective, so that
works, but at stage 3 the rank that finished first left the others waiting in a gather forever. So a rank whose
evaluation loop ended *joins* (:meth:`GatherSequence.joined`): it sends the tag (iteration, 0, 0) instead of a
gather's, learns from the others' tags which unit they gather now, gathers it with them and frees it, until every
rank has joined, counting those gathers as its own. A gather's check accepts joined ranks' tags (the ranks still
evaluating must agree among themselves); a backward plan's check with a rank joined raises on every rank, as any
disagreement does. A joined rank gathers as a forward does (a backward gather from secondary slices, in a gradient
penalty of a longer validation loop, is not mirrored). A rank with no evaluation batch runs no step and cannot join.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from lightning_zero.core.comm import Communicator

_FIX = (
    "At stage 3 every rank must run the same modules in the same order in forward: no data-dependent early exit, "
    "routing or loop count that differs between ranks. For generation, keep every rank stepping the model until "
    "every rank is done (all-reduce a 'finished' flag each step), or gather the model with "
    "strategy.gathered_params() (or use stage 2) for it."
)


_JOINED = 0  # the gather number of a joined rank's tag: gathers count from 1, a backward plan's tag is negative


class DivergentControlFlowError(RuntimeError):
    """Ranks gathered different stage-3 units at the same point: their forwards took different paths."""


class GatherSequence:
    """Numbers every checked stage-3 gather and checks that all ranks gather the same unit at each, and start each
    backward with the same plan. See the note above.

    Args:
        comm: the gather group.
        names: every unit's name, by index.
        device: where the tags live (the GPU with NCCL).
    """

    def __init__(self, comm: Communicator, names: Sequence[str], device: torch.device) -> None:
        self.comm = comm
        self.names = list(names)
        self.iteration = 0
        self.count = 0
        self._host = torch.zeros(3, dtype=torch.int64)  # made once: see the note
        self._mine = self._host if device.type == "cpu" else torch.zeros(3, dtype=torch.int64, device=device)
        self._everyone = torch.zeros(comm.world_size * 3, dtype=torch.int64, device=device)

    def begin_iteration(self) -> None:
        self.iteration += 1
        self.count = 0

    def check(self, unit: int) -> None:
        """Before gathering unit ``unit``: raise on every rank unless every rank gathers it now (collective)."""
        self.count += 1
        where = f"gathers unit {self._name(unit)!r} (gather {self.count} of iteration {self.iteration})"
        self._agree((self.iteration, self.count, unit), where)

    def check_plan(self, plan: Sequence[int]) -> None:
        """When a backward plan opens: raise on every rank unless every rank's plan has these units (collective)."""
        crc = zlib.crc32(b",".join(str(unit).encode() for unit in plan))
        units = ", ".join(repr(self._name(unit)) for unit in plan)
        where = f"starts a backward whose forward recorded units [{units}] (iteration {self.iteration})"
        self._agree((self.iteration, -1 - len(plan), crc), where)

    def joined(self) -> int | None:
        """This rank's evaluation loop ended (collective): the unit the ranks still evaluating gather now, or ``None``
        once every rank's has ended. See [Note: evaluation loops of different lengths]."""
        tags = self._agree((self.iteration, _JOINED, 0), "ended its evaluation loop")
        running = [tag for tag in tags if tag[1] != _JOINED]
        if not running:
            return None
        self.iteration, self.count = running[0][0], running[0][1]  # the gathers joined count as this rank's
        return running[0][2]

    def _agree(self, tag: tuple[int, int, int], where: str) -> list[list[int]]:
        """Exchange ``tag`` (collective) and raise on every rank unless the ranks that have not joined sent the same
        one, a gather's where any has joined; every rank's tag."""
        self._host[0], self._host[1], self._host[2] = tag
        if self._mine is not self._host:
            self._mine.copy_(self._host)
        self.comm.exchange_tags(self._mine, self._everyone)
        tags = self._everyone.view(self.comm.world_size, 3).tolist()
        running = [other for other in tags if other[1] != _JOINED]
        differ = any(other != running[0] for other in running)
        if running and (differ or (len(running) < len(tags) and running[0][1] < 0)):
            everyone = self.comm.all_gather_object(where)  # every rank saw the difference: all take this path
            ranks = "; ".join(f"rank {rank} {what}" for rank, what in enumerate(everyone))
            raise DivergentControlFlowError(
                f"ZeroStrategy(stage=3): the ranks took different paths through the model: {ranks}. {_FIX}"
            )
        return tags

    def _name(self, unit: int) -> str:
        return self.names[unit] if 0 <= unit < len(self.names) else f"#{unit}"
