"""ZeroStrategy(weighted_loss=True): the gradient of the mean over every token of a step, all ranks and micro-batches.

Sequences of 1 to 12 real tokens (the rest labelled -100) make every micro-batch's token count differ. The
oracle is one process that takes the same global batch of each step (every rank's micro-batches, as Lightning's
DistributedSampler without shuffling gives them: rank r gets samples r, r + N, ...), sums the loss over all its
tokens, divides by their number, clips by norm and steps. Plain DDP's mean of means is computed too, to show the
test can tell the two apart.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from tests.helpers import run_on_ranks
from tests.lightning.models import TokenSequences, make_trainer

VOCAB, LENGTH, BATCH, ACCUMULATE, STEPS, CLIP = 11, 12, 3, 2, 4, 1.0
RTOL = 1e-5


def _sums(model: nn.Module, tokens: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    logits = model(tokens)
    loss = nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return loss, (labels != -100).sum()


class TokenLM(pl.LightningModule):
    """Returns ``{"loss": loss_sum, "loss_weight": n_tokens}``; ``variant`` breaks it in one way for the errors."""

    def __init__(self, variant: str = "weighted") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, VOCAB))
        self.variant = variant
        self.automatic_optimization = not variant.startswith("manual")
        self.seen: list[tuple[float | None, float | None]] = []
        self.batches: list[tuple[Tensor, Tensor]] = []  # what this rank trained on, for the oracle

    def forward(self, tokens: Tensor) -> Tensor:
        return self.net(tokens)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Any:
        if self.variant == "masked_step_1" and self.trainer.global_step == 1:
            batch = (batch[0], torch.full_like(batch[1], -100))  # every token of step 1 masked, on every rank
        self.batches.append((batch[0].clone(), batch[1].clone()))
        loss, weight = _sums(self, *batch)
        if self.variant == "manual":
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss, loss_weight=weight)
            self.clip_gradients(optimizer, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
            optimizer.step()
            return None
        if self.variant == "manual_without_weight":
            self.manual_backward(loss)
            return None
        broken = {"plain": loss, "negative": -1, "nan": float("nan"), "vector": torch.ones(2)}
        if self.variant == "plain":
            return loss
        return {"loss": loss, "loss_weight": broken.get(self.variant, weight)}

    def on_train_batch_end(self, *args: Any) -> None:
        strategy = self.trainer.strategy
        self.seen.append((strategy.global_loss_weight, strategy.global_mean_loss))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def _fit(world_size: int, stage: int, variant: str = "weighted", **strategy: Any) -> Any:
    from lightning_zero import ZeroStrategy

    model = TokenLM(variant)
    manual = variant.startswith("manual")
    accumulate = 1 if manual else ACCUMULATE
    trainer = make_trainer(
        world_size,
        ZeroStrategy(stage=stage, **{"weighted_loss": True, **strategy}),
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=None if manual else CLIP,
    )
    samples = BATCH * accumulate * world_size * STEPS
    data = DataLoader(TokenSequences(samples, VOCAB, LENGTH), batch_size=BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    with trainer.strategy.gathered_params():
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    zero_warned = any("global loss weight of this step is 0" in str(w.message) for w in caught)
    return {"state": state, "seen": model.seen, "zero_warned": zero_warned, "batches": model.batches}


def _runs(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for stage in (1, 2, 3):
        results[f"stage{stage}"] = _fit(world_size, stage)
    results["zero_step"] = _fit(world_size, 2, "masked_step_1")
    results["manual"] = _fit(world_size, 3, "manual")
    if world_size == 2:
        results["offload"] = _fit(world_size, 2, offload_optimizer="cpu")
        for variant, options in (
            ("plain", {}),
            ("negative", {}),
            ("nan", {}),
            ("vector", {}),
            ("weighted", {"weighted_loss": False}),
            ("manual_without_weight", {}),
            ("manual", {"weighted_loss": False}),
        ):
            try:
                _fit(world_size, 2, variant, **options)
                results[f"error/{variant}/{bool(options)}"] = "no error"
            except ValueError as error:
                results[f"error/{variant}/{bool(options)}"] = str(error)
    return results


def _reference(batches: list[list[tuple[Tensor, Tensor]]], weighted: bool, accumulate: int = ACCUMULATE) -> Any:
    """One process: each step's global batch (``batches[rank][micro-batch]``), the loss over all its tokens
    (``weighted``) or DDP's mean of means, clipped by norm; a step over no tokens is skipped."""
    model = TokenLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(STEPS):
        optimizer.zero_grad()
        sums, weights = [], []
        for per_rank in batches:
            for tokens, labels in per_rank[step * accumulate : (step + 1) * accumulate]:
                loss, weight = _sums(model, tokens, labels)
                sums.append(loss)
                weights.append(weight)
        total = sum(weights)
        if total == 0:
            continue
        loss = sum(sums) / total if weighted else sum(s / w for s, w in zip(sums, weights, strict=True)) / len(sums)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, float(total), float(sum(sums) / max(total, 1))


