"""Small gaps: ZeroPrecision.device, a parameter in two optimizers, no optimizer, one Trainer for two models, and
opening a sharded checkpoint for inference with ``lightning_zero.load_from_checkpoint``.

Two spawns: 2 ranks run every training case; 3 ranks save the checkpoints that a world size with padding writes
(one through ``ModelCheckpoint``). The checkpoints are then opened here, in the pytest process, which has no
process group.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_zero
from tests.helpers import run_on_ranks
from tests.lightning.hardening_models import (
    HParamNet,
    NoOptimizer,
    SaveAndRecordAt,
    SharedParamManual,
    error_of,
    full_params,
    make_strategy,
    probe,
    regression_data,
    regression_loader,
)
from tests.lightning.models import BATCH_SIZE, SaveAt, make_trainer, max_rel_diff, result_of, state_of

RTOL = 1e-5
STEPS = 6
SAMPLES = 48  # 48 samples / 2 ranks / batch size 4: one epoch is STEPS optimizer steps
VAL_SAMPLES = 16  # 2 validation batches of 4 per rank
VAL_SEED = 5
SAVE_STEP = 3
CKPT_TYPES = ("sharded", "full")
STAGES = (1, 2, 3)
PRECISIONS = ("32-true", "bf16-mixed")
HPARAMS = {"hidden": 12, "lr": 0.02, "seed": 3}
NO_OPTIMIZER = [(1, "sharded"), (2, "full"), (3, "sharded"), (3, "full")]


# ---------------------------------------------------------------------------------------------- on the ranks
def _device(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    trainer = make_trainer(world_size, make_strategy(2), max_steps=1, precision=case["precision"])
    trainer.fit(HParamNet(), regression_loader(SAMPLES))
    plugin = trainer.strategy.precision_plugin
    try:
        return {"device": plugin.device, "same_plugin": plugin is trainer.precision_plugin}
    except AttributeError as error:
        return {"device_error": error_of(error)}


def _shared_param(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    stage3 = {"wrap_policy": {nn.Linear}} if case["strategy"] == 3 else {}
    trainer = make_trainer(world_size, make_strategy(case["strategy"], **stage3), max_steps=STEPS)
    model = SharedParamManual()
    trainer.fit(model, regression_loader(SAMPLES))
    with full_params(trainer):
        return {"state": state_of(model), "global_step": trainer.global_step}


def _no_optimizer(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    kwargs = {} if case["strategy"] == "ddp" else {"state_dict_type": case["ckpt"]}
    path = case["path"]
    trainer = make_trainer(world_size, make_strategy(case["strategy"], **kwargs), max_steps=2 * SAVE_STEP)
    trainer.callbacks.append(SaveAt(SAVE_STEP, path))
    model = NoOptimizer()
    trainer.fit(model, regression_loader(SAMPLES))
    resumed_trainer = make_trainer(world_size, make_strategy(case["strategy"], **kwargs), max_steps=STEPS + 2)
    resumed = NoOptimizer()
    resumed_trainer.fit(resumed, regression_loader(SAMPLES), ckpt_path=path)
    with full_params(resumed_trainer):
        state = state_of(resumed)
    return {"steps": (trainer.global_step, resumed_trainer.global_step), "state": state}


def _validate_other(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    """fit(model) saving at SAVE_STEP, then validate(other, ckpt_path=that checkpoint) on the same Trainer."""
    saver = SaveAndRecordAt(SAVE_STEP, case["path"])
    strategy = make_strategy(case["strategy"], state_dict_type=case["ckpt"])
    trainer = make_trainer(world_size, strategy, max_steps=STEPS, callbacks=[saver])
    model = HParamNet()
    trainer.fit(model, regression_loader(SAMPLES))
    with full_params(trainer):
        fitted = state_of(model)
    other = HParamNet(seed=1)
    other_initial = state_of(other)
    metrics = trainer.validate(other, regression_loader(VAL_SAMPLES, VAL_SEED), ckpt_path=case["path"], verbose=False)
    model_after = probe(lambda: state_of(model))  # at rest, outside gathered_params (stage 3: given back in full)
    with full_params(trainer):
        other_after = state_of(other)
    return {
        "saved": saver.state,
        "fitted": fitted,
        "other_initial": other_initial,
        "metrics": metrics,
        "model_after": model_after,
        "other_after": other_after,
    }


def _fit_twice(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    """fit(model_a), then fit(model_b) on the same Trainer; ``alone``: fit(model_b) on a Trainer of its own.

    A Trainer counts steps across fits, so the second fit gets STEPS more: one more epoch (SAMPLES make one epoch
    STEPS steps), which sees the batches of the first, as the loader does not shuffle.
    """
    options = {"max_steps": STEPS, "use_distributed_sampler": False}
    trainer = make_trainer(world_size, make_strategy(case["strategy"]), **options)
    model_b = HParamNet(seed=1)
    if case["alone"]:
        trainer.fit(model_b, _fixed_order_loader(rank, world_size))
        return {"b": state_of(model_b)}
    model_a = HParamNet()
    trainer.fit(model_a, _fixed_order_loader(rank, world_size))
    with full_params(trainer):
        a_fitted = state_of(model_a)
    trainer.fit_loop.epoch_loop.max_steps = 2 * STEPS
    trainer.fit(model_b, _fixed_order_loader(rank, world_size))
    with full_params(trainer):
        b = state_of(model_b)
    a_after = probe(lambda: state_of(model_a))  # at rest: the switch gave model_a its full parameters back
    return {"b": b, "a_fitted": a_fitted, "a_after": a_after, "global_step": trainer.global_step}


def _fixed_order_loader(rank: int, world_size: int) -> DataLoader:
    """This rank's part of the data, in the same order every epoch (Lightning's own sampler reshuffles)."""
    dataset = TensorDataset(*regression_data(SAMPLES))
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)


def _save_for_inference(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    """Fit HParamNet(**HPARAMS) and save it; return the weights a loaded model must have (fp32 masters)."""
    callbacks: list[pl.Callback] = []
    if case.get("model_checkpoint"):
        callbacks.append(ModelCheckpoint(case["path"], monitor="step", mode="max", every_n_train_steps=2))
    kwargs = {} if case["strategy"] == "ddp" else {"state_dict_type": case["ckpt"]}
    trainer = make_trainer(
        world_size,
        make_strategy(case["strategy"], **kwargs),
        max_steps=4,
        precision=case["precision"],
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
    )
    model = HParamNet(**HPARAMS)
    trainer.fit(model, regression_loader(SAMPLES))
    path = case["path"]
    if callbacks:
        path = trainer.checkpoint_callback.best_model_path
    else:
        trainer.save_checkpoint(path)
    engine = getattr(trainer.strategy, "_engine", None)
    masters = engine.full_state_dict(keep=True) if engine is not None else state_of(model)  # collective
    return {"path": path, "masters": {key: value.detach().clone() for key, value in masters.items()}}


RUNNERS = {
    "device": _device,
    "shared_param": _shared_param,
    "no_optimizer": _no_optimizer,
    "validate_other": _validate_other,
    "fit_twice": _fit_twice,
    "save_for_inference": _save_for_inference,
}


def _run_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for case in cases:
        try:
            results.append(RUNNERS[case["kind"]](rank, world_size, case))
        except Exception:
            results.append({"error": f"rank {rank}, case {case}:\n{traceback.format_exc()}"})
    return results


def _key(case: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(case[k] for k in ("kind", "strategy", "ckpt", "precision", "alone", "model_checkpoint") if k in case)


# ---------------------------------------------------------------------------------------------- cases
def _two_rank_cases(directory: Path) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = [{"kind": "device", "precision": precision} for precision in PRECISIONS]
    cases += [{"kind": "shared_param", "strategy": strategy} for strategy in ("ddp", *STAGES)]
    cases += [
        {
            "kind": "no_optimizer",
            "strategy": strategy,
            "ckpt": ckpt,
            "path": str(directory / f"noopt_{strategy}_{ckpt}"),
        }
        for strategy, ckpt in [("ddp", "full"), *NO_OPTIMIZER]
    ]
    cases += [
        {"kind": "validate_other", "strategy": stage, "ckpt": ckpt, "path": str(directory / f"val_{stage}_{ckpt}")}
        for stage in STAGES
        for ckpt in CKPT_TYPES
    ]
    cases += [{"kind": "fit_twice", "strategy": "ddp", "alone": True}]
    cases += [{"kind": "fit_twice", "strategy": strategy, "alone": False} for strategy in ("ddp", *STAGES)]
    cases += _inference_cases(directory, 2)
    for strategy, ckpt in (("ddp", "full"), (2, "full")):  # ordinary checkpoint files
        path = str(directory / f"ordinary_{strategy}.ckpt")
        cases.append(
            {"kind": "save_for_inference", "strategy": strategy, "ckpt": ckpt, "precision": "32-true", "path": path}
        )
    return cases


def _inference_cases(directory: Path, world_size: int) -> list[dict[str, Any]]:
    return [
        {
            "kind": "save_for_inference",
            "strategy": stage,
            "ckpt": "sharded",
            "precision": precision,
            "path": str(directory / f"infer_{world_size}_{stage}_{precision}"),
        }
        for stage in STAGES
        for precision in PRECISIONS
    ]


def _three_rank_cases(directory: Path) -> list[dict[str, Any]]:
    best = {
        "kind": "save_for_inference",
        "strategy": 3,
        "ckpt": "sharded",
        "precision": "bf16-mixed",
        "model_checkpoint": True,
        "path": str(directory / "model_checkpoint_3"),
    }
    return [*_inference_cases(directory, 3), best]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    """``runs[world_size][_key(case)]``: every rank's result."""
    directory = tmp_path_factory.mktemp("gaps")
    out: dict[Any, Any] = {"dir": directory}
    for world_size, cases in ((2, _two_rank_cases(directory)), (3, _three_rank_cases(directory))):
        per_rank = run_on_ranks(_run_cases, world_size, cases, init_group=False)
        out[world_size] = {_key(case): [results[index] for results in per_rank] for index, case in enumerate(cases)}
    return out


