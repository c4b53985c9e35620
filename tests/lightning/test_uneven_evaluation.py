"""Evaluation loops with a different number of batches on each rank, on 2 gloo ranks: Lightning's prediction loop
never pads (9 samples: 5 and 4, in batches of 4), and a user's own sampler may give ranks different lengths. DDP
evaluates without collectives; stage 3 gathers its units, so a rank that finished first left the others waiting in
a gather (a hang, or "lost another rank" once it exited). Now it joins their gathers until every rank's loop has
ended (see [Note: evaluation loops of different lengths]): the same predictions and losses as DDP."""

from __future__ import annotations

import traceback
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from tests.helpers import run_on_ranks
from tests.lightning.models import make_trainer

WORLD_SIZE = 2
STRATEGIES: dict[str, dict[str, Any]] = {
    "stage2": {"stage": 2},
    "stage3": {"stage": 3},
    "stage3_no_prefetch": {"stage": 3, "overlap_comm": False},
}


class Evaluated(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def predict_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        return self.net(batch[0])


def _data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, 8, generator=generator), torch.randn(samples, 1, generator=generator))


def _strategy(name: str) -> Any:
    options = STRATEGIES.get(name)
    return DDPStrategy() if options is None else ZeroStrategy(wrap_policy={nn.Linear}, **options)


def _evaluate(rank: int, name: str) -> dict[str, Any]:
    trainer = make_trainer(WORLD_SIZE, _strategy(name), use_distributed_sampler=False)
    model = Evaluated()
    own = DataLoader(_data(16 if rank == 0 else 24, seed=rank), batch_size=8)  # 2 and 3 batches
    result: dict[str, Any] = {
        "validate": [trainer.validate(model, own, verbose=False)[0]["val_loss"] for _ in range(2)],
        "test": trainer.test(model, own, verbose=False)[0]["test_loss"],
    }
    predictor = make_trainer(WORLD_SIZE, _strategy(name))  # Lightning's own sampler: 5 and 4 of 9 samples
    result["predict"] = torch.cat(predictor.predict(model, DataLoader(_data(9, seed=9), batch_size=4)))
    return result


def _run(rank: int, world_size: int) -> dict[str, Any]:
    results = {}
    for name in ("ddp", *STRATEGIES):
        try:
            results[name] = _evaluate(rank, name)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    return results


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_on_ranks(_run, WORLD_SIZE, timeout_s=300)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_ranks_with_different_numbers_of_batches_evaluate_as_ddp(runs: list[dict[str, Any]], name: str) -> None:
    for rank, per_rank in enumerate(runs):
        expected, actual = per_rank["ddp"], per_rank[name]
        assert "error" not in actual, actual.get("error")
        assert actual["validate"] == pytest.approx(expected["validate"], rel=1e-6), f"rank {rank}"
        assert actual["test"] == pytest.approx(expected["test"], rel=1e-6), f"rank {rank}"
        assert actual["predict"].shape == expected["predict"].shape == ((5, 1) if rank == 0 else (4, 1))
        torch.testing.assert_close(actual["predict"], expected["predict"], rtol=1e-6, atol=1e-7)