def _max_rel(expected: dict[str, Tensor], actual: dict[str, Tensor]) -> float:
    return max(((expected[k] - actual[k]).abs().max() / expected[k].abs().max()).item() for k in expected)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def runs(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_on_ranks(_runs, request.param)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameters_equal_one_process_on_the_global_token_mean(runs: tuple[int, list[dict]], stage: int) -> None:
    _, per_rank = runs
    batches = [results[f"stage{stage}"]["batches"] for results in per_rank]
    weighted, weight, mean = _reference(batches, weighted=True)
    mean_of_means, _, _ = _reference(batches, weighted=False)
    assert _max_rel(weighted, mean_of_means) > 1e-3  # the test can tell the global mean from DDP's
    for rank, results in enumerate(per_rank):
        result = results[f"stage{stage}"]
        assert _max_rel(weighted, result["state"]) <= RTOL, f"rank {rank}"
        last_weight, last_mean = result["seen"][-1]
        assert last_weight == weight
        assert last_mean == pytest.approx(mean, rel=1e-6)


def test_a_step_over_no_tokens_is_skipped_on_every_rank(runs: tuple[int, list[dict]]) -> None:
    _, per_rank = runs
    expected, _, _ = _reference([results["zero_step"]["batches"] for results in per_rank], weighted=True)
    for rank, results in enumerate(per_rank):
        assert results["zero_step"]["zero_warned"], f"rank {rank}: no warning"
        assert _max_rel(expected, results["zero_step"]["state"]) <= RTOL, f"rank {rank}"


def test_manual_backward_takes_the_weight(runs: tuple[int, list[dict]]) -> None:
    _, per_rank = runs
    expected, _, _ = _reference([results["manual"]["batches"] for results in per_rank], weighted=True, accumulate=1)
    for rank, results in enumerate(per_rank):
        assert _max_rel(expected, results["manual"]["state"]) <= RTOL, f"rank {rank}"


def test_offload_composes(runs: tuple[int, list[dict]]) -> None:
    world_size, per_rank = runs
    if world_size != 2:
        pytest.skip("run on 2 ranks")
    expected, _, _ = _reference([results["offload"]["batches"] for results in per_rank], weighted=True)
    for rank, results in enumerate(per_rank):
        assert _max_rel(expected, results["offload"]["state"]) <= RTOL, f"rank {rank}"


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("error/plain/False", r"weighted_loss=True\) needs training_step to return \{\"loss\": loss_sum"),
        ("error/negative/False", r"training_step at global step 0: loss_weight must be finite and >= 0.*got -1"),
        ("error/nan/False", r"loss_weight must be finite and >= 0.*got nan"),
        ("error/vector/False", r"loss_weight must be a scalar.*shape \(2,\)"),
        ("error/weighted/True", r"returned 'loss_weight', but ZeroStrategy\(weighted_loss=False\)"),
        ("error/manual_without_weight/False", r"needs self.manual_backward\(loss_sum, loss_weight=n_tokens\)"),
        (
            "error/manual/True",
            r"manual_backward at global step 0 got loss_weight, but ZeroStrategy\(weighted_loss=False",
        ),
    ],
)
def test_bad_weights_and_option_mismatches_raise_on_every_rank(
    runs: tuple[int, list[dict]], key: str, expected: str
) -> None:
    import re

    world_size, per_rank = runs
    if world_size != 2:
        pytest.skip("run on 2 ranks")
    for rank, results in enumerate(per_rank):
        assert re.search(expected, results[key]), f"rank {rank}: {results[key]}"
