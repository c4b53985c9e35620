"""Models whose layers need care in 16-bit runs: batch norm keeps fp32 parameters next to its fp32 statistics."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import run_on_ranks
from tests.lightning.models import make_trainer

WORLD_SIZE = 2
PRECISIONS = ("bf16-mixed", "16-mixed")


class WithBatchNorm(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).float(), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(stage: int, precision: str) -> dict[str, Any]:
    from lightning_zero import ZeroPrecision, ZeroStrategy

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(64, 8, generator=generator)
    loader = DataLoader(TensorDataset(x, x[:, :1] * 2), batch_size=8)
    plugin = {"plugins": [ZeroPrecision("16-mixed")]} if precision == "16-mixed" else {"precision": precision}
    trainer = make_trainer(WORLD_SIZE, ZeroStrategy(stage=stage), max_steps=8, limit_val_batches=2, **plugin)
    model = WithBatchNorm()
    norm = model.net[1]
    stats_before = norm.running_mean.clone()
    trainer.fit(model, loader, loader)
    validated = trainer.validate(model, loader, verbose=False)[0]["val_loss"]
    engine = trainer.strategy._engine
    # What the optimizer updates: the fp32 masters, and batch norm's own fp32 parameters (see core/store/stores.py).
    pieces = [e.store.step_view(e.slot) for e in engine.step_of(trainer.optimizers[0]).entries]
    state = engine.full_state_dict(keep=True)
    return {
        "norm_dtypes": {str(p.dtype) for p in norm.parameters()},
        "linear_dtype": str(model.net[0].weight.dtype) if stage < 3 else None,
        "piece_dtypes": {str(p.dtype) for p in pieces},
        "stats": (str(norm.running_mean.dtype), bool((norm.running_mean != stats_before).any())),
        "state_finite": all(bool(torch.isfinite(v).all()) for v in state.values() if v.is_floating_point()),
        "val_loss": validated,
    }


class WithLayerNorm(pl.LightningModule):
    """What hands a 16-bit LayerNorm an fp32 input on the CPU (see [Note: fp32 inputs of 16-bit norm layers]): a
    frozen embedding (kept fp32) plus an fp32 positional buffer, and fp32 features into a GroupNorm."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 16).requires_grad_(False)
        self.register_buffer("pos", torch.randn(4, 16))
        self.norm = nn.LayerNorm(16)
        self.group_norm = nn.GroupNorm(4, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, tokens: Tensor) -> Tensor:
        features = self.group_norm(nn.functional.one_hot(tokens, 16).float().transpose(1, 2)).transpose(1, 2)
        return self.head(self.norm(self.embed(tokens) + self.pos) + features)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens).float().reshape(-1, 10), targets.reshape(-1))

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def _fit_layer_norm(stage: int | str, precision: str) -> float:
    from lightning_zero import ZeroPrecision, ZeroStrategy

    tokens = torch.randint(0, 10, (64, 4), generator=torch.Generator().manual_seed(3))
    loader = DataLoader(TensorDataset(tokens, (tokens + 1) % 10), batch_size=8)
    plugin = {"plugins": [ZeroPrecision("16-mixed")]} if precision == "16-mixed" else {"precision": precision}
    strategy = "ddp" if stage == "ddp" else ZeroStrategy(stage=int(stage))
    trainer = make_trainer(WORLD_SIZE, strategy, max_steps=8, limit_val_batches=2, **plugin)
    model = WithLayerNorm()
    trainer.fit(model, loader, loader)
    return trainer.validate(model, loader, verbose=False)[0]["val_loss"]


def _all_cases(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases = [(_fit, stage, precision) for stage in (1, 2, 3) for precision in PRECISIONS]
    cases += [(_fit_layer_norm, stage, precision) for stage in ("ddp", 1, 2, 3) for precision in PRECISIONS]
    for fit, stage, precision in cases:
        key = f"{'layer_norm/' if fit is _fit_layer_norm else ''}{stage}/{precision}"
        if stage == "ddp" and precision == "16-mixed":
            continue  # DDP's CPU fp16 is no reference here
        try:
            out[key] = fit(stage, precision)
        except Exception as error:  # reported per case, so the others still run
            out[key] = f"{type(error).__name__}: {error}"
    return out


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, Any]]:
    return run_on_ranks(_all_cases, WORLD_SIZE)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_batch_norm_trains_with_fp32_parameters_and_statistics(
    outcomes: list[dict[str, Any]], stage: int, precision: str
) -> None:
    for rank, results in enumerate(outcomes):
        result = results[f"{stage}/{precision}"]
        assert isinstance(result, dict), f"rank {rank}: {result}"
        # CPU batch_norm is no autocast op: its weight must match its fp32 statistics, as FSDP keeps it.
        assert result["norm_dtypes"] == {"torch.float32"}, result
        assert result["stats"] == ("torch.float32", True), result
        if stage < 3:  # the Linear layers are held in 16 bits (stage 3 frees them at rest)
            assert result["linear_dtype"] == ("torch.bfloat16" if precision == "bf16-mixed" else "torch.float16")
        assert result["piece_dtypes"] == {"torch.float32"}, result  # masters, and the norm's own fp32 pieces
        assert result["state_finite"], result
        assert result["val_loss"] < 5.0, result


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_layer_and_group_norm_take_fp32_inputs(outcomes: list[dict[str, Any]], stage: int, precision: str) -> None:
    """A frozen fp32 embedding plus an fp32 positional buffer into a LayerNorm, fp32 features into a GroupNorm: on
    the CPU every rank failed at the first forward ("mixed dtype (CPU): expect parameter to have scalar type of
    Float", found in a user's trial); DDP trains. Now the validation loss is DDP's bf16-mixed one, within 16-bit
    rounding of the LayerNorm's input."""
    for rank, results in enumerate(outcomes):
        loss = results[f"layer_norm/{stage}/{precision}"]
        assert isinstance(loss, float), f"rank {rank}: {loss}"
        reference = results["layer_norm/ddp/bf16-mixed"]
        assert loss == pytest.approx(reference, rel=0.01), (loss, reference)