def _results(runs: dict[Any, Any], world_size: int, *key: Any) -> list[dict[str, Any]]:
    return [result_of(result) for result in runs[world_size][key]]


def _assert_close(expected: dict[str, Tensor], actual: dict[str, Tensor], what: str) -> None:
    diffs = max_rel_diff(expected, actual)
    bad = {key: diff for key, diff in diffs.items() if not diff <= RTOL}
    assert not bad, f"{what}: relative differences {bad}"


def _assert_equal(expected: dict[str, Tensor], actual: dict[str, Tensor], what: str) -> None:
    assert expected.keys() == actual.keys(), f"{what}: keys {sorted(actual)} != {sorted(expected)}"
    bad = [
        key
        for key in expected
        if actual[key].dtype != expected[key].dtype or not torch.equal(actual[key], expected[key])
    ]
    assert not bad, f"{what}: tensors that differ (value or dtype): {bad}"


def _probed_state(probed: dict[str, Any], what: str) -> dict[str, Tensor]:
    assert "ok" in probed, f"{what}: reading the parameters gave {probed}"
    return probed["ok"]


# ---------------------------------------------------------------------------------------------- ZeroPrecision.device
@pytest.mark.parametrize("precision", PRECISIONS)
def test_zero_precision_has_a_device_string_like_mixed_precision(runs: dict[Any, Any], precision: str) -> None:
    """Code written for Lightning's MixedPrecision reads ``trainer.precision_plugin.device`` (a string)."""
    assert isinstance(MixedPrecision("bf16-mixed", "cpu").device, str)  # what such code expects
    for rank, result in enumerate(_results(runs, 2, "device", precision)):
        assert "device_error" not in result, f"rank {rank}: {result.get('device_error')}"
        assert result["same_plugin"], f"rank {rank}: trainer.precision_plugin is not the strategy's"
        assert result["device"] == "cpu", f"rank {rank}: device {result['device']!r}"
        assert isinstance(result["device"], str), f"rank {rank}: device {result['device']!r} is not a str"


