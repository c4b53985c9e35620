"""Shard arithmetic of FlatLayout and OwnerLayout, and the balance of whole-tensor owners, one process."""

from __future__ import annotations

import math
import random

import pytest
import torch

from lightning_zero.core.layout.pieces import FlatLayout, Piece, plan_buckets

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


# ----------------------------------------------------------------------------- whole-tensor owners


def gpt2_small_shapes(tied: bool = True) -> list[tuple[int, ...]]:
    """The trained tensors of GPT-2 small (124M with the head tied to the embedding)."""
    d, vocab, context = 768, 50257, 1024
    shapes: list[tuple[int, ...]] = [(vocab, d), (context, d)]
    for _ in range(12):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    shapes += [(d,), (d,)]
    return shapes if tied else [*shapes, (vocab, d)]


def test_owner_layout_gives_each_rank_its_whole_tensors_without_padding() -> None:
    from lightning_zero.core.layout.pieces import OwnerLayout

    layout = OwnerLayout.build([(3, 4), (5,), (2, 2), (0,)], owners=[1, 0, 1, 0], world_size=3)
    assert layout.padded_numel == layout.numel == 21
    assert [layout.shard_bounds(r) for r in range(3)] == [(0, 5), (5, 21), (21, 21)]
    assert layout.uneven_sizes == (5, 16, 0)
    assert layout.pieces(0) == (Piece(1, 0, 5, 0),)  # the empty tensor is no piece
    assert layout.pieces(1) == (Piece(0, 0, 12, 0), Piece(2, 0, 4, 12))
    assert layout.pieces(2) == ()
    assert [layout.owner_rank(i) for i in (0, 4, 5, 20)] == [0, 0, 1, 1]
    even = OwnerLayout.build([(2,), (2,)], owners=[0, 1], world_size=2)
    assert even.uneven_sizes is None  # equal parts take the even collectives


def test_owners_are_assigned_largest_first_to_the_least_loaded_rank() -> None:
    from lightning_zero.core.layout.pieces import assign_owners

    owners, loads = assign_owners([10, 40, 30, 20, 20], world_size=2)
    # 40 -> r0, 30 -> r1, 20 (index 3) -> r1, 20 (index 4) -> r0, 10 -> r0 (ties go to the lower rank)
    assert owners == [1, 0, 1, 1, 0]
    assert loads == [60, 60]
    more, loads = assign_owners([50], world_size=2, loads=loads)  # a tensor unfrozen later joins the same plan
    assert more == [0]
    assert loads == [110, 60]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_gpt2_small_balances_within_5_percent_of_the_best_possible(tied: bool, world_size: int) -> None:
    from lightning_zero.core.layout.pieces import assign_owners

    nbytes = [4 * math.prod(shape) for shape in gpt2_small_shapes(tied)]
    _, loads = assign_owners(nbytes, world_size)
    assert sum(loads) == sum(nbytes)
    # No rank can hold less than the largest tensor or the average: the most loaded is within 5% of that.
    assert max(loads) <= 1.05 * max(max(nbytes), sum(nbytes) / world_size)


def test_greedy_owners_never_exceed_the_average_plus_the_largest_tensor() -> None:
    from lightning_zero.core.layout.pieces import assign_owners

    generator = random.Random(0)
    for _ in range(200):
        nbytes = [generator.randint(1, 10_000) ** 2 for _ in range(generator.randint(1, 40))]
        world_size = generator.randint(1, 9)
        owners, loads = assign_owners(nbytes, world_size)
        assert owners == assign_owners(nbytes, world_size)[0]  # deterministic
        assert max(loads) <= sum(nbytes) / world_size + max(nbytes)
