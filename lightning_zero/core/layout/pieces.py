"""Pure shard arithmetic: where each tensor sits in a flat buffer and which rank owns which elements.

[Note: flat layout]
A group of tensors of one dtype is laid end to end in a 1D buffer, padded at the end to a multiple
of ``world_size`` so that the buffer splits into ``world_size`` equal shards. Rank ``r`` owns the
elements ``[r * shard_numel, (r + 1) * shard_numel)``. A tensor may straddle shards; the part of a
tensor inside one rank's shard is a :class:`Piece`. Padding is below ``world_size`` elements per
buffer, so it is also below ``world_size`` elements per tensor.

[Note: owner layout]
``partition="parameter"`` gives every trainable tensor one owner (:func:`assign_owners`: largest first, each to
the least loaded rank, the same on every rank). A buffer then lays its tensors out owner by owner: rank 0's
first, then rank 1's, without padding, so rank ``r``'s shard is exactly the whole tensors it owns, and shards
differ in size (some are empty). The pieces are whole tensors, which the optimizer sees in their own shapes.
Gathers and reductions of such a buffer are uneven (``Communicator.all_gather(..., sizes=...)``).
"""

from __future__ import annotations

import itertools
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

    def shard_size(self, rank: int) -> int:
        return self.shard_numel

    @property
    def uneven_sizes(self) -> None:
        """Every shard has ``shard_numel`` elements: the even collectives apply."""
        return None

    whole_tensors = False  # pieces are 1-D ranges of flattened tensors


@dataclass(frozen=True, slots=True)
class OwnerLayout:
    """Whole tensors laid out owner by owner, without padding. See [Note: owner layout]."""

    slots: tuple[Slot, ...]
    owners: tuple[int, ...]  # per slot, the rank that owns the tensor
    world_size: int
    numel: int
    starts: tuple[int, ...]  # world_size + 1 boundaries: rank r's shard is [starts[r], starts[r + 1])
    uneven_sizes: tuple[int, ...] | None  # every rank's shard size; None where equal (the even collectives apply)

    whole_tensors = True

    @classmethod
    def build(cls, shapes: Sequence[Sequence[int]], owners: Sequence[int], world_size: int) -> OwnerLayout:
        if len(owners) != len(shapes):
            raise ValueError(f"{len(shapes)} tensors but {len(owners)} owners")
        if any(not 0 <= owner < world_size for owner in owners):
            raise ValueError(f"owners {list(owners)} are not all ranks of world_size {world_size}")
        offsets = [0] * len(shapes)
        starts, offset = [0], 0
        for rank in range(world_size):
            for index, shape in enumerate(shapes):
                if owners[index] == rank:
                    offsets[index] = offset
                    offset += math.prod(shape)
            starts.append(offset)
        slots = tuple(Slot(o, math.prod(shape), tuple(shape)) for o, shape in zip(offsets, shapes, strict=True))
        sizes = tuple(hi - lo for lo, hi in itertools.pairwise(starts))  # made once: every gather asks for it
        return cls(slots, tuple(owners), world_size, offset, tuple(starts), None if len(set(sizes)) == 1 else sizes)

    @property
    def padded_numel(self) -> int:
        return self.numel

    @property
    def padding(self) -> int:
        return 0

    def shard_size(self, rank: int) -> int:
        lo, hi = self.shard_bounds(rank)
        return hi - lo

    def shard_bounds(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size}")
        return self.starts[rank], self.starts[rank + 1]

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """The whole tensors ``rank`` owns (non-empty ones), in buffer order."""
        lo, _ = self.shard_bounds(rank)
        owned = [i for i, slot in enumerate(self.slots) if self.owners[i] == rank and slot.numel]
        owned.sort(key=lambda i: self.slots[i].offset)
        return tuple(Piece(i, 0, self.slots[i].numel, self.slots[i].offset - lo) for i in owned)

    def owner_rank(self, flat_index: int) -> int:
        if not 0 <= flat_index < self.numel:
            raise ValueError(f"flat index {flat_index} is outside the buffer of {self.numel} elements")
        return next(rank for rank in range(self.world_size) if flat_index < self.starts[rank + 1])


Layout = FlatLayout | OwnerLayout


def assign_owners(
    nbytes: Sequence[int], world_size: int, loads: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """One owner per tensor of ``nbytes`` bytes: largest first (ties: the earlier tensor), each to the least loaded
    rank (ties: the lower rank), starting from ``loads``. Deterministic, so every rank computes the same owners.
    Returns the owners and the loads after. See [Note: owner layout]."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = list(loads) if loads is not None else [0] * world_size
    owners = [0] * len(nbytes)
    for index in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += nbytes[index]
    return owners, load


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