# ---------------------------------------------------------------------------------------------- shared parameter
@pytest.mark.parametrize("stage", STAGES)
def test_parameter_in_two_optimizers_trains_like_ddp(runs: dict[Any, Any], stage: int) -> None:
    """torch and DDP let one parameter be in two optimizers; each step of either moves it, as under DDP."""
    ddp = _results(runs, 2, "shared_param", "ddp")
    initial = state_of(SharedParamManual())
    assert max_rel_diff(initial, ddp[0]["state"])["shared.weight"] > 1e-3  # the shared weight trained
    for rank, (expected, actual) in enumerate(zip(ddp, _results(runs, 2, "shared_param", stage), strict=True)):
        assert actual["global_step"] == expected["global_step"], f"rank {rank}"
        _assert_close(expected["state"], actual["state"], f"rank {rank}: parameters after fit")


# ---------------------------------------------------------------------------------------------- no optimizer
@pytest.mark.parametrize(("stage", "ckpt"), NO_OPTIMIZER)
def test_no_optimizer_fits_saves_and_resumes(runs: dict[Any, Any], stage: int, ckpt: str) -> None:
    """configure_optimizers returning None: fit, a checkpoint and a resume from it run as under DDP (nothing trains,
    and there is no optimizer state to load)."""
    ddp = _results(runs, 2, "no_optimizer", "ddp", "full")
    initial = state_of(NoOptimizer())
    for rank, (expected, actual) in enumerate(zip(ddp, _results(runs, 2, "no_optimizer", stage, ckpt), strict=True)):
        assert actual["steps"] == expected["steps"], f"rank {rank}: global steps (fit, resumed fit)"
        _assert_equal(initial, actual["state"], f"rank {rank}: parameters after the resumed fit")


