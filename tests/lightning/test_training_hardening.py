"""Training situations outside the happy path, through the ``Trainer`` on real gloo ranks, at stages 1-3.

1. Parameters frozen at setup and unfrozen later (Lightning's ``BaseFinetuning``, a direct ``add_param_group``, or
   ``requires_grad_(True)`` on parameters already in the optimizer) train like DDP given the same updates: a DDP run
   that froze them only after DDP wrapped the model, so that DDP reduces their gradients once they train again.
   Checkpoints written after the unfreeze resume.
2. An exception inside backward (after some bucket reductions were launched), inside a stage-3 unit's forward or
   inside ``optimizer.step()``, caught by the module and retried, leaves training as if it had not happened.
3. A rank whose backward reaches no trainable parameter (its loss is built from something else) neither hangs the
   others nor changes the maths: it counts as a zero gradient, as DDP's ``0 * out.sum()`` does.
4. fp16 with batch norm, whose fp32 parameters have no master: their gradients are unscaled like the others
   before clipping, and an inf in them on one rank makes every rank skip the step.

Each world size runs all of its cases in one spawn (see ``outcomes``), each case in a process group of its own with
a 30 s collective timeout (``training_models.TIMEOUT``), so a hang fails its own case and nothing else.
Parameters are compared with ``max |a - b| / max |a|`` per tensor, as in ``test_ddp_equivalence.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.checkpoint import ShardedCheckpoint
from tests.lightning.models import BATCH_SIZE, max_rel_diff, result_of
from tests.lightning.training_models import (
    ACCUMULATE,
    NORM_CLIP,
    Finetunable,
    NormNet,
    Unfreeze,
    run_isolated,
    trainable_names,
)

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
# Measured on 2 ranks (6 steps): the reference against itself with its clipping norm summed in another order moves
# the fp32 parameters by 7.5e-8 and the norms by 1.2e-7 (the reversed rank sum changes nothing on 2 ranks); at loss
# scale 1, where unscaling is the identity, the strategy differs from the reference by 8.4e-8 (parameters) and
# 1.3e-7 (norms). Leaving the batch-norm gradients scaled moves the parameters by 9.7 and the norms by 163x.
NORM_RTOL = 1e-5


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


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Outcome]:
    """``outcomes(world_size)[case name]``: every rank's result, from one spawn per world size."""
    cache: dict[int, Outcome] = {}

    def get(world_size: int) -> Outcome:
        if world_size not in cache:
            directory = tmp_path_factory.mktemp(f"hardening{world_size}")
            cases = _unfreeze_cases(world_size, directory) + _idle_cases(world_size)
            if world_size == 2:
                cases += _exception_cases() + _norm_cases()
            per_rank = run_isolated(world_size, cases, str(tmp_path_factory.mktemp(f"results{world_size}")))
            cache[world_size] = {case["name"]: [results[i] for results in per_rank] for i, case in enumerate(cases)}
        return cache[world_size]

    return get


# ------------------------------------------------------------------------------------------------- helpers
def _assert_close(
    expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], what: str, rtol: float = RTOL
) -> None:
    diffs = max_rel_diff(expected, actual)
    bad = {key: diff for key, diff in diffs.items() if not diff <= rtol}  # a NaN counts as a difference
    assert not bad, f"{what}: relative differences above {rtol:g}: {bad}"


def _assert_runs_match(outcome: Outcome, oracle: str, run: str, steps: int, rtol: float = RTOL) -> None:
    """Every rank of ``run`` ends where the same rank of ``oracle`` does, after ``steps`` optimizer steps."""
    for rank, (expected, actual) in enumerate(zip(outcome[oracle], outcome[run], strict=True)):
        expected, actual = result_of(expected), result_of(actual)
        assert expected["global_step"] == steps, f"{oracle}, rank {rank}: {expected['global_step']} steps"
        assert actual["global_step"] == steps, f"{run}, rank {rank}: {actual['global_step']} steps, not {steps}"
        _assert_close(expected["state"], actual["state"], f"{run} vs {oracle}, rank {rank}", rtol)


def _backbone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value for key, value in state.items() if key.startswith("backbone.")}


