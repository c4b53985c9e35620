"""``ModelCheckpoint``'s options with sharded checkpoints (each checkpoint a directory), and the ``ckpt_path``
names ``"last"`` and ``"best"``.

One spawn of 2 ranks runs one ``Trainer.fit`` per option set (TiedLM, 24 samples: 3 steps an epoch) and returns
what each rank saw; the tests read the directories and links on disk:

- ``link``: ``save_last="link"``, ``every_n_train_steps=1``, top 2 by ``step`` in ``mode="min"``, then a second
  fit with the same callback resumed from ``ckpt_path="last"`` (the link) for one step, not in the top 2, so
  Lightning saves ``last.ckpt`` itself over the link;
- ``top1``: ``save_last=True``, top 1 by ``step`` in ``mode="max"`` saved at each train epoch end (the older
  directory is removed), then ``validate`` from ``"best"`` and from ``"last"``;
- ``weights``: ``save_weights_only=True`` twice into one directory (the version counter names the second
  ``-v1``), then a resume from it, which must fail as Lightning's own weights-only checkpoints do.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import remove_sharded
from lightning_zero.checkpoint import saving as sharded_module
from tests.helpers import run_on_ranks
from tests.lightning.models import TiedLM, make_loader, make_trainer, result_of

WORLD_SIZE = 2
SAMPLES = 24  # 3 steps an epoch on 2 ranks


class _Validated(TiedLM):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx), sync_dist=True)


def _listing(directory: Path) -> dict[str, str]:
    """Per entry: ``"-> target"`` for a symbolic link, ``"dir"`` for a sharded checkpoint, else ``"other"``."""
    found = {}
    for entry in sorted(directory.iterdir()):
        if entry.is_symlink():
            found[entry.name] = f"-> {os.readlink(entry)}"
        else:
            found[entry.name] = "dir" if (entry / "metadata.json").is_file() else "other"
    return found


def _fit(world_size: int, callback: ModelCheckpoint, ckpt_path: str | None = None, **kwargs: Any) -> Any:
    trainer = make_trainer(world_size, ZeroStrategy(stage=3), callbacks=[callback], enable_checkpointing=True, **kwargs)
    trainer.fit(_Validated(), make_loader("tied", SAMPLES), ckpt_path=ckpt_path)
    return trainer


def _link(world_size: int, directory: Path) -> dict[str, Any]:
    def callback() -> ModelCheckpoint:
        return ModelCheckpoint(
            directory, save_last="link", every_n_train_steps=1, save_top_k=2, monitor="step", mode="min"
        )

    _fit(world_size, callback(), max_steps=3)
    first = _listing(directory)
    resumed = _fit(world_size, callback(), ckpt_path="last", max_steps=3)
    return {"first": first, "resumed_from": resumed.ckpt_path, "step": resumed.global_step}


def _top1(world_size: int, directory: Path) -> dict[str, Any]:
    callback = ModelCheckpoint(
        directory, save_last=True, save_top_k=1, monitor="step", mode="max", save_on_train_epoch_end=True
    )
    trainer = _fit(world_size, callback, max_steps=-1, max_epochs=2)
    loader = make_loader("tied", SAMPLES)
    metrics, paths = {}, {}
    for name in ("best", "last"):
        metrics[name] = trainer.validate(_Validated(), loader, ckpt_path=name)[0]["val_loss"]
        paths[name] = trainer.ckpt_path
    return {"metrics": metrics, "paths": paths, "best": callback.best_model_path}


def _weights(world_size: int, directory: Path) -> dict[str, Any]:
    for _ in range(2):
        callback = ModelCheckpoint(directory, save_weights_only=True, every_n_train_steps=2, save_top_k=-1)
        _fit(world_size, callback, max_steps=2)
    trainer = make_trainer(world_size, ZeroStrategy(stage=3))
    try:
        trainer.fit(_Validated(), make_loader("tied", SAMPLES), ckpt_path=str(directory / "epoch=0-step=2.ckpt"))
    except KeyError as error:
        return {"resume_error": str(error)}
    return {"resume_error": None}


def _option_sets(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    results = {}
    for name, run in (("link", _link), ("top1", _top1), ("weights", _weights)):
        try:
            results[name] = run(world_size, Path(directory) / name)
        except Exception:
            results[name] = {"error": f"rank {rank}, {name}:\n{traceback.format_exc()}"}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("model_checkpoint")
    per_rank = run_on_ranks(_option_sets, WORLD_SIZE, str(directory))
    return {"dir": directory, **{name: [r[name] for r in per_rank] for name in per_rank[0]}}


def _global_step(path: Path) -> int:
    return torch.load(path / "lightning.pt", weights_only=False)["global_step"]


def test_save_last_link_links_to_the_newest_directory_and_a_save_over_the_link_replaces_only_the_link(
    runs: dict[str, Any],
) -> None:
    directory = runs["dir"] / "link"
    for rank, outcome in enumerate(map(result_of, runs["link"])):
        # mode="min": steps 1 and 2 are the top 2 (step 3 is not saved); last.ckpt links to the newest saved.
        assert outcome["first"] == {
            "epoch=0-step=1.ckpt": "dir",
            "epoch=0-step=2.ckpt": "dir",
            "last.ckpt": "-> epoch=0-step=2.ckpt",
        }, f"rank {rank}"
        assert outcome["resumed_from"] == str(directory / "last.ckpt")
        assert outcome["step"] == 3, f"rank {rank}: resumed through the link at step 2, then one step"
    # Step 3 is not in the top 2, so Lightning saved last.ckpt itself: the link became a directory and the
    # checkpoint it pointed to was left as it was.
    assert _listing(directory) == {"epoch=0-step=1.ckpt": "dir", "epoch=0-step=2.ckpt": "dir", "last.ckpt": "dir"}
    assert _global_step(directory / "last.ckpt") == 3
    assert _global_step(directory / "epoch=0-step=2.ckpt") == 2


def test_top_k_removes_the_older_directory_and_best_and_last_resolve_to_directories(runs: dict[str, Any]) -> None:
    directory = runs["dir"] / "top1"
    assert _listing(directory) == {"epoch=1-step=6.ckpt": "dir", "last.ckpt": "dir"}  # epoch=0-step=3 removed
    for rank, outcome in enumerate(map(result_of, runs["top1"])):
        assert outcome["best"] == str(directory / "epoch=1-step=6.ckpt"), f"rank {rank}"
        assert outcome["paths"] == {"best": outcome["best"], "last": str(directory / "last.ckpt")}, f"rank {rank}"
        # Both hold the weights after step 6.
        assert outcome["metrics"]["best"] == pytest.approx(outcome["metrics"]["last"], rel=1e-6), f"rank {rank}"
    assert _global_step(directory / "last.ckpt") == _global_step(directory / "epoch=1-step=6.ckpt") == 6


def test_weights_only_directories_get_version_suffixes_and_refuse_to_resume(runs: dict[str, Any]) -> None:
    directory = runs["dir"] / "weights"
    assert _listing(directory) == {"epoch=0-step=2-v1.ckpt": "dir", "epoch=0-step=2.ckpt": "dir"}
    for name in ("epoch=0-step=2.ckpt", "epoch=0-step=2-v1.ckpt"):
        state = torch.load(directory / name / "lightning.pt", weights_only=False)
        assert "callbacks" not in state  # as Lightning's weights-only files
        assert json.loads((directory / name / "metadata.json").read_text())["optimizer_states"] is False
        assert not torch.load(directory / name / "rank_1.pt")["optimizers"]
    for rank, outcome in enumerate(map(result_of, runs["weights"])):
        assert "contains only the model" in (outcome["resume_error"] or ""), f"rank {rank}: {outcome}"
        assert "save_weights_only" in outcome["resume_error"]


def _checkpoint_dir(path: Path, note: str = "") -> Path:
    path.mkdir()
    (path / "metadata.json").write_text(note)
    return path


def test_removing_a_link_removes_the_link_only(tmp_path: Path) -> None:
    target = _checkpoint_dir(tmp_path / "epoch=0-step=2.ckpt")
    (tmp_path / "last.ckpt").symlink_to(target.name)
    (tmp_path / "dangling.ckpt").symlink_to("gone.ckpt")
    strategy = ZeroStrategy()  # rank 0 outside a process group
    strategy.remove_checkpoint(tmp_path / "last.ckpt")
    strategy.remove_checkpoint(tmp_path / "dangling.ckpt")
    assert _listing(tmp_path) == {target.name: "dir"}
    (tmp_path / "last.ckpt").symlink_to(target.name)
    remove_sharded(tmp_path / "last.ckpt")
    assert _listing(tmp_path) == {target.name: "dir"}
    strategy.remove_checkpoint(target)
    assert _listing(tmp_path) == {}


@pytest.mark.parametrize("link_to", ["directory", "file", "nothing"])
def test_a_commit_over_a_link_replaces_the_link_and_leaves_its_target(tmp_path: Path, link_to: str) -> None:
    target = tmp_path / "epoch=0-step=2.ckpt"
    if link_to == "directory":
        _checkpoint_dir(target, "old")
    elif link_to == "file":
        target.write_text("old")
    link = tmp_path / "last.ckpt"
    link.symlink_to(target.name)
    sharded_module._commit(_checkpoint_dir(tmp_path / "last.ckpt.tmp-0123", "new"), link, "0123")
    kept = {"directory": {target.name: "dir"}, "file": {target.name: "other"}, "nothing": {}}[link_to]
    assert _listing(tmp_path) == {**kept, "last.ckpt": "dir"}
    assert (link / "metadata.json").read_text() == "new"
    if link_to != "nothing":
        assert (target / "metadata.json" if link_to == "directory" else target).read_text() == "old"
