"""Hybrid sharding (``shard_size``) on 4 gloo ranks numbered as 2 nodes x 2 processes: equal to DDP at stages 1-3,
bytes by node equal to the formulas, memory_report() equal to estimate_memory(shard_size=), checkpoints moving
between hybrid and flat layouts bit for bit, and clear errors for a bad or disagreeing shard_size or a launch whose
nodes do not fit the shard groups. One spawn measures every passing case; one more each for the errors.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from lightning_zero.core.options import EngineOptions
from tests.distributed.models import TinyLM, batch, loss_fn
from tests.distributed.parity import CASES, relative_difference, train_ddp, train_reordered, train_zero
from tests.distributed.test_estimate_vs_report import _expected, _measure
from tests.helpers import run_on_ranks

WORLD_SIZE, NODES, SHARD_SIZE = 4, 2, 2
TOLERANCE = 1e-5
# (case, stages): unused_on_one_rank skips a unit on one rank only, which stage 3 does not support (see parity.py).
PARITY = {
    "plain": (1, 2, 3),
    "accumulate": (1, 2, 3),
    "clip_norm": (1, 2, 3),
    "tied": (1, 2, 3),
    "frozen": (1, 2, 3),
    "unused_on_one_rank": (1, 2),
}
# (precision, stage, offload_optimizer, offload_params, partition, accumulate), as test_estimate_vs_report's cases.
MEMORY_CASES = [
    (precision, stage, offload, params, partition, 1)
    for precision in ("32-true", "bf16-mixed")
    for stage, offload, params in ((1, False, False), (2, "cpu", False), (3, False, False), (3, "cpu", "nvme"))
    for partition in ("flat", "parameter")
]


def _parity(rank: int, out: dict[str, Any]) -> None:
    comm = Communicator()
    for name, stages in PARITY.items():
        case = CASES[name]
        torch.manual_seed(0)
        initial = TinyLM(**case.model_kwargs)
        reference = train_ddp(copy.deepcopy(initial), case, rank)
        out[f"spread/{name}"] = relative_difference(reference, train_reordered(copy.deepcopy(initial), case, 4))
        for stage in stages:
            for shard_size in (SHARD_SIZE, 1):
                if shard_size == 1 and name not in ("plain", "accumulate"):
                    continue  # every rank its own shard group: DDP's layout, checked on two cases
                model = copy.deepcopy(initial)
                engine = train_zero(model, case, rank, stage, comm, shard_size=shard_size)
                with engine.gathered():
                    out[f"stage{stage}/{name}/k{shard_size}"] = relative_difference(reference, model)


def _one_step_bytes(rank: int, stage: int, shard_size: int | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options = EngineOptions(
        stage=stage, bucket_cap_mb=0.001, wrap_policy={nn.Linear} if stage == 3 else None, shard_size=shard_size
    )
    engine = ZeroEngine(model, [optimizer], options, Communicator())
    tokens, targets = batch(seed=rank)
    loss_fn(model, tokens, targets).backward()
    optimizer.step()
    stats = engine.last_step_comm
    return {
        "by_op": dict(stats.by_op),
        "by_group": dict(stats.by_group),
        "nbytes": stats.nbytes,
        "calls": stats.calls,
        "intra": stats.intra_node_bytes,
        "inter": stats.inter_node_bytes,
        "padded": sum(b.layout.padded_numel for b in engine.model.buffers),
        "shard_numel": sum(b.layout.shard_numel for b in engine.model.buffers),
        "world_agree": 2
        * (sum(len(b.params) for b in engine.model.buffers) + len(engine.backward.reducer.rider.payload())),
    }


def _checkpoints(rank: int, directory: Path, out: dict[str, Any]) -> None:
    from lightning_zero.checkpoint import ShardedCheckpoint, load_sharded_optimizers, load_sharded_params, save_sharded

    def engine(stage: int, shard_size: int | None) -> ZeroEngine:
        torch.manual_seed(1)
        model = TinyLM(tied=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        policy = {nn.Linear} if stage == 3 else None
        options = EngineOptions(stage=stage, bucket_cap_mb=0.001, wrap_policy=policy, shard_size=shard_size)
        return ZeroEngine(model, [optimizer], options, Communicator())

    def train(engine: ZeroEngine, steps: int) -> None:
        optimizer = engine.optimizers[0]
        for step in range(steps):
            tokens, targets = batch(seed=100 * step + rank)
            optimizer.zero_grad()
            loss_fn(engine.module, tokens, targets).backward()
            optimizer.step()

    def full_state(engine: ZeroEngine) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        with engine.gathered():
            params = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        return params, engine.full_optimizer_state_dict(engine.optimizers[0])

    for (stage, shard_size), (other_stage, other_shard_size) in (((3, SHARD_SIZE), (2, None)), ((1, None), (3, 2))):
        saved = engine(stage, shard_size)
        train(saved, 3)
        path = directory / f"stage{stage}-k{shard_size}"
        save_sharded(saved.named_state(), path, {}, "test")
        resumed = engine(other_stage, other_shard_size)
        checkpoint = ShardedCheckpoint(path, comm=Communicator())
        load_sharded_params(resumed.named_state(), checkpoint)
        load_sharded_optimizers(resumed.named_state(), checkpoint)
        key = f"{stage}/{shard_size}->{other_stage}/{other_shard_size}"
        out[f"ckpt/{key}"] = (full_state(saved), full_state(resumed), sorted(p.name for p in path.iterdir()))
        train(saved, 2)
        train(resumed, 2)
        out[f"ckpt-next/{key}"] = (full_state(saved)[0], full_state(resumed)[0])


def _everything(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    _parity(rank, out)
    for stage in (1, 2, 3):
        for shard_size in (None, SHARD_SIZE, 1):
            out[f"bytes/{stage}/{shard_size}"] = _one_step_bytes(rank, stage, shard_size)
    for case in MEMORY_CASES:
        precision, *rest = case
        out[("memory", *case)] = _measure(rank, precision, tuple(rest), shard_size=SHARD_SIZE)
    _checkpoints(rank, Path(directory), out)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("hybrid")
    return run_on_ranks(_everything, WORLD_SIZE, str(directory), nodes=NODES, timeout_s=600)


@pytest.mark.parametrize(
    ("stage", "case", "shard_size"),
    [
        (stage, case, k)
        for case, stages in PARITY.items()
        for stage in stages
        for k in (SHARD_SIZE, 1)
        if k == SHARD_SIZE or case in ("plain", "accumulate")
    ],
)
def test_parameters_equal_ddp(ranks: list[dict[str, Any]], stage: int, case: str, shard_size: int) -> None:
    for rank, out in enumerate(ranks):
        difference, spread = out[f"stage{stage}/{case}/k{shard_size}"], out[f"spread/{case}"]
        assert 0 < spread <= TOLERANCE, f"reordered DDP spread {spread:.2e}: the tolerance would see nothing"
        assert difference <= TOLERANCE, f"rank {rank}: differs from DDP by {difference:.2e} (spread {spread:.2e})"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_by_node_equal_the_formulas(ranks: list[dict[str, Any]], stage: int) -> None:
    """A collective counted as B bytes over p ranks sends B/p to each peer (see [Note: counting communication]).
    Flat over 2 nodes x 2 ranks: 1 peer inside the node, 2 outside. Hybrid with a shard group per node: only the
    all-reduce across replicas and the world's agreement on used parameters cross nodes, and across nodes the step
    sends at most half of what flat sharding sends (4 ranks; 1/k of it with k ranks per node)."""
    for out in ranks:
        flat, hybrid = out[f"bytes/{stage}/None"], out[f"bytes/{stage}/{SHARD_SIZE}"]
        calls = flat["calls"]
        assert flat["intra"] - flat["nbytes"] // 4 in range(-calls, 1)  # each call rounded down
        assert flat["inter"] - flat["nbytes"] // 2 in range(-calls, 1)
        assert "all_reduce" not in flat["by_op"]  # flat: no replicas
        replicate = hybrid["by_op"]["all_reduce"]
        assert replicate == 2 * 4 * hybrid["shard_numel"]  # one fp32 all-reduce of this rank's shard
        assert hybrid["shard_numel"] * SHARD_SIZE == hybrid["padded"]
        agree = hybrid["world_agree"]
        assert hybrid["inter"] == replicate // 2 + agree // 2  # this rank's shard once, and the agreement
        inside = hybrid["nbytes"] - replicate - agree  # the shard group's and the gather group's collectives
        assert hybrid["intra"] - (inside // 2 + agree // 4) in range(-hybrid["calls"], 1)
        assert hybrid["by_op"]["reduce_scatter"] == flat["by_op"]["reduce_scatter"] == 4 * hybrid["padded"]
        assert hybrid["inter"] <= flat["inter"] / 2 + agree


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_shard_group_of_one_rank_counts_no_bytes(ranks: list[dict[str, Any]], stage: int) -> None:
    """shard_size=1: each rank is its own shard group, whose collectives move nothing, so the step counts what DDP
    moves (one fp32 all-reduce of the parameters) and the world's agreement, nothing in the shard group."""
    for rank, out in enumerate(ranks):
        alone = out[f"bytes/{stage}/1"]
        assert alone["by_group"].get("shard", 0) == 0, f"rank {rank}: {alone['by_group']}"
        assert alone["by_op"]["all_reduce"] == 2 * 4 * alone["padded"]
        assert alone["nbytes"] == alone["by_op"]["all_reduce"] + alone["world_agree"], f"rank {rank}: {alone}"


