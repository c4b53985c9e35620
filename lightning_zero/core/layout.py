"""Pure shard arithmetic: where each tensor sits in a flat buffer and which rank owns which elements.

[Note: flat layout]
A group of tensors of one dtype is laid end to end in a 1D buffer, padded at the end to a multiple
of ``world_size`` so that the buffer splits into ``world_size`` equal shards. Rank ``r`` owns the
elements ``[r * shard_numel, (r + 1) * shard_numel)``. A tensor may straddle shards; the part of a
tensor inside one rank's shard is a :class:`Piece`. Padding is below ``world_size`` elements per
buffer, so it is also below ``world_size`` elements per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Slot:
    """One tensor's place in the flat buffer."""

    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Piece:
    """The elements ``[start, end)`` of tensor ``slot`` (flattened) that lie in one rank's shard."""

    slot: int
    start: int
    end: int
    shard_offset: int  # where the piece begins inside the shard

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Offsets of tensors in a flat buffer padded to a multiple of ``world_size``. See [Note: flat layout]."""

    slots: tuple[Slot, ...]
    world_size: int
    numel: int  # elements of all tensors, without padding
    padded_numel: int  # numel rounded up to a multiple of world_size

    @classmethod
    def build(cls, shapes: Sequence[Sequence[int]], world_size: int) -> FlatLayout:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        slots = []
        offset = 0
        for shape in shapes:
            numel = math.prod(shape)
            slots.append(Slot(offset, numel, tuple(shape)))
            offset += numel
        padded = -(-offset // world_size) * world_size
        return cls(tuple(slots), world_size, offset, padded)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_bounds(self, rank: int) -> tuple[int, int]:
        """The flat interval ``[lo, hi)`` owned by ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """The non-empty parts of tensors inside ``rank``'s shard, in buffer order."""
        lo, hi = self.shard_bounds(rank)
        found = []
        for index, slot in enumerate(self.slots):
            begin, end = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
            if begin < end:
                found.append(Piece(index, begin - slot.offset, end - slot.offset, begin - lo))
        return tuple(found)

    def owner_rank(self, flat_index: int) -> int:
        """The rank whose shard holds element ``flat_index`` of the buffer."""
        if not 0 <= flat_index < self.padded_numel:
            raise ValueError(f"flat index {flat_index} is outside the buffer of {self.padded_numel} elements")
        return flat_index // self.shard_numel


def plan_buckets(numels: Sequence[int], cap_numel: int) -> list[list[int]]:
    """Split tensor indices, in the given order, into consecutive buckets of at most ``cap_numel`` elements.

    A tensor larger than the cap gets a bucket of its own.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, numel in enumerate(numels):
        if current and filled + numel > cap_numel:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += numel
    if current:
        buckets.append(current)
    return buckets
