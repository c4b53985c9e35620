"""Whole-tensor owners (``partition="parameter"``): which rank owns, steps and keeps the state of each tensor.

The plan is made once for every trained tensor of the model (largest first, each to the least loaded rank: see
[Note: owner layout]), so that the ranks are balanced over the whole model, not per bucket; tensors that become
trainable later (unfreezing) join it in the same way. The buffers then lay their tensors out by these owners.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from torch import nn

from lightning_zero.core.comm import Communicator
from lightning_zero.core.layout.pieces import assign_owners


class OwnerPlan:
    """The owner of every trained tensor, the same on every rank."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._owner: dict[int, int] = {}  # id(param) -> rank
        self.loads = [0] * world_size  # bytes of parameters owned per rank

    def assign(self, params: Iterable[nn.Parameter]) -> bool:
        """Give the tensors without an owner one (in the given order for ties); returns whether any was new."""
        fresh = [p for p in dict.fromkeys(params) if id(p) not in self._owner]
        owners, self.loads = assign_owners([p.numel() * p.element_size() for p in fresh], self.world_size, self.loads)
        self._owner.update((id(p), owner) for p, owner in zip(fresh, owners, strict=True))
        return bool(fresh)

    def owners_of(self, params: Sequence[nn.Parameter]) -> list[int]:
        return [self._owner[id(p)] for p in params]

    def agree(self, comm: Communicator, names: Mapping[nn.Parameter, str]) -> None:
        """Raise on every rank unless every rank computed the same owners (collective)."""
        owners = sorted((name, self._owner[id(p)]) for p, name in names.items() if id(p) in self._owner)
        fix = "Build the same model, in the same order, on every rank."
        comm.agree("the owner of each parameter (partition='parameter')", owners, fix)
