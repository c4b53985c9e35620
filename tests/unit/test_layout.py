"""Shard arithmetic of FlatLayout, one process."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_zero.core.layout import FlatLayout, plan_buckets

SHAPES = [(1,), (7,), (17, 257), (3, 5, 2)]
WORLD_SIZES = [1, 2, 3, 4, 8]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("shapes", [SHAPES[:1], SHAPES[:2], SHAPES], ids=["1", "1+7", "mixed"])
def test_shards_cover_each_element_once(shapes: list[tuple[int, ...]], world_size: int) -> None:
    layout = FlatLayout.build(shapes, world_size)
    numel = sum(math.prod(shape) for shape in shapes)
    assert layout.numel == numel
    assert layout.padded_numel % world_size == 0
    assert 0 <= layout.padding < world_size
    owners = torch.full((layout.padded_numel,), -1)
    for rank in range(world_size):
        lo, hi = layout.shard_bounds(rank)
        assert hi - lo == layout.shard_numel
        assert (owners[lo:hi] == -1).all()
        owners[lo:hi] = rank
        assert all(layout.owner_rank(i) == rank for i in (lo, hi - 1))
    assert (owners >= 0).all()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_pieces_reassemble_every_tensor(world_size: int) -> None:
    layout = FlatLayout.build(SHAPES, world_size)
    tensors = [torch.randn(shape) for shape in SHAPES]
    flat = torch.cat([t.reshape(-1) for t in tensors] + [torch.zeros(layout.padding)])
    rebuilt = [torch.full((t.numel(),), float("nan")) for t in tensors]
    for rank in range(world_size):
        lo, hi = layout.shard_bounds(rank)
        shard = flat[lo:hi]
        for piece in layout.pieces(rank):
            assert piece.numel > 0
            rebuilt[piece.slot][piece.start : piece.end] = shard[piece.shard_offset : piece.shard_offset + piece.numel]
    for tensor, flat_tensor in zip(tensors, rebuilt, strict=True):
        assert torch.equal(tensor.reshape(-1), flat_tensor)


def test_a_rank_may_own_only_padding() -> None:
    # 4 elements on 3 ranks: padded to 6, shards of 2; rank 2 holds elements 4 and 5, both padding.
    layout = FlatLayout.build([(4,)], 3)
    assert layout.padded_numel == 6
    assert layout.pieces(2) == ()


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        FlatLayout.build([(3,)], 0)
    layout = FlatLayout.build([(3,)], 2)
    with pytest.raises(ValueError, match="rank 2 is outside world_size 2"):
        layout.shard_bounds(2)
    with pytest.raises(ValueError, match="outside the buffer"):
        layout.owner_rank(4)


@pytest.mark.parametrize(
    ("numels", "cap", "expected"),
    [
        ([3, 3, 3], 6, [[0, 1], [2]]),
        ([10, 1], 4, [[0], [1]]),  # a tensor over the cap gets its own bucket
        ([1, 1, 1, 1], 100, [[0, 1, 2, 3]]),
        ([], 5, []),
    ],
)
def test_plan_buckets(numels: list[int], cap: int, expected: list[list[int]]) -> None:
    assert plan_buckets(numels, cap) == expected
