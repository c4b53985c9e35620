"""Ranks that build different models or pass different options fail on every rank with a clear error, no hang.

All cases run one after another in the same two processes: a case that hung would end the whole run at the
helper's timeout (a failure, not a skip), and a case that left the process group broken would fail the next.
"""

from __future__ import annotations

import pytest

from tests.helpers import run_on_ranks
from tests.lightning.models import TwoLayer, make_loader, make_trainer

WORLD_SIZE = 2
CASES = {
    "hidden_size_stage1": {"stage": 1, "hidden": "rank"},
    "hidden_size_stage2": {"stage": 2, "hidden": "rank"},
    "bucket_cap_mb": {"stage": 2, "bucket_cap_mb": "rank"},
    "free_gradients_after_step": {"stage": 3, "free_gradients_after_step": "rank"},  # local: no collective hangs
    "precision": {"stage": 3, "precision": "rank"},  # rank 0 bf16-mixed, rank 1 32-true: same parameter dtypes
    "agreeing_ranks": {"stage": 2},  # control: the same run with agreeing ranks trains
}


def _disagreeing_runs(rank: int, world_size: int) -> dict[str, tuple[str, str]]:
    from lightning_zero import ZeroStrategy

    out = {}
    for name, case in CASES.items():
        hidden = 15 + rank if case.get("hidden") == "rank" else 15
        bucket_cap_mb = 1 + rank if case.get("bucket_cap_mb") == "rank" else 25
        free = rank == 1 if case.get("free_gradients_after_step") == "rank" else False
        strategy = ZeroStrategy(stage=case["stage"], bucket_cap_mb=bucket_cap_mb, free_gradients_after_step=free)
        precision = ("bf16-mixed" if rank == 0 else "32-true") if case.get("precision") == "rank" else "32-true"
        trainer = make_trainer(world_size, strategy, max_steps=2, precision=precision)
        try:
            trainer.fit(TwoLayer(hidden=hidden), make_loader("two_layer"))
            out[name] = ("ok", f"global_step={trainer.global_step}")
        except Exception as error:
            out[name] = (type(error).__name__, str(error))
    return out


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, tuple[str, str]]]:
    return run_on_ranks(_disagreeing_runs, WORLD_SIZE)


@pytest.mark.parametrize("stage", [1, 2])
def test_rank_dependent_model_raises_on_every_rank(outcomes: list[dict[str, tuple[str, str]]], stage: int) -> None:
    for rank, results in enumerate(outcomes):
        kind, message = results[f"hidden_size_stage{stage}"]
        assert kind == "RuntimeError", f"rank {rank}: {kind}: {message}"
        assert "ranks disagree" in message, f"rank {rank}: {message}"
        assert "a.weight" in message, f"rank {rank}: the error should name the first differing parameter: {message}"
        assert "(15, 7)" in message, f"rank {rank}: the error should show rank 0's shape: {message}"
        assert "(16, 7)" in message, f"rank {rank}: the error should show rank 1's shape: {message}"


@pytest.mark.parametrize("option", ["bucket_cap_mb", "free_gradients_after_step"])
def test_rank_dependent_option_raises_on_every_rank(outcomes: list[dict[str, tuple[str, str]]], option: str) -> None:
    for rank, results in enumerate(outcomes):
        kind, message = results[option]
        assert kind == "RuntimeError", f"rank {rank}: {kind}: {message}"
        assert "ranks disagree" in message, f"rank {rank}: {message}"
        assert option in message, f"rank {rank}: {message}"


def test_rank_dependent_precision_raises_on_every_rank(outcomes: list[dict[str, tuple[str, str]]]) -> None:
    for rank, results in enumerate(outcomes):
        kind, message = results["precision"]
        assert kind == "RuntimeError", f"rank {rank}: {kind}: {message}"
        assert "ranks disagree on ZeroStrategy options and precision" in message, f"rank {rank}: {message}"
        assert "'precision.param_dtype' bfloat16" in message, f"rank {rank}: {message}"
        assert "Trainer precision" in message, f"rank {rank}: the error should say what to fix: {message}"


def test_processes_stay_usable_after_the_errors(outcomes: list[dict[str, tuple[str, str]]]) -> None:
    for rank, results in enumerate(outcomes):
        assert results["agreeing_ranks"] == ("ok", "global_step=2"), f"rank {rank}"