# ---------------------------------------------------------------------------------------------- one Trainer, two models
def _validation_loss(state: dict[str, Tensor]) -> float:
    """The validation loss of ``state`` over the whole validation set, computed here (every batch holds 4)."""
    model = HParamNet()
    model.load_state_dict(state)
    x, y = regression_data(VAL_SAMPLES, VAL_SEED)
    with torch.no_grad():
        return nn.functional.mse_loss(model(x), y).item()


@pytest.mark.parametrize("ckpt", CKPT_TYPES)
@pytest.mark.parametrize("stage", STAGES)
def test_validate_other_model_from_checkpoint_after_fit(runs: dict[Any, Any], stage: int, ckpt: str) -> None:
    """``trainer.validate(other, ckpt_path=path)`` after ``trainer.fit(model)`` validates ``other`` with the
    checkpoint's weights, and leaves ``model`` as fit left it (readable at rest, at stage 3 too)."""
    results = _results(runs, 2, "validate_other", stage, ckpt)
    expected = _validation_loss(results[0]["saved"])
    for other in (_validation_loss(results[0]["fitted"]), _validation_loss(results[0]["other_initial"])):
        assert abs(other - expected) > 1e-3 * expected, "the checkpoint's loss is not told apart from the others"
    for rank, result in enumerate(results):
        loss = result["metrics"][0]["val_loss"]
        assert abs(loss - expected) <= RTOL * expected, f"rank {rank}: val_loss {loss}, the checkpoint's {expected}"
        _assert_close(result["saved"], result["other_after"], f"rank {rank}: the validated model's weights")
        model_after = _probed_state(result["model_after"], f"rank {rank}: the fitted model after validate")
        _assert_close(result["fitted"], model_after, f"rank {rank}: the fitted model after validate")


@pytest.mark.parametrize("strategy", ["ddp", *STAGES])
def test_second_fit_on_the_same_trainer_trains_the_new_model(runs: dict[Any, Any], strategy: Any) -> None:
    """``trainer.fit(model_b)`` after ``trainer.fit(model_a)`` trains model_b as a Trainer of its own would (DDP),
    and model_a keeps the parameters its fit left, readable at rest."""
    alone = _results(runs, 2, "fit_twice", "ddp", True)
    assert max(max_rel_diff(state_of(HParamNet(seed=1)), alone[0]["b"]).values()) > 1e-3  # model_b trained
    results = _results(runs, 2, "fit_twice", strategy, False)
    for rank, (expected, result) in enumerate(zip(alone, results, strict=True)):
        assert result["global_step"] == 2 * STEPS, f"rank {rank}"
        _assert_close(expected["b"], result["b"], f"rank {rank}: model_b vs DDP fitting model_b alone")
        a_after = _probed_state(result["a_after"], f"rank {rank}: model_a after the second fit")
        _assert_close(result["a_fitted"], a_after, f"rank {rank}: model_a after the second fit")