@pytest.mark.parametrize("case", MEMORY_CASES, ids=["-".join(map(str, case)) for case in MEMORY_CASES])
def test_memory_report_equals_the_estimate_with_shard_size(ranks: list[dict[str, Any]], case: tuple) -> None:
    """The ZeRO formulas with N = shard_size, to the byte (estimate_memory(..., shard_size=2) on 4 ranks)."""
    for rank, out in enumerate(ranks):
        report = out[("memory", *case)]
        expected = _expected(case, report["step_bytes"], world_size=WORLD_SIZE, shard_size=SHARD_SIZE)
        partition = case[4]
        fields = [f for f in expected if f in report and not (partition == "parameter" and f != "owned_max")]
        if partition == "parameter":
            assert report["owned_max"] <= expected["owned_max"], rank
            continue
        assert {f: report[f] for f in fields} == {f: expected[f] for f in fields}, f"rank {rank}"


@pytest.mark.parametrize("direction", ["3/2->2/None", "1/None->3/2"])
def test_checkpoints_move_between_hybrid_and_flat_exactly(ranks: list[dict[str, Any]], direction: str) -> None:
    for rank, out in enumerate(ranks):
        (saved_params, saved_optim), (params, optim), files = out[f"ckpt/{direction}"]
        assert saved_params.keys() == params.keys()
        for name in saved_params:
            assert torch.equal(saved_params[name], params[name]), (rank, name)
        assert _flat_state(saved_optim) == _flat_state(optim), rank
        writers = 2 if direction.startswith("3/2") else WORLD_SIZE  # one replica writes
        assert [f for f in files if f.startswith("rank_")] == [f"rank_{r}.pt" for r in range(writers)]
        after_saved, after_resumed = out[f"ckpt-next/{direction}"]
        for name in after_saved:  # the next steps too: the resumed optimizer state is the saved one
            assert torch.allclose(after_saved[name], after_resumed[name], rtol=1e-5, atol=1e-7), (rank, name)


