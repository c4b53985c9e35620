"""Every precision of the Trainer strategy under Fabric, with offload too: a Fabric run equals the Trainer's
ZeroStrategy doing the same maths (the same engine, model, per-rank data, accumulation and norm clipping), its fp32
masters bit for bit, on 2 gloo ranks. fp16 ("16-mixed", dynamic loss scaling) comes as a plugin on both sides:
on the CPU Fabric and Lightning turn the flag into bf16 for a strategy they do not know. fp32 and bf16-mixed at every
stage are in test_fabric_parity.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from tests.distributed.models import VOCAB, TinyLM
from tests.fabric.parity import (
    ACCUMULATE,
    CLIP,
    STEPS,
    TINY_BUCKET_MB,
    LitTinyLM,
    fabric_loop,
    make_optimizers,
    masters,
    rank_loader,
    relative,
)
from tests.helpers import run_on_ranks
from tests.lightning.models import make_trainer

# (precision, stage, offload_optimizer, offload_params)
CASES = [
    ("16-mixed", 2, False, False),
    ("16-mixed", 3, False, False),
    ("bf16-true", 1, False, False),
    ("bf16-true", 3, False, False),
    ("bf16-mixed", 3, "cpu", "cpu"),
    ("32-true", 2, "cpu", False),
]


class FloatLossLM(LitTinyLM):
    """The loss in fp32, as Fabric's plugins give the model's output back in the default dtype (under "bf16-true"
    the Trainer's loss would otherwise be computed in bf16: other maths)."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        logits = self.net(tokens).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _masked(tokens: torch.Tensor, targets: torch.Tensor, step: int) -> torch.Tensor:
    """Targets with a varying number ignored (-100), so that ranks and micro-batches weigh differently."""
    targets = targets.clone()
    targets.view(-1)[: (3 * step + int(tokens.sum())) % 7] = -100
    return targets


def _loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    flat = targets.reshape(-1)
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), flat, ignore_index=-100, reduction="sum")
    return loss, int((flat != -100).sum())


class WeightedLM(LitTinyLM):
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        tokens, targets = batch
        loss, weight = _loss_sum(self.net(tokens), _masked(tokens, targets, batch_idx))
        return {"loss": loss, "loss_weight": weight}


def _weighted(rank: int, world_size: int, initial: nn.Module) -> float:
    """weighted_loss=True: ``fabric.backward(loss_sum, loss_weight=n)`` against the Trainer's ``{"loss": loss_sum,
    "loss_weight": n}``, stage 3, accumulation and clipping; the masters' difference."""
    from lightning.fabric import Fabric

    from lightning_zero import ZeroFabricStrategy
    from tests.fabric.parity import micro_batch

    options = {**_options(3, False, False), "weighted_loss": True}
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=ZeroFabricStrategy(**options))
    fabric.launch()
    model = copy.deepcopy(initial)
    wrapped, optimizer = fabric.setup(model, *make_optimizers(model, "one"))
    index = 0
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            tokens, targets = micro_batch(step, micro, rank)
            loss, weight = _loss_sum(wrapped(tokens), _masked(tokens, targets, index))
            index += 1
            with fabric.no_backward_sync(wrapped, enabled=micro < ACCUMULATE - 1):
                fabric.backward(loss, loss_weight=weight)
        fabric.clip_gradients(wrapped, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()
    by_fabric = masters(fabric.strategy.session.engine)
    by_trainer, _ = _trained_by_trainer(rank, world_size, WeightedLM(initial), options, [])
    return relative(by_trainer, by_fabric)


def _trained_by_trainer(
    rank: int, world_size: int, module: LitTinyLM, options: dict[str, Any], plugins: list[Any]
) -> tuple[dict[str, torch.Tensor], Any]:
    """The fp32 masters after the Trainer's ZeroStrategy(**options) fit ``module`` as the Fabric loop trains, and the
    strategy."""
    from lightning_zero import ZeroStrategy

    strategy = ZeroStrategy(**options)
    trainer = make_trainer(
        world_size,
        strategy,
        plugins=plugins,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        gradient_clip_algorithm="norm",
        use_distributed_sampler=False,
    )
    trainer.fit(module, rank_loader(rank))
    return masters(strategy.session.engine, prefix="net."), strategy


def _options(stage: int, offload_optimizer: Any, offload_params: Any) -> dict[str, Any]:
    return {
        "stage": stage,
        "bucket_cap_mb": TINY_BUCKET_MB,
        "wrap_policy": {nn.Linear} if stage == 3 else None,
        "offload_optimizer": offload_optimizer,
        "offload_params": offload_params,
    }


def _compare(rank: int, world_size: int) -> dict[str, Any]:
    from lightning.fabric import Fabric

    from lightning_zero import ZeroFabricPrecision, ZeroFabricStrategy, ZeroPrecision

    out: dict[str, Any] = {}
    torch.manual_seed(0)
    initial = TinyLM()
    for precision, stage, offload_optimizer, offload_params in CASES:
        key = f"{precision}/{stage}/{offload_optimizer}/{offload_params}"
        options = _options(stage, offload_optimizer, offload_params)
        fabric = Fabric(
            accelerator="cpu",
            devices=world_size,
            strategy=ZeroFabricStrategy(**options),
            plugins=[ZeroFabricPrecision(precision)],
        )
        fabric.launch()
        model = copy.deepcopy(initial)
        wrapped, optimizer = fabric.setup(model, *make_optimizers(model, "one"))
        fabric_loop(fabric, wrapped, [optimizer], rank)
        by_fabric = masters(fabric.strategy.session.engine)
        by_trainer, strategy = _trained_by_trainer(
            rank, world_size, FloatLossLM(initial), options, [ZeroPrecision(precision)]
        )
        out[key] = {
            "difference": relative(by_trainer, by_fabric),
            "moved": relative({k: v.float() for k, v in initial.state_dict().items()}, by_fabric),
            "param_dtype": str(model.a.weight.dtype),
            "scale": fabric.strategy.precision.scaler.scale if precision == "16-mixed" else None,
            "trainer_scale": strategy.precision_plugin.scaler.scale if precision == "16-mixed" else None,
        }
    out["weighted"] = _weighted(rank, world_size, initial)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_on_ranks(_compare, 2)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_fabric_equals_the_trainer_strategy_doing_the_same_maths(results: list[dict[str, Any]], case: tuple) -> None:
    precision = case[0]
    key = "/".join(map(str, case))
    expected_dtype = "torch.float32" if precision == "32-true" else "torch.bfloat16"
    if precision == "16-mixed":
        expected_dtype = "torch.float16"
    for rank, out in enumerate(results):
        run = out[key]
        assert run["difference"] == 0.0, f"rank {rank}: {run['difference']:.2e}"
        assert run["moved"] > 1e-3, f"rank {rank}: the run did not train ({run['moved']:.2e})"
        assert run["param_dtype"] == expected_dtype, (rank, run["param_dtype"])
        assert run["scale"] == run["trainer_scale"], (rank, run["scale"], run["trainer_scale"])


def test_weighted_loss_through_fabric_backward_equals_the_trainer_strategy(results: list[dict[str, Any]]) -> None:
    """``fabric.backward(loss_sum, loss_weight=n)`` trains on the global token mean exactly as the Trainer's
    ``training_step`` returning ``{"loss": loss_sum, "loss_weight": n}`` does (docs/weighted_loss.md)."""
    for rank, out in enumerate(results):
        assert out["weighted"] == 0.0, f"rank {rank}: {out['weighted']:.2e}"
