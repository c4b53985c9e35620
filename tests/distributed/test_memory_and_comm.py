"""memory_report() and the communication counts match the ZeRO formulas on real gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero.config import ZeroConfig
from lightning_zero.core.comm import Communicator
from lightning_zero.core.engine import ZeroEngine
from tests.distributed.models import TinyLM, batch, loss_fn
from tests.helpers import run_on_ranks

FP32 = 4


def _one_step(rank: int, world_size: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=stage, bucket_cap_mb=0.001), Communicator())
    tokens, targets = batch(seed=rank)
    loss_fn(model, tokens, targets).backward()
    during_backward_end = engine.memory_report()
    optimizer.step()
    engine.finish_step(optimizer)
    pieces = [p for g in optimizer.param_groups for p in g["params"]]
    elementwise = sum(v.numel() * v.element_size() for p in pieces for v in optimizer.state[p].values() if v.dim() > 0)
    return {
        "psi": sum(p.numel() for p in model.parameters()),
        "padded": sum(b.buffer.layout.padded_numel for b in engine.buckets),
        "buckets": len(engine.buckets),
        "report": engine.memory_report().as_dict(),
        "after_backward": during_backward_end.as_dict(),
        "elementwise_state": elementwise,
        "scalar_state": engine.memory_report().optimizer_states - elementwise,
        "pieces": len(pieces),
        "comm": engine.last_step_comm.by_op,
        "n_params": len(list(model.parameters())),
    }


@pytest.fixture(scope="module", params=[1, 2], ids=lambda s: f"stage{s}")
def two_ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict]]:
    return request.param, run_on_ranks(_one_step, 2, request.param)


def test_model_states_match_the_zero_formulas(two_ranks: tuple[int, list[dict]]) -> None:
    stage, ranks = two_ranks
    n = len(ranks)
    psi = ranks[0]["psi"]
    padding = ranks[0]["padded"] - psi
    assert 0 <= padding < n * ranks[0]["buckets"]  # below world_size elements per buffer
    # Adam's element-wise state (exp_avg, exp_avg_sq) is exactly 8 bytes per parameter over all ranks.
    assert sum(r["elementwise_state"] for r in ranks) == 8 * psi
    for r in ranks:
        report = r["report"]
        assert report["params"] == FP32 * (psi + padding)  # full parameters on every rank (stages 1, 2)
        expected_grads = FP32 * (psi + padding) if stage == 1 else FP32 * (psi + padding) // n
        assert report["gradients"] == expected_grads
        # 8Ψ/N, plus one 4-byte `step` scalar per piece.
        assert r["elementwise_state"] <= 8 * (psi + padding) // n
        assert r["scalar_state"] == FP32 * r["pieces"]
        formula = 8 * psi + 8 * psi / n if stage == 1 else 4 * psi + 12 * psi / n  # fp32 Adam
        assert abs(report["total"] - formula) / formula < 0.05 + FP32 * r["pieces"] / formula


def test_stage2_keeps_only_the_gradient_shard_after_backward(two_ranks: tuple[int, list[dict]]) -> None:
    stage, ranks = two_ranks
    for r in ranks:
        if stage == 2:
            assert r["after_backward"]["gradients"] == FP32 * r["padded"] // len(ranks)
        else:
            assert r["after_backward"]["gradients"] == FP32 * r["padded"]


def test_a_step_moves_one_reduce_scatter_and_one_all_gather_of_the_model(two_ranks: tuple[int, list[dict]]) -> None:
    _, ranks = two_ranks
    for r in ranks:
        # Units of [Note: counting communication]: full-buffer bytes; 2Ψ elements a step, as DDP.
        assert r["comm"]["reduce_scatter"] == FP32 * r["padded"]
        assert r["comm"]["all_gather"] == FP32 * r["padded"]
        # Plus the agreement on which parameters got gradients: one uint8 all-reduce.
        assert r["comm"]["all_reduce"] == 2 * r["n_params"]


def _bucket_count(rank: int, world_size: int, cap_mb: float) -> int:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))  # 3 x 4160 params
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = ZeroEngine(model, [optimizer], ZeroConfig(stage=2, bucket_cap_mb=cap_mb), Communicator())
    return len(engine.buckets)


def test_bucket_cap_sets_the_number_of_buckets() -> None:
    # 4160 * 4 bytes = 16.25 KiB per layer: a 40 KiB cap holds two layers, a 1 MiB cap all three.
    assert run_on_ranks(_bucket_count, 2, 40 / 1024) == [2, 2]
    assert run_on_ranks(_bucket_count, 2, 1.0) == [1, 1]
