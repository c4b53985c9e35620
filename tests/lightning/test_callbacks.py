"""Lightning callbacks and hooks that read or write parameters, under ZeroStrategy stages 1-3, DDP the oracle.

Stages 1 and 2 keep full parameters, so EMAWeightAveraging, StochasticWeightAveraging, ModelPruning, a tied-weight
check in ``on_fit_start`` and a ``clone()`` of a weight around each step give DDP's results (rel 1e-5). Stage 3
keeps only shards between steps, and each of these reads parameter values there (read in lightning/pytorch/callbacks/):

- ``WeightAveraging`` deep-copies the module in ``setup``, before the strategy shards it, but its
  ``on_train_batch_end`` reads the module's parameters (``AveragedModel.update_parameters``);
- ``StochasticWeightAveraging`` also deep-copies in ``setup``; ``on_train_epoch_start`` of the first SWA epoch reads
  the parameters (``update_parameters``);
- ``ModelPruning`` computes its masks from the parameters in ``on_train_epoch_end`` (and by default, the lottery
  ticket, then sets each pruned parameter's ``.data`` to its values at ``setup``);
- ``BeforeAfter.on_train_batch_start`` clones ``b.weight`` before the step's forward.

So at stage 3 ``trainer.fit`` must raise, on every rank: before the first step for Lightning's three (a
``ValueError`` naming the callback: SWA would otherwise fail only at its ``swa_epoch_start``, after epochs of
training), and for a callback of the user's a ``RuntimeError`` that points to ``gathered_params``. The one
exception is ``TiedCheck.on_fit_start``, which compares the tied weights with ``torch.equal``: they are one
parameter, and a tensor equals itself without its values being read (see [Note: stage-3 parameters at rest]),
so it records what DDP records.

A bf16-mixed run keeps fp32 masters: SWA writing the averaged weights into the bf16 parameters at train end must
reach the masters, i.e. a checkpoint saved after fit (full and sharded) holds the averaged weights.

Two spawns of 2 ranks: DDP and stages 1-2 first, stage 3 alone (a crash there loses only the stage-3 results).
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelPruning, StochasticWeightAveraging
from torch import Tensor

from lightning_zero import consolidate
from tests.helpers import run_on_ranks
from tests.lightning.lifecycle_models import (
    BeforeAfter,
    MaskRecording,
    RecordBeforeTrainEnd,
    TiedCheck,
    error_of,
    full_params,
    make_strategy,
    regression_loader,
    tokens_loader,
)
from tests.lightning.models import (
    TwoLayer,
    assert_every_case_finished,
    make_trainer,
    max_rel_diff,
    result_of,
    state_of,
)

WORLD_SIZE = 2
RTOL = 1e-5
SAMPLES = 16  # 16 samples / 2 ranks / batch size 4: 2 optimizer steps per epoch
SWA = {"swa_lrs": 0.05, "swa_epoch_start": 2, "annealing_epochs": 1}  # averages at the start of epochs 1, 2, 3
# name -> (model, Trainer kwargs): every run is a few epochs of the same 16 samples.
SETUPS: dict[str, tuple[str, dict[str, Any]]] = {
    "plain": ("two_layer", {"max_steps": -1, "max_epochs": 4}),  # no callback: what averaging must change
    "ema": ("two_layer", {"max_steps": -1, "max_epochs": 3}),
    "swa": ("two_layer", {"max_steps": -1, "max_epochs": 4}),
    "pruning": ("mask_recording", {"max_steps": -1, "max_epochs": 3}),
    "pruning_no_lottery_ticket": ("mask_recording", {"max_steps": -1, "max_epochs": 3}),
    "pruning_aliased": ("mask_recording", {"max_steps": -1, "max_epochs": 3}),
    "tied_check": ("tied_check", {"max_steps": 6}),
    "before_after": ("before_after", {"max_steps": 6}),
}
CALLBACKS = [name for name in SETUPS if name not in ("plain", "pruning_aliased")]
PRUNINGS = ["pruning", "pruning_no_lottery_ticket"]
STRATEGIES = ("ddp", 1, 2)
CKPT_TYPES = ("full", "sharded")


class CopyingTicketPruning(ModelPruning):
    """ModelPruning whose lottery-ticket reset copies the initial values into each parameter.

    Lightning's own reset sets ``param.data = initial.data``: the parameter then shares its storage with the
    saved initial values, so training overwrites them and the next reset restores trained values, not the
    initial ones (checked below). A ZeRO parameter is a view of its flat buffer and cannot share another tensor's
    storage: lightning_zero takes the new values into the buffer at the next step, so under ZeroStrategy every
    reset restores the initial values. This is the DDP run that does the same."""

    @staticmethod
    def _copy_param(new: torch.nn.Module, old: torch.nn.Module, name: str) -> None:
        dst = getattr(new, name + "_orig") if hasattr(new, name + "_orig") else getattr(new, name)
        src = getattr(old, name)
        if isinstance(dst, Tensor) and isinstance(src, Tensor):
            dst.data = src.data.clone()


def _callbacks(name: str, strategy: Any = None) -> list[pl.Callback]:
    if name == "pruning" and strategy == "ddp":  # the oracle of Lightning's ModelPruning under ZeroStrategy
        return [CopyingTicketPruning("l1_unstructured", amount=0.5)]
    if name == "pruning_aliased":  # Lightning's own, under DDP: shows what the oracle changes
        return [ModelPruning("l1_unstructured", amount=0.5)]
    if name == "ema":
        return [EMAWeightAveraging(decay=0.7)]
    if name == "swa":
        return [StochasticWeightAveraging(**SWA)]
    if name == "pruning":  # by default also resets the kept weights to their initial values: `param.data = ...`
        return [ModelPruning("l1_unstructured", amount=0.5)]
    if name == "pruning_no_lottery_ticket":  # masks only
        return [ModelPruning("l1_unstructured", amount=0.5, use_lottery_ticket_hypothesis=False)]
    return []


def _model(kind: str) -> pl.LightningModule:
    return {
        "two_layer": TwoLayer,
        "mask_recording": MaskRecording,
        "tied_check": TiedCheck,
        "before_after": BeforeAfter,
    }[kind]()


def _fit(world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank: its parameters after fit, the averaged model's, the model's record, or the error."""
    kind, trainer_kwargs = SETUPS[case["name"]]
    callbacks = _callbacks(case["name"], case["strategy"])
    before_end = RecordBeforeTrainEnd()
    strategy = make_strategy(case["strategy"], **case.get("strategy_kwargs", {}))
    precision = case.get("precision", "32-true")
    trainer = make_trainer(
        world_size, strategy, callbacks=[before_end, *callbacks], precision=precision, **trainer_kwargs
    )
    model = _model(kind)
    loader = tokens_loader(SAMPLES) if kind == "tied_check" else regression_loader(SAMPLES)
    try:
        trainer.fit(model, loader)
    except Exception as error:
        return {"fit_error": error_of(error), "traceback": traceback.format_exc(), "global_step": trainer.global_step}
    with full_params(trainer):
        state = state_of(model)
    averaged = None
    if callbacks and case["name"] in ("ema", "swa"):
        average = callbacks[0]._average_model
        averaged = state_of(average.module if case["name"] == "ema" else average)
    if case.get("save"):
        trainer.save_checkpoint(case["save"])
    return {
        "state": state,
        "averaged": averaged,
        "before_train_end": before_end.state,
        "record": getattr(model, "record", None),
        "global_step": trainer.global_step,
    }