def _params(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = trainable_names(NormNet())
    return {name: state[name] for name in names}


# ------------------------------------------------------------------------------------------------- 1. unfreezing
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
def test_finetuning_callback_trains_like_ddp_given_the_same_updates(
    outcomes: Callable[[int], Outcome], world_size: int, stage: int
) -> None:
    """``BaseFinetuning`` (frozen in ``setup``, added at epoch 1 with ``initial_denom_lr``) equals DDP freezing the
    backbone only in ``on_fit_start``: the unfrozen backbone's gradients are averaged over the ranks."""
    outcome = outcomes(world_size)
    for ckpt_type in CKPT_TYPES if world_size == 2 else ("sharded",):
        _assert_runs_match(outcome, "finetune/ddp_oracle", f"finetune/zero{stage}/{ckpt_type}", STEPS)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_ddp_does_not_reduce_parameters_unfrozen_after_wrapping(
    outcomes: Callable[[int], Outcome], world_size: int
) -> None:
    """Why the oracle freezes late: DDP with ``BaseFinetuning`` never reduces the backbone, so its ranks drift apart,
    while the late-freezing oracle keeps them equal and does train the backbone after epoch 1."""
    outcome = outcomes(world_size)
    drifting = [result_of(result)["state"] for result in outcome["finetune/ddp_callback"]]
    apart = max_rel_diff(_backbone(drifting[0]), _backbone(drifting[1]))
    assert max(apart.values()) > 1e-3, f"DDP + BaseFinetuning kept the backbone equal on ranks 0 and 1: {apart}"
    oracle = [result_of(result)["state"] for result in outcome["finetune/ddp_oracle"]]
    for rank, state in enumerate(oracle[1:], start=1):
        assert max(max_rel_diff(oracle[0], state).values()) == 0.0, f"oracle rank {rank} differs from rank 0"
    trained = max_rel_diff(_backbone(Finetunable().state_dict()), _backbone(oracle[0]))
    assert min(trained.values()) > 1e-3, f"the oracle's backbone barely trained after the unfreeze: {trained}"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("variant", list(UNFREEZE_VARIANTS))
def test_unfreezing_without_the_callback_trains_like_ddp_given_the_same_updates(
    outcomes: Callable[[int], Outcome], world_size: int, stage: int, variant: str
) -> None:
    """``add_param_group``: the backbone, frozen in ``setup``, is unfrozen and added as a group with its own lr and
    weight decay at epoch 2. ``requires_grad``: the optimizer holds the frozen backbone from the start, and
    ``requires_grad_(True)`` at epoch 1 is all it takes, as under DDP."""
    _assert_runs_match(outcomes(world_size), f"{variant}/ddp_oracle", f"{variant}/zero{stage}", STEPS)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("ckpt_type", CKPT_TYPES)
def test_checkpoint_after_unfreezing_resumes(outcomes: Callable[[int], Outcome], stage: int, ckpt_type: str) -> None:
    """A checkpoint written at the end of epoch 1, after ``BaseFinetuning`` added the backbone's param group, resumes
    (same stage and type) to the parameters of the uninterrupted run."""
    outcome = outcomes(2)
    for saved in outcome[f"finetune/zero{stage}/{ckpt_type}"]:
        assert "error" not in saved, f"the run that saved the checkpoint failed:\n{saved['error']}"
    _assert_runs_match(outcome, f"finetune/zero{stage}/{ckpt_type}", f"resume/zero{stage}/{ckpt_type}", STEPS)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("ckpt_type", CKPT_TYPES)
def test_checkpoint_after_add_param_group_holds_the_new_group(
    outcomes: Callable[[int], Outcome], stage: int, ckpt_type: str
) -> None:
    """``trainer.save_checkpoint`` after a direct ``add_param_group`` writes the trained parameters and the optimizer's
    two param groups, the added one with its own lr and weight decay."""
    result = result_of(outcomes(2)[f"save/add_param_group/zero{stage}/{ckpt_type}"][0])
    path = result["saved"][1]
    if ckpt_type == "sharded":
        sharded = ShardedCheckpoint(path)
        saved, groups = sharded.full_state_dict(), sharded.param_groups(0)
    else:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        saved, groups = checkpoint["state_dict"], checkpoint["optimizer_states"][0]["param_groups"]
        assert len(groups[-1]["params"]) == len(list(Finetunable().backbone.parameters()))
    assert len(groups) == 2, f"{len(groups)} param groups saved"
    added = {key: groups[1][key] for key in Unfreeze.ADDED_GROUP}
    assert added == Unfreeze.ADDED_GROUP, f"the added group was saved with {added}"
    _assert_close(result["state"], saved, f"checkpoint vs the run's parameters after its last step ({ckpt_type})", 0.0)


# ------------------------------------------------------------------------------------------------- 2. exceptions
@pytest.mark.parametrize("stage", STAGES)
def test_exception_in_backward_then_retry_trains_like_ddp(outcomes: Callable[[int], Outcome], stage: int) -> None:
    """Backward raises once on every rank after ``l4``, ``l3`` and ``l2`` got their gradients (so their buckets were
    reduced or in flight); after ``zero_grad`` the same batch's backward and the later steps run as without it."""
    outcome = outcomes(2)
    _assert_runs_match(outcome, "exception/ddp_oracle", f"exception/backward/zero{stage}", EXCEPTION_STEPS)
    for rank, result in enumerate(outcome[f"exception/backward/zero{stage}"]):
        record = result_of(result)["model"]
        assert record["failures"] == [FAIL_AT], f"rank {rank}: failures caught {record['failures']}"
        arrived = {name.split(".")[0] for name in record["arrived"]}
        assert arrived == {"l2", "l3", "l4"}, f"rank {rank}: gradients arrived before the failure: {record['arrived']}"


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("fail", ["forward", "step"])
def test_exception_in_forward_or_step_then_retry_trains_like_ddp(
    outcomes: Callable[[int], Outcome], stage: int, fail: str
) -> None:
    """``forward``: ``l3`` raises inside its forward (at stage 3 a gather unit, gathered and with the next unit's
    prefetch started); forward and backward run again. ``step``: a step pre-hook raises before the update; ``step()``
    is called again. Either way the run equals DDP without the failure."""
    outcome = outcomes(2)
    _assert_runs_match(outcome, "exception/ddp_oracle", f"exception/{fail}/zero{stage}", EXCEPTION_STEPS)
    for rank, result in enumerate(outcome[f"exception/{fail}/zero{stage}"]):
        assert result_of(result)["model"]["failures"] == [FAIL_AT], f"rank {rank}: the failure did not happen once"


@pytest.mark.parametrize("stage", STAGES)
def test_exception_in_backward_then_retry_in_bf16_changes_nothing(
    outcomes: Callable[[int], Outcome], stage: int
) -> None:
    """In ``"bf16-mixed"`` the retried step gives the fp32 masters of the same run without the failure, bit for bit:
    the retry computes the same gradients and reduces them in the same order."""
    _assert_runs_match(
        outcomes(2),
        f"exception_bf16/None/zero{stage}",
        f"exception_bf16/backward/zero{stage}",
        EXCEPTION_STEPS,
        rtol=0.0,
    )


# ------------------------------------------------------------------------------------------------- 3. idle rank
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("idle_micro", [0, 1], ids=["idle_first_micro_batch", "idle_second_micro_batch"])
def test_rank_whose_loss_reaches_no_parameter_trains_like_ddp(
    outcomes: Callable[[int], Outcome], world_size: int, stage: int, idle_micro: int
) -> None:
    """Rank 1's backward on one micro-batch of steps 1 and 3 reaches no trainable parameter: no hang, and the result
    is DDP's where that loss is ``0 * out.sum()`` (a zero gradient, averaged over all ranks)."""
    _assert_runs_match(
        outcomes(world_size), f"idle/{idle_micro}/ddp_oracle", f"idle/{idle_micro}/zero{stage}", IDLE_STEPS
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_idle_steps_change_ddps_result(outcomes: Callable[[int], Outcome], world_size: int) -> None:
    """Rank 1's zero gradient in the idle micro-batches changes the averaged gradient, so matching the oracle is a
    real check of how the strategy counts a rank without gradients."""
    outcome = outcomes(world_size)
    never = result_of(outcome["idle/ddp_never_idle"][0])["state"]
    for micro in (0, 1):
        diffs = max_rel_diff(never, result_of(outcome[f"idle/{micro}/ddp_oracle"][0])["state"])
        assert max(diffs.values()) > 1e-3, f"idle micro-batch {micro} leaves DDP's parameters as they were"


# ------------------------------------------------------------------------------------------------- 4. fp16 + batch norm
def _norm_reference(outcome: Outcome, name: str = "norm/reference") -> list[dict[str, Any]]:
    return [result_of(result) for result in outcome[name]]


def test_fp16_reference_spread_is_far_below_the_tolerance(outcomes: Callable[[int], Outcome]) -> None:
    """The reference against itself with its sums in another order: what rounding alone moves (NORM_RTOL's basis)."""
    outcome = outcomes(2)
    for rank, (ref, reordered) in enumerate(
        zip(_norm_reference(outcome), _norm_reference(outcome, "norm/reference_reordered"), strict=True)
    ):
        _assert_close(ref["state"], reordered["state"], f"reference spread, rank {rank}", NORM_RTOL / 10)
        spread = max(abs(a - b) / a for a, b in zip(ref["norms"], reordered["norms"], strict=True))
        assert spread <= NORM_RTOL / 10, f"rank {rank}: the reference's norms spread by {spread:g}"


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_reference_does_the_strategys_maths_at_loss_scale_1(
    outcomes: Callable[[int], Outcome], stage: int
) -> None:
    """At loss scale 1 unscaling is the identity, so scaled and unscaled batch-norm gradients agree: there the
    strategy and the reference agree too, which shows the reference (data, fp16 copy, masters, clipping) is right."""
    outcome = outcomes(2)
    for rank, (ref, run) in enumerate(
        zip(_norm_reference(outcome, "norm/reference_scale1"), outcome[f"norm/scale1/zero{stage}"], strict=True)
    ):
        run = result_of(run)
        assert run["global_step"] == NORM_STEPS
        _assert_close(ref["state"], _params(run["state"]), f"scale 1, rank {rank}", NORM_RTOL)


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_batch_norm_trains_like_the_same_maths_reference(outcomes: Callable[[int], Outcome], stage: int) -> None:
    """At loss scale 2^10 the fp32 parameters (masters and batch norm) equal the reference's: the batch-norm
    gradients are unscaled before the global clipping norm is taken and before the update."""
    outcome = outcomes(2)
    for rank, (ref, run) in enumerate(zip(_norm_reference(outcome), outcome[f"norm/zero/zero{stage}"], strict=True)):
        run = result_of(run)
        assert run["global_step"] == NORM_STEPS
        scaler = run["callbacks"][0]["scaler"]
        assert [entry["skipped_steps"] for entry in scaler] == [0] * NORM_STEPS, f"rank {rank}: a step was skipped"
        _assert_close(ref["state"], _params(run["state"]), f"stage {stage} vs reference, rank {rank}", NORM_RTOL)


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_clipping_sees_the_unscaled_gradient_norm(outcomes: Callable[[int], Outcome], stage: int) -> None:
    """The global norm of the optimizer's gradients just before clipping (the strategy's pieces, over all ranks) is
    the reference's unscaled norm at every step, batch-norm gradients included."""
    outcome = outcomes(2)
    for rank, (ref, run) in enumerate(zip(_norm_reference(outcome), outcome[f"norm/zero/zero{stage}"], strict=True)):
        norms = result_of(run)["callbacks"][0]["norms"]
        assert len(norms) == len(ref["norms"]) == NORM_STEPS
        assert all(n > NORM_CLIP for n in ref["norms"]), "clipping should act in every step of this run"
        worst = max(abs(a - b) / a for a, b in zip(ref["norms"], norms, strict=True))
        assert worst <= NORM_RTOL, f"rank {rank}: norms {norms} vs the reference's {ref['norms']}"


@pytest.mark.parametrize("stage", STAGES)
def test_fp16_inf_in_batch_norm_gradient_on_one_rank_skips_the_step_everywhere(
    outcomes: Callable[[int], Outcome], stage: int
) -> None:
    """An inf in rank 1's batch-norm weight gradient at step 3 is handled as one in a Linear weight's: every rank
    skips step 3 and halves the scale, and both runs end with the same finite parameters, bit for bit."""
    outcome = outcomes(2)
    clean = result_of(outcome[f"norm/zero/zero{stage}"][0])["state"]
    for rank, (linear, norm) in enumerate(
        zip(outcome[f"norm/inf_linear/zero{stage}"], outcome[f"norm/inf_norm/zero{stage}"], strict=True)
    ):
        linear, norm = result_of(linear), result_of(norm)
        history = linear["callbacks"][0]["scaler"]
        skipped = [entry["skipped_steps"] for entry in history]
        assert skipped == [0] * (INJECT_STEP - 1) + [1] * (NORM_STEPS - INJECT_STEP + 1), f"rank {rank}: {history}"
        assert norm["callbacks"][0]["scaler"] == history, f"rank {rank}: loss-scale history differs from {history}"
        assert all(bool(torch.isfinite(v).all()) for v in norm["state"].values()), f"rank {rank}: inf/NaN parameters"
        _assert_close(linear["state"], norm["state"], f"inf in batch norm vs in Linear, rank {rank}", 0.0)
    skipping = max_rel_diff(_params(clean), _params(result_of(outcome[f"norm/inf_linear/zero{stage}"][0])["state"]))
    assert max(skipping.values()) > 1e-3, "skipping step 3 should change the parameters"
    assert math.isfinite(max(skipping.values()))