def _flat_state(state: dict[str, Any]) -> list[tuple[Any, ...]]:
    rows = []
    for key, per_param in sorted(state["state"].items()):
        for name, value in sorted(per_param.items()):
            rows.append((key, name, value.tolist() if isinstance(value, torch.Tensor) else value))
    return rows


# ---------------------------------------------------------------------------------------------------- errors
def _setup_error(rank: int, world_size: int, shard_sizes: list[Any], ranks_per_node: int | None) -> str:
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        options = EngineOptions(stage=2, shard_size=shard_sizes[rank])
        ZeroEngine(model, [optimizer], options, Communicator(ranks_per_node=ranks_per_node))
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _setup_errors(
    rank: int, world_size: int, shard_size_lists: list[list[Any]], ranks_per_node: int | None
) -> list[str]:
    """:func:`_setup_error` for each list of per-rank shard sizes, one after another in the same processes."""
    return [_setup_error(rank, world_size, sizes, ranks_per_node) for sizes in shard_size_lists]


# id -> (world_size, nodes, per-rank shard_size, ranks_per_node, expected message); cases with the same world size and
# node layout share one spawn.
BAD_SHARD_SIZES: dict[str, tuple[int, int, list[Any], int | None, str]] = {
    "not-a-divisor": (
        4,
        2,
        [3] * 4,
        None,
        r"ValueError: shard_size=3 does not divide world_size=4: pick a divisor of 4",
    ),
    "disagreeing": (
        4,
        2,
        [2, 2, 4, 2],
        None,
        r"RuntimeError: ranks disagree on the strategy's options and precision: .*'shard_size' 2, rank 2 has 4",
    ),
    "straddles-nodes": (
        6,
        2,
        [2] * 6,
        None,
        r"ValueError: shard_size=2 does not fit nodes of 3 ranks: a shard group would straddle",
    ),
    "ranks-not-numbered-by-node": (
        4,
        1,
        [2] * 4,
        2,
        r"ValueError: rank 2 has LOCAL_RANK=2, but shard groups of consecutive ranks assume",
    ),
}


@pytest.fixture(scope="module")
def bad_shard_size_errors() -> Callable[[str], list[str]]:
    """``errors(case)``: every rank's error for a case of ``BAD_SHARD_SIZES`` (one spawn per layout, when asked)."""
    found: dict[str, list[str]] = {}

    def errors(case: str) -> list[str]:
        if case not in found:
            world_size, nodes, _, ranks_per_node, _ = BAD_SHARD_SIZES[case]
            same = [k for k, v in BAD_SHARD_SIZES.items() if (v[0], v[1], v[3]) == (world_size, nodes, ranks_per_node)]
            lists = [BAD_SHARD_SIZES[k][2] for k in same]
            per_rank = run_on_ranks(_setup_errors, world_size, lists, ranks_per_node, nodes=nodes, timeout_s=120)
            for index, key in enumerate(same):
                found[key] = [rank_errors[index] for rank_errors in per_rank]
        return found[case]

    return errors


@pytest.mark.parametrize("case", list(BAD_SHARD_SIZES))
def test_bad_shard_size_raises_the_same_error_on_every_rank(
    bad_shard_size_errors: Callable[[str], list[str]], case: str
) -> None:
    errors = bad_shard_size_errors(case)
    assert len(set(errors)) == 1, errors
    assert re.match(BAD_SHARD_SIZES[case][4], errors[0]), errors[0]