def _run_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for case in cases:
        try:
            results.append(_fit(world_size, case))
        except Exception:
            results.append({"error": f"rank {rank}, case {case}:\n{traceback.format_exc()}"})
    return results


def _checkpoint_cases(directory: Path) -> list[dict[str, Any]]:
    return [
        {
            "name": "swa",
            "strategy": 2,
            "precision": "bf16-mixed",
            "strategy_kwargs": {"state_dict_type": kind},
            "save": str(directory / f"swa_bf16_{kind}{'.ckpt' if kind == 'full' else ''}"),
        }
        for kind in CKPT_TYPES
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("callbacks")
    cases = [{"name": name, "strategy": strategy} for name in CALLBACKS for strategy in STRATEGIES]
    cases = [
        {"name": "plain", "strategy": "ddp"},
        {"name": "pruning_aliased", "strategy": "ddp"},
        *cases,
        *_checkpoint_cases(directory),
    ]
    per_rank = run_on_ranks(_run_cases, WORLD_SIZE, cases, init_group=False)
    out: dict[Any, Any] = {"dir": directory}
    for index, case in enumerate(cases):
        key = ("bf16_checkpoint", case["strategy_kwargs"]["state_dict_type"]) if "save" in case else None
        out[key or (case["name"], case["strategy"])] = [results[index] for results in per_rank]
    out["save_paths"] = {case["strategy_kwargs"]["state_dict_type"]: case["save"] for case in cases if "save" in case}
    return out


@pytest.fixture(scope="module")
def stage3_runs() -> dict[str, list[dict[str, Any]]]:
    cases = [{"name": name, "strategy": 3} for name in CALLBACKS]
    per_rank = run_on_ranks(_run_cases, WORLD_SIZE, cases, init_group=False)
    return {case["name"]: [results[index] for results in per_rank] for index, case in enumerate(cases)}


def _assert_close(expected: dict[str, Tensor], actual: dict[str, Tensor], what: str) -> None:
    diffs = max_rel_diff(expected, actual)
    bad = {key: diff for key, diff in diffs.items() if not diff <= RTOL}
    assert not bad, f"{what}: relative differences {bad}"


def _trained(result: dict[str, Any], what: str) -> dict[str, Any]:
    result = result_of(result)
    if "fit_error" in result:
        pytest.fail(f"{what}: fit raised {result['fit_error']}\n{result['traceback']}", pytrace=False)
    return result


def _pairs(runs: dict[str, Any], name: str, stage: int) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    ddp = [_trained(r, f"{name}, DDP") for r in runs[(name, "ddp")]]
    zero = [_trained(r, f"{name}, stage {stage}") for r in runs[(name, stage)]]
    return list(zip(ddp, zero, strict=True))


def test_every_case_finished_on_every_rank(runs: dict[str, Any]) -> None:
    """Every case of the first spawn trains on every rank, also those whose other ranks no test reads (the plain and
    aliased-pruning DDP runs beyond rank 0). The stage-3 spawn's fit errors are its expected outcome."""
    cases = {key: per_rank for key, per_rank in runs.items() if key not in ("dir", "save_paths")}
    assert_every_case_finished(cases)
    for key, per_rank in cases.items():
        for rank, result in enumerate(per_rank):
            if "fit_error" in result:
                pytest.fail(f"case {key}, rank {rank}: fit raised\n{result['traceback']}", pytrace=False)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", CALLBACKS)
def test_stages_1_2_train_with_the_callback_like_ddp(runs: dict[str, Any], name: str, stage: int) -> None:
    """The parameters after fit equal DDP's, and so does what the model recorded (tied check, weight changes)."""
    for rank, (expected, actual) in enumerate(_pairs(runs, name, stage)):
        assert actual["global_step"] == expected["global_step"], f"rank {rank}"
        _assert_close(expected["state"], actual["state"], f"rank {rank}: parameters after fit")
        if name in ("tied_check", "before_after"):
            assert actual["record"] == expected["record"], f"rank {rank}: what the model recorded"


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", ["ema", "swa"])
def test_stages_1_2_average_like_ddp(runs: dict[str, Any], name: str, stage: int) -> None:
    """The averaged model equals DDP's, and fit ends with the module holding it (both callbacks copy it back)."""
    for rank, (expected, actual) in enumerate(_pairs(runs, name, stage)):
        _assert_close(expected["averaged"], actual["averaged"], f"rank {rank}: averaged model")
        _assert_close(actual["averaged"], actual["state"], f"rank {rank}: module after fit vs the averaged model")


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", PRUNINGS)
def test_stages_1_2_prune_like_ddp(runs: dict[str, Any], name: str, stage: int) -> None:
    """The masks of every epoch equal DDP's, and the weights after fit are pruned alike (zeros where DDP's are).

    With the lottery ticket (ModelPruning's default) the callback sets ``param.data`` to the initial values after
    each pruning; training must go on from there, as it does under DDP with the reset copying the values (see
    :class:`CopyingTicketPruning`)."""
    for rank, (expected, actual) in enumerate(_pairs(runs, name, stage)):
        assert len(actual["record"]) == len(expected["record"]) == SETUPS[name][1]["max_epochs"]
        for epoch, (want, got) in enumerate(zip(expected["record"], actual["record"], strict=True)):
            assert want.keys() == got.keys(), f"rank {rank}, epoch {epoch}: mask names {sorted(got)}"
            for key in want:
                assert torch.equal(want[key], got[key]), f"rank {rank}, epoch {epoch}: mask {key}"
        for key, value in expected["state"].items():
            assert torch.equal(value == 0, actual["state"][key] == 0), f"rank {rank}: pruned entries of {key}"


def test_the_oracles_exercise_the_callbacks(runs: dict[str, Any]) -> None:
    """Under DDP the callbacks do what is compared: averaging moves the weights, pruning zeroes half, the weights
    are tied and change every step. Otherwise agreeing with DDP would say little."""
    plain = _trained(runs[("plain", "ddp")][0], "plain, DDP")["state"]
    for name in ("ema", "swa"):
        result = _trained(runs[(name, "ddp")][0], f"{name}, DDP")
        moved = max_rel_diff(result["before_train_end"], result["averaged"])
        assert max(moved.values()) > 1e-2, f"{name}: the average is the last weights: {moved}"
    swa = _trained(runs[("swa", "ddp")][0], "swa, DDP")
    assert max(max_rel_diff(plain, swa["before_train_end"]).values()) > 1e-3, "SWALR did not change the training"
    for name in PRUNINGS:
        masks = _trained(runs[(name, "ddp")][0], f"{name}, DDP")["record"][-1]
        kept = sum(int(mask.sum()) for mask in masks.values()) / sum(mask.numel() for mask in masks.values())
        assert 0.05 < kept < 0.3, f"{name}: three prunings of 50% should keep about 12.5%, kept {kept:.1%}"
    lottery, masks_only = (_trained(runs[(n, "ddp")][0], n)["state"] for n in PRUNINGS)
    assert max(max_rel_diff(lottery, masks_only).values()) > 1e-2, "the lottery ticket reset changed nothing"
    aliased = _trained(runs[("pruning_aliased", "ddp")][0], "Lightning's ModelPruning, DDP")["state"]
    assert max(max_rel_diff(lottery, aliased).values()) > 1e-2, "Lightning's reset restores the initial values"
    assert _trained(runs[("tied_check", "ddp")][0], "tied_check, DDP")["record"] == [True, True]
    changed = _trained(runs[("before_after", "ddp")][0], "before_after, DDP")["record"]
    assert changed == [True] * SETUPS["before_after"][1]["max_steps"], changed


READING_AT_REST = [name for name in CALLBACKS if name != "tied_check"]
LIGHTNINGS = {  # Lightning's callbacks that read and replace parameters between steps: refused at setup
    "ema": "EMAWeightAveraging",
    "swa": "StochasticWeightAveraging",
    "pruning": "ModelPruning",
    "pruning_no_lottery_ticket": "ModelPruning",
}


def test_stage3_tied_check_compares_one_parameter_with_itself(
    runs: dict[str, Any], stage3_runs: dict[str, list[dict[str, Any]]]
) -> None:
    ddp = _trained(runs[("tied_check", "ddp")][0], "tied_check, DDP")["record"]
    for rank, result in enumerate(stage3_runs["tied_check"]):
        assert _trained(result, "tied_check, stage 3")["record"] == ddp == [True, True], f"rank {rank}"


@pytest.mark.parametrize("name", READING_AT_REST)
def test_stage3_callback_reading_parameters_at_rest_fails_clearly(
    stage3_runs: dict[str, list[dict[str, Any]]], name: str
) -> None:
    """At stage 3 the callback reads parameters that hold no values: fit raises the same error on every rank (no
    segfault, no hang, no silently wrong values): Lightning's callbacks are refused before the first step, naming
    the callback and the stages that run it; a callback of the user's raises a RuntimeError pointing to
    gathered_params where it reads."""
    for rank, result in enumerate(stage3_runs[name]):
        result = result_of(result)
        assert "fit_error" in result, f"rank {rank}: fit should raise, but it ended at step {result['global_step']}"
        error, message = result["fit_error"], result["fit_error"]["message"]
        if name in LIGHTNINGS:
            assert error["type"] == "ValueError", f"rank {rank}: {error}\n{result['traceback']}"
            assert result["global_step"] == 0, f"rank {rank}: refused after {result['global_step']} steps"
            assert LIGHTNINGS[name] in message, f"rank {rank}: {message}"
            assert "stage 1 or 2" in message, f"rank {rank}: {message}"
        else:
            assert error["runtime_error"], f"rank {rank}: expected a RuntimeError, got {error}\n{result['traceback']}"
            assert "gathered_params" in message, f"rank {rank}: {message}"


@pytest.mark.parametrize("kind", CKPT_TYPES)
def test_bf16_checkpoint_after_fit_holds_the_averaged_weights(runs: dict[str, Any], kind: str) -> None:
    """bf16-mixed at stage 2: SWA writes the averaged weights into the bf16 parameters at train end; a checkpoint
    saved after fit holds them (the fp32 masters took them), not the weights of the last step."""
    results = [_trained(r, f"swa bf16-mixed, {kind}") for r in runs[("bf16_checkpoint", kind)]]
    module = results[0]["state"]
    for rank, result in enumerate(results):
        assert all(value.dtype == torch.bfloat16 for value in result["state"].values()), f"rank {rank}"
        moved = [k for k in module if not torch.equal(result["before_train_end"][k], result["state"][k])]
        assert moved, f"rank {rank}: SWA left the parameters as they were"
        rounded = {key: value.to(torch.bfloat16) for key, value in result["averaged"].items()}
        assert all(torch.equal(rounded[k], result["state"][k]) for k in module), f"rank {rank}: module != average"
    path = Path(runs["save_paths"][kind])
    if kind == "sharded":
        assert path.is_dir()
        consolidate(path, path.with_name(path.name + ".ckpt"))
        path = path.with_name(path.name + ".ckpt")
    saved = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    assert saved.keys() == module.keys()
    stale = [key for key in module if not torch.equal(saved[key].to(torch.bfloat16), module[key])]
    assert not stale, f"saved weights that are not the averaged ones the module holds: {stale}"
