"""Ranks that build different models or pass different options fail on every rank with a clear error, no hang.

All cases run one after another in the same two processes: a case that hung would end the whole run at the
helper's timeout (a failure, not a skip), and a case that left the process group broken would fail the next.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import run_on_ranks
from tests.lightning.models import TwoLayer, make_loader, make_trainer

WORLD_SIZE = 2
CASES = {
    "hidden_size_stage1": {"stage": 1, "hidden": "rank"},
    "hidden_size_stage2": {"stage": 2, "hidden": "rank"},
    "bucket_cap_mb": {"stage": 2, "bucket_cap_mb": "rank"},
    "free_gradients_after_step": {"stage": 3, "free_gradients_after_step": "rank"},  # local: no collective hangs
    "precision": {"stage": 3, "precision": "rank"},  # rank 0 bf16-mixed, rank 1 32-true: same parameter dtypes
    # Stage 3 stepped at other times without a hang (a silent divergence before); stage 1 waited in the clip's norm.
    "accumulate_grad_batches": {"stage": 3, "trainer": {"accumulate_grad_batches": "rank"}},
    "gradient_clip_val": {"stage": 1, "trainer": {"gradient_clip_val": "rank"}},
    # Stage 3's step has no collective: the next backward's agreement sees the step counts differ. (At stages 1-2 the
    # stepping rank waits in the all-gather of its new shard, which the other never joins: the strategy's timeout.)
    "skipped_step": {"stage": 3, "skip_step_on_rank": 1},
    # Stages 2-3 add a reduction into a held gradient that zero_grad did not empty, in the shard only its rank steps.
    "skipped_zero_grad": {"stage": 2, "skip_step_on_rank": 1, "skip": "zero_grad"},
    "agreeing_ranks": {"stage": 2},  # control: the same run with agreeing ranks trains
}
# Per rank, the Trainer arguments of the cases that set them per rank.
TRAINER_VALUES = {"accumulate_grad_batches": (1, 2), "gradient_clip_val": (0.5, None)}


class SkipsAStep(TwoLayer):
    """Manual optimization whose ``skip_on_rank`` leaves out ``optimizer.step()`` (or ``zero_grad()``) at batch 1:
    its shards would end a step behind the other ranks' (or step on two batches' gradients)."""

    def __init__(self, skip_on_rank: int, skip: str = "step") -> None:
        super().__init__()
        self.automatic_optimization = False
        self.skip_on_rank, self.skip = skip_on_rank, skip

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        optimizer = self.optimizers()
        skipping = batch_idx == 1 and self.global_rank == self.skip_on_rank
        if not (skipping and self.skip == "zero_grad"):
            optimizer.zero_grad()
        self.manual_backward(super().training_step(batch, batch_idx))
        if not (skipping and self.skip == "step"):
            optimizer.step()


def _disagreeing_runs(rank: int, world_size: int) -> dict[str, tuple[str, str]]:
    from lightning_zero import ZeroStrategy

    out = {}
    for name, case in CASES.items():
        hidden = 15 + rank if case.get("hidden") == "rank" else 15
        bucket_cap_mb = 1 + rank if case.get("bucket_cap_mb") == "rank" else 25
        free = rank == 1 if case.get("free_gradients_after_step") == "rank" else False
        strategy = ZeroStrategy(stage=case["stage"], bucket_cap_mb=bucket_cap_mb, free_gradients_after_step=free)
        precision = ("bf16-mixed" if rank == 0 else "32-true") if case.get("precision") == "rank" else "32-true"
        per_rank = {name: TRAINER_VALUES[name][rank] for name in case.get("trainer", {})}
        trainer = make_trainer(world_size, strategy, max_steps=4, precision=precision, **per_rank)
        skipping = "skip_step_on_rank" in case
        model = SkipsAStep(case["skip_step_on_rank"], case.get("skip", "step")) if skipping else TwoLayer(hidden=hidden)
        try:
            trainer.fit(model, make_loader("two_layer"))
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
        assert "ranks disagree on the strategy's options and precision" in message, f"rank {rank}: {message}"
        assert "'precision.param_dtype' bfloat16" in message, f"rank {rank}: {message}"
        assert "the Trainer's precision" in message, f"rank {rank}: the error should say what to fix: {message}"


@pytest.mark.parametrize(("setting", "shown"), [("accumulate_grad_batches", "1"), ("gradient_clip_val", "0.5")])
def test_rank_dependent_trainer_setting_raises_on_every_rank(
    outcomes: list[dict[str, tuple[str, str]]], setting: str, shown: str
) -> None:
    """Ranks that would step at other times (or one alone compute a clip's norm) fail at setup, naming it."""
    for rank, results in enumerate(outcomes):
        kind, message = results[setting]
        assert kind == "RuntimeError", f"rank {rank}: {kind}: {message}"
        assert f"rank 0 has 'Trainer {setting}' {shown}, rank 1 has" in message, f"rank {rank}: {message}"
        assert "accumulate_grad_batches and gradient clipping" in message, message


def test_a_step_skipped_on_one_rank_raises_on_every_rank(outcomes: list[dict[str, tuple[str, str]]]) -> None:
    """Manual optimization that leaves out one optimizer.step() on rank 1 at stage 3: the next backward's agreement
    names it (the run trained on silently with half its shards a step behind before)."""
    for rank, results in enumerate(outcomes):
        kind, message = results["skipped_step"]
        assert kind == "RuntimeError", f"rank {rank}: {kind}: {message}"
        assert "ranks disagree on the steps optimizer 0 (AdamW) has taken: rank 0 has 2, rank 1 has 1" in message
        assert "call optimizer.step() together" in message, message


def test_a_zero_grad_skipped_on_one_rank_raises_on_every_rank(outcomes: list[dict[str, tuple[str, str]]]) -> None:
    """Rank 1 leaves out one zero_grad() at stage 2: the next backward's agreement names it (the reduction was added
    into rank 1's held shard, silently, before)."""
    for rank, results in enumerate(outcomes):
        kind, message = results["skipped_zero_grad"]
        assert kind == "RuntimeError", f"rank {rank}: {kind}: {message}"
        expected = "the backward passes whose gradients optimizer 0 (AdamW) holds since its zero_grad: rank 0 has 0"
        assert expected in message, message
        assert "rank 1 has 1" in message, message
        assert "call zero_grad() together" in message, message


def test_processes_stay_usable_after_the_errors(outcomes: list[dict[str, tuple[str, str]]]) -> None:
    for rank, results in enumerate(outcomes):
        assert results["agreeing_ranks"] == ("ok", "global_step=4"), f"rank {rank}"