# ---------------------------------------------------------------------------------------------- load_from_checkpoint
def _assert_loads(path: str, masters: dict[str, Tensor], what: str) -> None:
    assert not dist.is_initialized(), "this process must have no process group"
    model = lightning_zero.load_from_checkpoint(HParamNet, path)
    assert type(model) is HParamNet, f"{what}: {type(model)}"
    assert dict(model.hparams) == HPARAMS, f"{what}: hyper-parameters {dict(model.hparams)}"
    _assert_equal(masters, state_of(model), f"{what}: weights")
    assert all(type(p) is nn.Parameter for p in model.parameters()), f"{what}: not plain nn.Parameters"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world_size", [2, 3])
def test_load_from_checkpoint_opens_a_sharded_directory(
    runs: dict[Any, Any], world_size: int, stage: int, precision: str
) -> None:
    """One line opens a sharded checkpoint of any stage and world size in one process: the class with the saved
    hyper-parameters and the fp32 master weights (bf16-mixed too)."""
    result = _results(runs, world_size, "save_for_inference", stage, "sharded", precision)[0]
    assert Path(result["path"]).is_dir()
    _assert_loads(result["path"], result["masters"], f"{world_size} ranks, stage {stage}, {precision}")


def test_load_from_checkpoint_opens_the_best_model_path(runs: dict[Any, Any]) -> None:
    """As a user would: ModelCheckpoint's ``best_model_path`` (a sharded directory at stage 3 on 3 ranks)."""
    result = _results(runs, 3, "save_for_inference", 3, "sharded", "bf16-mixed", True)[0]
    assert Path(result["path"]).is_dir(), result["path"]
    assert Path(result["path"]).name.endswith("step=4.ckpt"), result["path"]
    _assert_loads(result["path"], result["masters"], "best_model_path")


@pytest.mark.parametrize("strategy", ["ddp", 2])
def test_load_from_checkpoint_opens_an_ordinary_file_like_lightning(runs: dict[Any, Any], strategy: Any) -> None:
    """An ordinary ``.ckpt`` file (DDP's, or ZeroStrategy's ``state_dict_type="full"``) loads as with Lightning."""
    result = _results(runs, 2, "save_for_inference", strategy, "full", "32-true")[0]
    assert Path(result["path"]).is_file()
    _assert_loads(result["path"], result["masters"], f"{strategy} file")
    reference = HParamNet.load_from_checkpoint(result["path"])
    _assert_equal(state_of(reference), result["masters"], "Lightning's own load_from_checkpoint")


def test_load_from_checkpoint_passes_keyword_arguments_on(runs: dict[Any, Any]) -> None:
    """Like ``MyModel.load_from_checkpoint``: ``**kwargs`` override saved hyper-parameters; ``map_location`` and
    ``strict`` are accepted."""
    result = _results(runs, 2, "save_for_inference", 3, "sharded", "32-true")[0]
    model = lightning_zero.load_from_checkpoint(HParamNet, result["path"], map_location="cpu", strict=True, lr=0.5)
    assert model.hparams.lr == 0.5
    assert model.lr == 0.5
    assert model.hparams.hidden == HPARAMS["hidden"]
    _assert_equal(result["masters"], state_of(model), "weights")


def test_sharded_checkpoint_readers_given_a_file_point_to_load_from_checkpoint(
    runs: dict[Any, Any], tmp_path: Path
) -> None:
    """``ShardedCheckpoint`` and ``consolidate`` expect a directory; given an ordinary file they say what to use."""
    path = _results(runs, 2, "save_for_inference", "ddp", "full", "32-true")[0]["path"]
    expected = r"lightning_zero\.load_from_checkpoint|ordinary checkpoint file"
    with pytest.raises(Exception, match=expected):
        lightning_zero.checkpoint.ShardedCheckpoint(path)
    with pytest.raises(Exception, match=expected):
        lightning_zero.consolidate(path, tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists()
