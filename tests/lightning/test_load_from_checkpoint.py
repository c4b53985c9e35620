"""``lightning_zero.load_from_checkpoint``: a checkpoint of any stage and world size, opened in one process.

The checkpoints are written by 2 and 3 gloo ranks (sharded directories, ``ModelCheckpoint``'s best path, ordinary
files) and opened here, in the pytest process, which has no process group.

The cases run in the spawns that several files share (tests/lightning/lifecycle_cases.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch import Tensor, nn

import lightning_zero
from tests.lightning.lifecycle_cases import HPARAMS, PRECISIONS, STAGES, assert_equal, case_results
from tests.lightning.lifecycle_models import HParamNet
from tests.lightning.models import state_of


@pytest.fixture(scope="module")
def runs(lifecycle_runs: dict[Any, Any]) -> dict[Any, Any]:
    """``runs[world_size][case key]``: every rank's result, from the spawns this file shares."""
    return lifecycle_runs


def _assert_loads(path: str, masters: dict[str, Tensor], what: str) -> None:
    assert not dist.is_initialized(), "this process must have no process group"
    model = lightning_zero.load_from_checkpoint(HParamNet, path)
    assert type(model) is HParamNet, f"{what}: {type(model)}"
    assert dict(model.hparams) == HPARAMS, f"{what}: hyper-parameters {dict(model.hparams)}"
    assert_equal(masters, state_of(model), f"{what}: weights")
    assert all(type(p) is nn.Parameter for p in model.parameters()), f"{what}: not plain nn.Parameters"


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world_size", [2, 3])
def test_load_from_checkpoint_opens_a_sharded_directory(
    runs: dict[Any, Any], world_size: int, stage: int, precision: str
) -> None:
    """One line opens a sharded checkpoint of any stage and world size in one process: the class with the saved
    hyper-parameters and the fp32 master weights (bf16-mixed too)."""
    result = case_results(runs, world_size, "save_for_inference", stage, "sharded", precision)[0]
    assert Path(result["path"]).is_dir()
    _assert_loads(result["path"], result["masters"], f"{world_size} ranks, stage {stage}, {precision}")


def test_load_from_checkpoint_opens_the_best_model_path(runs: dict[Any, Any]) -> None:
    """As a user would: ModelCheckpoint's ``best_model_path`` (a sharded directory at stage 3 on 3 ranks)."""
    result = case_results(runs, 3, "save_for_inference", 3, "sharded", "bf16-mixed", True)[0]
    assert Path(result["path"]).is_dir(), result["path"]
    assert Path(result["path"]).name.endswith("step=4.ckpt"), result["path"]
    _assert_loads(result["path"], result["masters"], "best_model_path")


@pytest.mark.parametrize("strategy", ["ddp", 2])
def test_load_from_checkpoint_opens_an_ordinary_file_like_lightning(runs: dict[Any, Any], strategy: Any) -> None:
    """An ordinary ``.ckpt`` file (DDP's, or ZeroStrategy's ``state_dict_type="full"``) loads as with Lightning."""
    result = case_results(runs, 2, "save_for_inference", strategy, "full", "32-true")[0]
    assert Path(result["path"]).is_file()
    _assert_loads(result["path"], result["masters"], f"{strategy} file")
    reference = HParamNet.load_from_checkpoint(result["path"])
    assert_equal(state_of(reference), result["masters"], "Lightning's own load_from_checkpoint")


def test_load_from_checkpoint_passes_keyword_arguments_on(runs: dict[Any, Any]) -> None:
    """Like ``MyModel.load_from_checkpoint``: ``**kwargs`` override saved hyper-parameters; ``map_location`` and
    ``strict`` are accepted."""
    result = case_results(runs, 2, "save_for_inference", 3, "sharded", "32-true")[0]
    model = lightning_zero.load_from_checkpoint(HParamNet, result["path"], map_location="cpu", strict=True, lr=0.5)
    assert model.hparams.lr == 0.5
    assert model.lr == 0.5
    assert model.hparams.hidden == HPARAMS["hidden"]
    assert_equal(result["masters"], state_of(model), "weights")


def test_sharded_checkpoint_readers_given_a_file_point_to_load_from_checkpoint(
    runs: dict[Any, Any], tmp_path: Path
) -> None:
    """``ShardedCheckpoint`` and ``consolidate`` expect a directory; given an ordinary file they say what to use."""
    path = case_results(runs, 2, "save_for_inference", "ddp", "full", "32-true")[0]["path"]
    expected = r"lightning_zero\.load_from_checkpoint|ordinary checkpoint file"
    with pytest.raises(Exception, match=expected):
        lightning_zero.checkpoint.ShardedCheckpoint(path)
    with pytest.raises(Exception, match=expected):
        lightning_zero.consolidate(path, tmp_path / "out.ckpt")
    assert not (tmp_path / "out.ckpt").exists()
