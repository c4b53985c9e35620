"""``on_save_checkpoint`` / ``on_load_checkpoint`` and ``checkpoint["state_dict"]`` with sharded checkpoints (see
[Note: the state_dict of sharded checkpoint hooks]).

One spawn of 2 ranks: TiedLM trains 3 steps at stage 3 and saves (its save hook records the keys it sees); then

- TiedLM resumes to step 5 (the reference), and ``Renamed`` (``up`` called ``expand``, its load hook renames the
  keys, Lightning's documented pattern) resumes to step 5 from the same directory: the same weights bit for bit
  means the renamed parameters and their optimizer state were both loaded;
- a load hook that scales one value (reassigned) and changes another in place: ``validate`` at stage 3 (sharded
  engine) and at stage 1 (no engine) loads the changed values; ``Renamed`` validates at stage 1 too, and a hook
  that clones every value (reading them all) at stage 3;
- load hooks that remove a key, or give tied keys different values: the load raises on every rank;
- save hooks that remove a key on rank 0 only, and that read a value: the save raises on every rank, nothing is
  written.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import ShardedCheckpoint
from tests.helpers import run_on_ranks
from tests.lightning.lifecycle_models import error_of
from tests.lightning.models import (
    SaveAt,
    TiedLM,
    assert_every_case_finished,
    make_loader,
    make_trainer,
    result_of,
    state_of,
)

WORLD_SIZE = 2
SAMPLES = 24
SAVE_STEP, STEPS = 3, 5


class _Validated(TiedLM):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx), sync_dist=True)


class Hooked(_Validated):
    """TiedLM whose checkpoint hooks do what ``save_hook`` / ``load_hook`` say (set after construction)."""

    def __init__(self) -> None:
        super().__init__()
        self.save_hook, self.load_hook = "record", ""
        self.seen: dict[str, Any] = {}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state_dict = checkpoint["state_dict"]
        if self.save_hook == "record":  # keys, shapes and dtypes need no values
            self.seen = {key: (tuple(value.shape), value.dtype) for key, value in state_dict.items()}
        elif self.save_hook == "drop_on_rank_0" and self.global_rank == 0:
            del state_dict["down.bias"]
        elif self.save_hook == "read":
            self.seen = {"norm": state_dict["down.weight"].norm()}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state_dict = checkpoint["state_dict"]
        if self.load_hook == "scale":
            state_dict["down.weight"] = state_dict["down.weight"] * 2  # replaced
            state_dict["up.bias"].add_(1)  # changed in place
        elif self.load_hook == "clone":  # reads every value; tied keys get equal copies
            checkpoint["state_dict"] = {key: value.clone() for key, value in state_dict.items()}
        elif self.load_hook == "drop":
            del state_dict["down.bias"]
        elif self.load_hook == "untie":
            state_dict["head.weight"] = state_dict["head.weight"] * 2


class Renamed(_Validated):
    """TiedLM with its ``up`` layer called ``expand`` (same place, same initial values); loads TiedLM's
    checkpoints by renaming the keys in ``on_load_checkpoint``."""

    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        torch.manual_seed(0)
        self.embed = nn.Embedding(self.VOCAB, 5)
        self.expand = nn.Linear(5, 9)
        self.down = nn.Linear(9, 5)
        self.head = nn.Linear(5, self.VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.lr = 1e-2
        self.param_groups = False

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.embed(tokens)
        return self.head(hidden + self.down(torch.tanh(self.expand(hidden))))

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state_dict = checkpoint["state_dict"]
        checkpoint["state_dict"] = {key.replace("up.", "expand."): value for key, value in state_dict.items()}


def _weights(trainer: pl.Trainer, model: pl.LightningModule) -> dict[str, Tensor]:
    with trainer.strategy.gathered_params():  # type: ignore[attr-defined]
        return state_of(model)


def _fit(world_size: int, model: pl.LightningModule, ckpt_path: str | None = None, **kwargs: Any) -> dict[str, Any]:
    trainer = make_trainer(world_size, ZeroStrategy(stage=3), **kwargs)
    trainer.fit(model, make_loader("tied", SAMPLES), ckpt_path=ckpt_path)
    return {"state": _weights(trainer, model), "step": trainer.global_step}


def _validated(world_size: int, model: pl.LightningModule, stage: int, ckpt_path: str) -> dict[str, Tensor]:
    trainer = make_trainer(world_size, ZeroStrategy(stage=stage))
    trainer.validate(model, make_loader("tied", SAMPLES), ckpt_path=ckpt_path)
    return _weights(trainer, model)


def _load_error(world_size: int, load_hook: str, path: str) -> dict[str, Any]:
    try:
        _validated(world_size, _loading(load_hook), 3, path)
    except Exception as error:
        return error_of(error)
    return {"type": None}


def _failed_save(world_size: int, save_hook: str, path: str) -> dict[str, Any]:
    model = Hooked()
    trainer = make_trainer(world_size, ZeroStrategy(stage=3), max_steps=1)
    trainer.fit(model, make_loader("tied", SAMPLES))
    model.save_hook = save_hook
    try:
        trainer.save_checkpoint(path)
    except Exception as error:
        return error_of(error)
    return {"type": None}


def _hook_cases(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    path = str(Path(directory) / "saved")
    results: dict[str, Any] = {}
    saver = Hooked()
    cases = {
        "saved": lambda: _fit(world_size, saver, callbacks=[SaveAt(SAVE_STEP, path)], max_steps=SAVE_STEP),
        "resumed": lambda: _fit(world_size, TiedLM(), path, max_steps=STEPS),
        "renamed": lambda: _fit(world_size, Renamed(), path, max_steps=STEPS),
        "renamed_stage1": lambda: _validated(world_size, Renamed(), 1, path),
        "scaled_stage3": lambda: _validated(world_size, _loading("scale"), 3, path),
        "scaled_stage1": lambda: _validated(world_size, _loading("scale"), 1, path),
        "cloned": lambda: _validated(world_size, _loading("clone"), 3, path),
        "dropped_on_load": lambda: _load_error(world_size, "drop", path),
        "untied_on_load": lambda: _load_error(world_size, "untie", path),
        "drop": lambda: _failed_save(world_size, "drop_on_rank_0", str(Path(directory) / "dropped")),
        "read": lambda: _failed_save(world_size, "read", str(Path(directory) / "read")),
    }
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception:
            results[name] = {"error": f"rank {rank}, {name}:\n{traceback.format_exc()}"}
    results["seen_on_save"] = saver.seen
    return results


def _loading(load_hook: str) -> Hooked:
    model = Hooked()
    model.load_hook = load_hook
    return model


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("hooks")
    per_rank = run_on_ranks(_hook_cases, WORLD_SIZE, str(directory))
    return {"dir": directory, **{name: [r[name] for r in per_rank] for name in per_rank[0]}}


def _renamed(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {key.replace("expand.", "up."): value for key, value in state.items()}


def test_every_case_finished_on_every_rank(runs: dict[str, Any]) -> None:
    """A case that raised on a rank no other test reads (the saving run's rank 1) still fails; the expected errors
    of the failing hooks are results (error_of), not errors of the case."""
    assert_every_case_finished({name: runs[name] for name in runs if name not in ("dir", "seen_on_save")})


def test_a_save_hook_sees_every_key_with_shape_and_dtype(runs: dict[str, Any]) -> None:
    result_of(runs["saved"][0])
    module = TiedLM()
    expected = {key: (tuple(value.shape), value.dtype) for key, value in module.state_dict().items()}
    for rank, seen in enumerate(runs["seen_on_save"]):
        assert seen == expected, f"rank {rank}"


def test_a_load_hook_that_renames_keys_resumes_like_the_saving_model(runs: dict[str, Any]) -> None:
    for rank, (reference, renamed) in enumerate(zip(runs["resumed"], runs["renamed"], strict=True)):
        reference, renamed = result_of(reference), result_of(renamed)
        assert renamed["step"] == reference["step"] == STEPS
        renamed_state = _renamed(renamed["state"])
        assert renamed_state.keys() == reference["state"].keys()
        for key, value in reference["state"].items():  # parameters and optimizer state followed the new names
            assert torch.equal(value, renamed_state[key]), f"rank {rank}: {key} differs"


def test_load_hooks_that_rename_or_change_values_load_what_they_left(runs: dict[str, Any]) -> None:
    saved = ShardedCheckpoint(runs["dir"] / "saved").full_state_dict()
    scaled = {**saved, "down.weight": saved["down.weight"] * 2, "up.bias": saved["up.bias"] + 1}
    cases = {"renamed_stage1": saved, "scaled_stage3": scaled, "scaled_stage1": scaled, "cloned": saved}
    for case, expected in cases.items():
        for rank, loaded in enumerate(runs[case]):
            loaded = _renamed(result_of(loaded))
            assert loaded.keys() == expected.keys()
            for key, value in expected.items():
                assert torch.equal(value, loaded[key]), f"{case}, rank {rank}: {key}"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("drop", "changed checkpoint['state_dict'] on 1 of 2 ranks (rank 0: removed 'down.bias')"),
        ("read", "checkpoint['state_dict']['down.weight'] has no values in a sharded save"),
    ],
)
def test_a_save_hook_that_changes_or_reads_the_state_dict_fails_on_every_rank(
    runs: dict[str, Any], case: str, expected: str
) -> None:
    for rank, error in enumerate(runs[case]):
        error = result_of(error)
        assert error["type"] == ("CheckpointError" if case == "drop" else "RuntimeError"), f"rank {rank}: {error}"
        assert expected in error["message"], f"rank {rank}: {error['message']}"
        assert "state_dict_type='full'" in error["message"]
    assert not list(runs["dir"].glob(f"{'dropped' if case == 'drop' else 'read'}*"))


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (
            "dropped_on_load",
            "(its state_dict as on_load_checkpoint left it) is of a different model: it has no tensor ",
        ),
        ("untied_on_load", "keys 'embed.weight' and 'head.weight' name one tensor of this model (tied), but hold "),
    ],
)
def test_a_load_hook_that_leaves_keys_this_model_cannot_load_fails_on_every_rank(
    runs: dict[str, Any], case: str, expected: str
) -> None:
    for rank, error in enumerate(runs[case]):
        error = result_of(error)
        assert error["type"] == "CheckpointError", f"rank {rank}: {error}"
        assert expected in error["message"], f"rank {rank}: {error['message']}"
