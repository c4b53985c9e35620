"""The cases of the training spawns that test_unfreezing.py, test_exception_retry.py, test_idle_rank.py and
test_fp16_batch_norm.py share, and the checks those files have in common.

Each world size runs all of its cases in one spawn (:func:`outcomes`, through the session fixture
``training_outcomes`` of tests/lightning/conftest.py), each case in a process group of its own with a 30 s
collective timeout (``training_models.TIMEOUT``), so a hang fails its own case and nothing else. 2 ranks run every
case below, 3 ranks the unfreezing and idle-rank cases; a file run alone runs every case of the world sizes it asks
for. Parameters are compared with ``max |a - b| / max |a|`` per tensor, as in ``test_ddp_equivalence.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.lightning.models import BATCH_SIZE, max_rel_diff, result_of
from tests.lightning.training_models import ACCUMULATE, NORM_CLIP, run_isolated

RTOL = 1e-5  # fp32 against DDP, as in test_ddp_equivalence.py
STAGES = (1, 2, 3)
WORLD_SIZES = (2, 3)
Outcome = dict[str, list[dict[str, Any]]]  # case name -> every rank's result

# 1. Unfreezing: 2 steps per epoch, 3 epochs. BaseFinetuning unfreezes at epoch 1, the direct add_param_group at
# epoch 2, requires_grad_(True) at epoch 1. Checkpoints (2 ranks) are written at the end of epoch 1 (step 4).
EPOCHS = 3
STEPS_PER_EPOCH = 2
STEPS = EPOCHS * STEPS_PER_EPOCH
SAVE_STEP = 4
CKPT_TYPES = ("sharded", "full")
UNFREEZE_VARIANTS: dict[str, tuple[dict[str, Any], int, str]] = {  # name -> (model kwargs, epoch, Unfreeze how)
    "add_param_group": ({}, 2, "add_param_group"),
    "requires_grad": ({"optimize_backbone": True}, 1, "requires_grad"),
}

# 2. Exceptions (2 ranks): 6 steps, the failure in step 2 (0-based). A 500-byte bucket cap gives every layer's
# gradients buckets of their own, so reductions are in flight when backward fails (overlap_comm is on by default).
EXCEPTION_STEPS = 6
FAIL_AT = 2
TINY_BUCKETS = {"bucket_cap_mb": 0.0005}

# 3. Idle rank: 4 optimizer steps of 2 micro-batches; rank 1 is idle in steps 1 and 3 on one micro-batch.
IDLE_STEPS = 4

# 4. fp16 with batch norm (2 ranks): 6 steps of SGD with momentum, clipped by norm (NORM_CLIP), loss scale 2^10.
NORM_STEPS = 6
NORM_SAMPLES = 64
LOSS_SCALE = 2.0**10
INJECT_STEP = 3


# ------------------------------------------------------------------------------------------------- cases
def _case(name: str, strategy: Any, model: str, samples: int, **fields: Any) -> dict[str, Any]:
    return {"name": name, "strategy": strategy, "model": model, "samples": samples, **fields}


def _ckpt_path(directory: Path, name: str, ckpt_type: str) -> str:
    """A sharded checkpoint is a directory, a full one a file."""
    return str(directory / (f"{name}.ckpt" if ckpt_type == "full" else name))


def _unfreeze(freeze_in: str, unfreeze_at: int, how: str) -> tuple[str, dict[str, Any]]:
    return ("unfreeze", {"freeze_in": freeze_in, "unfreeze_at": unfreeze_at, "how": how})


def _unfreeze_cases(world_size: int, directory: Path) -> list[dict[str, Any]]:
    samples = STEPS_PER_EPOCH * BATCH_SIZE * world_size
    fit = {"trainer": {"max_epochs": EPOCHS, "max_steps": -1}}
    finetune = {"callbacks": [("finetune", {})], **fit}
    oracle = {"callbacks": [_unfreeze("on_fit_start", 1, "finetuning")], **fit}
    cases = [
        _case("finetune/ddp_oracle", "ddp", "finetunable", samples, **oracle),
        _case("finetune/ddp_callback", "ddp", "finetunable", samples, **finetune),
    ]
    for name, (model_kwargs, epoch, how) in UNFREEZE_VARIANTS.items():
        late = {"model_kwargs": model_kwargs, "callbacks": [_unfreeze("on_fit_start", epoch, how)], **fit}
        early = {"model_kwargs": model_kwargs, "callbacks": [_unfreeze("setup", epoch, how)], **fit}
        cases.append(_case(f"{name}/ddp_oracle", "ddp", "finetunable", samples, **late))
        cases += [_case(f"{name}/zero{stage}", stage, "finetunable", samples, **early) for stage in STAGES]
    if world_size != 2:
        return cases + [_case(f"finetune/zero{s}/sharded", s, "finetunable", samples, **finetune) for s in STAGES]
    resumes = []
    for stage in STAGES:
        for ckpt_type in CKPT_TYPES:
            typed = {"strategy_kwargs": {"state_dict_type": ckpt_type}}
            path = _ckpt_path(directory, f"finetune_zero{stage}_{ckpt_type}", ckpt_type)
            saving = {**typed, **finetune, "save_at": (SAVE_STEP, path)}
            cases.append(_case(f"finetune/zero{stage}/{ckpt_type}", stage, "finetunable", samples, **saving))
            resumes.append(
                _case(
                    f"resume/zero{stage}/{ckpt_type}",
                    stage,
                    "finetunable",
                    samples,
                    **typed,
                    **finetune,
                    ckpt_path=path,
                )
            )
            # The direct add_param_group (at epoch 2), saved after the last step.
            model_kwargs, epoch, how = UNFREEZE_VARIANTS["add_param_group"]
            path = _ckpt_path(directory, f"add_param_group_zero{stage}_{ckpt_type}", ckpt_type)
            adding = {**typed, **fit, "callbacks": [_unfreeze("setup", epoch, how)], "save_at": (STEPS, path)}
            cases.append(
                _case(f"save/add_param_group/zero{stage}/{ckpt_type}", stage, "finetunable", samples, **adding)
            )
    return cases + resumes  # a resume runs after the case that wrote its checkpoint


def _exception_cases() -> list[dict[str, Any]]:
    samples = EXCEPTION_STEPS * BATCH_SIZE * 2
    common = {"trainer": {"max_steps": EXCEPTION_STEPS}, "strategy_kwargs": TINY_BUCKETS}
    cases = [_case("exception/ddp_oracle", "ddp", "flaky", samples, **common)]
    for stage in STAGES:
        for fail in ("backward", "forward", "step"):
            failing = {"model_kwargs": {"fail": fail, "fail_at": FAIL_AT}, **common}
            cases.append(_case(f"exception/{fail}/zero{stage}", stage, "flaky", samples, **failing))
        for fail in (None, "backward"):
            bf16 = {"model_kwargs": {"fail": fail, "fail_at": FAIL_AT}, "precision": "bf16-mixed", **common}
            cases.append(_case(f"exception_bf16/{fail}/zero{stage}", stage, "flaky", samples, **bf16))
    return cases


def _idle_cases(world_size: int) -> list[dict[str, Any]]:
    samples = IDLE_STEPS * ACCUMULATE * BATCH_SIZE * world_size
    common = {"trainer": {"max_steps": IDLE_STEPS, "accumulate_grad_batches": ACCUMULATE}}
    never = {"model_kwargs": {"idle_micro": 0, "idle_steps": ()}, **common}
    cases = [_case("idle/ddp_never_idle", "ddp", "idle_rank", samples, **never)]
    for micro in (0, 1):
        oracle = {"model_kwargs": {"idle_micro": micro, "oracle": True}, **common}
        idle = {"model_kwargs": {"idle_micro": micro}, **common}
        cases.append(_case(f"idle/{micro}/ddp_oracle", "ddp", "idle_rank", samples, **oracle))
        cases += [_case(f"idle/{micro}/zero{stage}", stage, "idle_rank", samples, **idle) for stage in STAGES]
    return cases


NORM_RUNS = {  # name -> (loss scale, inject)
    "zero": (LOSS_SCALE, None),
    "scale1": (1.0, None),
    "inf_norm": (LOSS_SCALE, "norm"),
    "inf_linear": (LOSS_SCALE, "linear"),
}


def _norm_cases() -> list[dict[str, Any]]:
    def reference(name: str, scale: float, **kwargs: Any) -> dict[str, Any]:
        options = {"steps": NORM_STEPS, "samples": NORM_SAMPLES, "scale": scale, **kwargs}
        return {"name": name, "strategy": "reference", "reference": options}

    cases = [
        reference("norm/reference", LOSS_SCALE),
        reference("norm/reference_reordered", LOSS_SCALE, reversed_sum=True, flat_norm=True),
        reference("norm/reference_scale1", 1.0),
    ]
    common = {
        "precision": "16-mixed",
        "callbacks": [("steps", {})],
        "trainer": {"max_steps": NORM_STEPS, "gradient_clip_val": NORM_CLIP},
    }
    for stage in STAGES:
        for name, (scale, inject) in NORM_RUNS.items():
            run = {"init_scale": scale, "model_kwargs": {"inject": inject, "inject_step": INJECT_STEP}, **common}
            cases.append(_case(f"norm/{name}/zero{stage}", stage, "norm", NORM_SAMPLES, **run))
    return cases


def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Outcome]:
    """``outcomes(world_size)[case name]``: every rank's result, from one spawn per world size, run when first asked."""
    cache: dict[int, Outcome] = {}

    def get(world_size: int) -> Outcome:
        if world_size not in cache:
            directory = tmp_path_factory.mktemp(f"training{world_size}")
            cases = _unfreeze_cases(world_size, directory) + _idle_cases(world_size)
            if world_size == 2:
                cases += _exception_cases() + _norm_cases()
            per_rank = run_isolated(world_size, cases, str(tmp_path_factory.mktemp(f"results{world_size}")))
            cache[world_size] = {case["name"]: [results[i] for results in per_rank] for i, case in enumerate(cases)}
        return cache[world_size]

    return get


# ------------------------------------------------------------------------------------------------- checks
def assert_close(
    expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], what: str, rtol: float = RTOL
) -> None:
    """Every tensor of ``actual`` within ``rtol`` of ``expected``, relative to its largest value."""
    diffs = max_rel_diff(expected, actual)
    bad = {key: diff for key, diff in diffs.items() if not diff <= rtol}  # a NaN counts as a difference
    assert not bad, f"{what}: relative differences above {rtol:g}: {bad}"


def assert_runs_match(outcome: Outcome, oracle: str, run: str, steps: int, rtol: float = RTOL) -> None:
    """Every rank of ``run`` ends where the same rank of ``oracle`` does, after ``steps`` optimizer steps."""
    for rank, (expected, actual) in enumerate(zip(outcome[oracle], outcome[run], strict=True)):
        expected, actual = result_of(expected), result_of(actual)
        assert expected["global_step"] == steps, f"{oracle}, rank {rank}: {expected['global_step']} steps"
        assert actual["global_step"] == steps, f"{run}, rank {rank}: {actual['global_step']} steps, not {steps}"
        assert_close(expected["state"], actual["state"], f"{run} vs {oracle}, rank {rank}", rtol)
