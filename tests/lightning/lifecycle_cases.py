"""The cases of the spawns that test_precision_plugin.py, test_configure_optimizers.py, test_trainer_reuse.py and
test_load_from_checkpoint.py share (the edges of a module's life around ``fit``), and the checks they have in common.

Two spawns: 2 ranks run every training case; 3 ranks save the checkpoints that a world size with padding writes
(one through ``ModelCheckpoint``). Each runs when a test first reads its world size (:func:`runs`, through the
session fixture ``lifecycle_runs`` of tests/lightning/conftest.py). The checkpoints are then opened in the pytest
process, which has no process group.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.helpers import run_on_ranks
from tests.lightning.lifecycle_models import (
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


class _Runs(dict[int, dict[tuple[Any, ...], list[dict[str, Any]]]]):
    """``runs[world_size][_key(case)]``: every rank's result; a world size's spawn runs when it is first read."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def __missing__(self, world_size: int) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
        cases = {2: _two_rank_cases, 3: _three_rank_cases}[world_size](self.directory)
        per_rank = run_on_ranks(_run_cases, world_size, cases, init_group=False)
        self[world_size] = {_key(case): [results[index] for results in per_rank] for index, case in enumerate(cases)}
        return self[world_size]


def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[tuple[Any, ...], list[dict[str, Any]]]]:
    """``[world_size][_key(case)]``: every rank's result, from one spawn per world size."""
    return _Runs(tmp_path_factory.mktemp("lifecycle"))


# ---------------------------------------------------------------------------------------------- checks
def assert_close(expected: dict[str, Tensor], actual: dict[str, Tensor], what: str) -> None:
    """Every tensor of ``actual`` within RTOL of ``expected``, relative to its largest value."""
    diffs = max_rel_diff(expected, actual)
    bad = {key: diff for key, diff in diffs.items() if not diff <= RTOL}
    assert not bad, f"{what}: relative differences {bad}"


def assert_equal(expected: dict[str, Tensor], actual: dict[str, Tensor], what: str) -> None:
    """The same keys, and every tensor equal in value and dtype."""
    assert expected.keys() == actual.keys(), f"{what}: keys {sorted(actual)} != {sorted(expected)}"
    bad = [
        key
        for key in expected
        if actual[key].dtype != expected[key].dtype or not torch.equal(actual[key], expected[key])
    ]
    assert not bad, f"{what}: tensors that differ (value or dtype): {bad}"


def case_results(runs: dict[Any, Any], world_size: int, *key: Any) -> list[dict[str, Any]]:
    """Every rank's result of the case ``key`` in the spawn of ``world_size`` ranks (``runs``: the shared spawns)."""
    return [result_of(result) for result in runs[world_size][key]]
