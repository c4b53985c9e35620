"""Full checkpoints through ``trainer.save_checkpoint`` and resuming with ``fit(ckpt_path=...)``, on 2 gloo ranks.

One spawn runs everything (see ``runs``): DDP and stages 1-3 each train 8 steps and save a checkpoint
after step 4 (the end of the first epoch); then each stage resumes from its own checkpoint, and stages resume
from each other's (2 to 1, 3 to 1, 1 to 3). The model ties its head to its embedding and has two param groups
and a StepLR scheduler, so the checkpoint holds shared keys, per-group hyperparameters and scheduler state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers import run_on_ranks
from tests.lightning.models import TiedLM, assert_every_case_finished, fit_cases, max_rel_diff, result_of

WORLD_SIZE = 2
SAVE_STEP = 4
STEPS = 8
RTOL = 1e-5
# 4 ranks' worth of batches per epoch: 32 samples / 2 ranks / batch size 4, so step 4 ends epoch 0.
SAMPLES = 32
BASE: dict[str, Any] = {
    "model": "tied",
    "model_kwargs": {"param_groups": True},
    "samples": SAMPLES,
    # wrap_policy only matters at stage 3, where every Linear becomes a gather unit.
    "strategy_kwargs": {"state_dict_type": "full", "wrap_policy": {nn.Linear}},
    "trainer": {"max_steps": STEPS},
}
SAVED = {"ddp": "ddp.ckpt", 1: "zero1.ckpt", 2: "zero2.ckpt", 3: "zero3.ckpt"}
RESUMES = [(1, 1), (2, 2), (2, 1), (3, 3), (3, 1), (1, 3)]  # (stage that saved, stage that resumes)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("checkpoints")
    cases = [{**BASE, "strategy": s, "save_at": (SAVE_STEP, str(directory / name))} for s, name in SAVED.items()]
    cases += [{**BASE, "strategy": resume, "ckpt_path": str(directory / SAVED[saved])} for saved, resume in RESUMES]
    per_rank = run_on_ranks(fit_cases, WORLD_SIZE, cases)
    rank0 = per_rank[0]
    return {
        "dir": directory,
        "uninterrupted": {strategy: rank0[index] for index, strategy in enumerate(SAVED)},
        "resumed": {pair: rank0[len(SAVED) + index] for index, pair in enumerate(RESUMES)},
        "per_rank": per_rank,
    }


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def _assert_close(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], what: str) -> None:
    diffs = max_rel_diff(expected, actual)
    bad = {key: diff for key, diff in diffs.items() if not diff <= RTOL}
    assert not bad, f"{what}: relative differences {bad}"


def test_every_case_finished_on_every_rank(runs: dict[str, Any]) -> None:
    """The resumes are compared on rank 0 only: one that raised on rank 1 alone still fails here."""
    names = [("saved", strategy) for strategy in SAVED] + [("resumed", pair) for pair in RESUMES]
    assert_every_case_finished({name: [r[i] for r in runs["per_rank"]] for i, name in enumerate(names)})


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_checkpoint_is_one_ordinary_file_with_the_plain_state_dict(runs: dict[str, Any], stage: int) -> None:
    result_of(runs["uninterrupted"][stage])  # the run that saved it did not raise
    path = runs["dir"] / SAVED[stage]
    assert path.is_file(), f"expected one checkpoint file at {path}"
    assert [p.name for p in runs["dir"].iterdir() if p.name.startswith(path.stem)] == [path.name]
    checkpoint = _load(path)
    plain_keys = list(TiedLM(param_groups=True).state_dict().keys())
    assert "head.weight" in plain_keys  # the tied key is part of the plain state dict
    assert list(checkpoint["state_dict"].keys()) == plain_keys
    assert checkpoint["global_step"] == SAVE_STEP
    reference = _load(runs["dir"] / SAVED["ddp"])
    _assert_close(reference["state_dict"], checkpoint["state_dict"], "checkpointed weights vs DDP's")
    assert checkpoint["state_dict"]["head.weight"].equal(checkpoint["state_dict"]["embed.weight"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_checkpoint_optimizer_state_equals_ddp(runs: dict[str, Any], stage: int) -> None:
    result_of(runs["uninterrupted"]["ddp"])
    result_of(runs["uninterrupted"][stage])
    expected = _load(runs["dir"] / SAVED["ddp"])
    actual = _load(runs["dir"] / SAVED[stage])
    assert len(actual["optimizer_states"]) == len(expected["optimizer_states"]) == 1
    ddp_opt, zero_opt = expected["optimizer_states"][0], actual["optimizer_states"][0]
    assert zero_opt["param_groups"] == ddp_opt["param_groups"]
    assert sorted(zero_opt["state"]) == sorted(ddp_opt["state"]) == list(range(5))  # embed (tied with head), up, down
    for index, ddp_state in ddp_opt["state"].items():
        zero_state = zero_opt["state"][index]
        assert sorted(zero_state) == sorted(ddp_state), f"param {index}: state keys"
        _assert_close(ddp_state, zero_state, f"optimizer state of param {index}")
        assert zero_state["step"].item() == SAVE_STEP
    assert actual["lr_schedulers"] == expected["lr_schedulers"]


@pytest.mark.parametrize(("saved", "resumed"), RESUMES, ids=[f"stage{s}-to-stage{r}" for s, r in RESUMES])
def test_resume_continues_like_the_uninterrupted_run(runs: dict[str, Any], saved: int, resumed: int) -> None:
    result = result_of(runs["resumed"][(saved, resumed)])
    assert result["global_step"] == STEPS
    uninterrupted = result_of(runs["uninterrupted"][resumed])
    _assert_close(uninterrupted["state"], result["state"], "resumed vs uninterrupted ZeRO run")
    _assert_close(result_of(runs["uninterrupted"]["ddp"])["state"], result["state"], "resumed vs uninterrupted DDP")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_saving_mid_run_leaves_training_equal_to_ddp(runs: dict[str, Any], stage: int) -> None:
    for rank, results in enumerate(runs["per_rank"]):
        ddp, zero = result_of(results[0]), result_of(results[list(SAVED).index(stage)])
        assert zero["global_step"] == ddp["global_step"] == STEPS
        _assert_close(ddp["state"], zero["state"], f"rank {rank}: stage {stage} vs DDP after {STEPS} steps")


# Saved by 2 ranks, resumed by 3: Lightning splits the data differently, so the oracle is DDP resuming the
# DDP checkpoint on 3 ranks as well.
CROSS = [("ddp", "ddp"), (2, 1), (1, 2)]  # (stage that saved on 2 ranks, strategy that resumes on 3)


@pytest.fixture(scope="module")
def resumed_on_three_ranks(runs: dict[str, Any]) -> dict[tuple[Any, Any], dict[str, Any]]:
    cases = [{**BASE, "strategy": resume, "ckpt_path": str(runs["dir"] / SAVED[saved])} for saved, resume in CROSS]
    per_rank = run_on_ranks(fit_cases, 3, cases)
    return {pair: [results[index] for results in per_rank] for index, pair in enumerate(CROSS)}


@pytest.mark.parametrize(("saved", "resumed"), CROSS[1:], ids=[f"stage{s}-to-stage{r}" for s, r in CROSS[1:]])
def test_resume_at_another_world_size_matches_ddp(
    resumed_on_three_ranks: dict[tuple[Any, Any], dict[str, Any]], saved: int, resumed: int
) -> None:
    expected = resumed_on_three_ranks[("ddp", "ddp")]
    actual = resumed_on_three_ranks[(saved, resumed)]
    for rank, (ddp, zero) in enumerate(zip(map(result_of, expected), map(result_of, actual), strict=True)):
        assert zero["global_step"] == ddp["global_step"] == STEPS
        _assert_close(ddp["state"], zero["state"], f"rank {rank} of 3: resumed ZeRO vs resumed DDP")
