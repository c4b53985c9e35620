"""A rank that raises and stays alive (a notebook that catches the error, a process stuck in its teardown) ends the
other ranks within seconds with an error naming it, not after the collective timeout; the previous checkpoint stays
intact. Ranks that disagree on the stage, or a rank that fails during setup, end every rank at once too (the
options agreement is the first collective of setup: see [Note: the order of collectives]).

Each case runs in a process group of its own with a 60 s collective timeout (a failure leaves the group unusable:
the waiting ranks' collectives can never complete), so "within seconds" is measured against that timeout: the
failing rank records when it raised, the others when their error reached them (the same machine's clock).
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from tests.lightning.models import TwoLayer, make_loader, make_trainer
from tests.lightning.training_models import run_isolated

WORLD_SIZE = 2
TIMEOUT = timedelta(seconds=60)
WITHIN_S = 5.0  # the others raise within this many seconds of the failure (one notice poll is 0.2 s)


class Failing(TwoLayer):
    """TwoLayer whose rank 1 raises where ``fail_in`` says, and records when."""

    def __init__(self, fail_in: str, stage: int) -> None:
        super().__init__()
        self.fail_in = fail_in
        self.stage = stage

    def _fail(self, where: str) -> None:
        if self.fail_in == where and self.global_rank == 1:
            Path(self.trainer.default_root_dir, "failed_at").write_text(str(time.time()))
            raise ValueError(f"boom in {where}")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self._fail("configure_optimizers")
        return super().configure_optimizers()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == 2:
            self._fail("training_step")
        return super().training_step(batch, batch_idx)


class RaisingState(pl.Callback):
    """A callback whose ``state_dict`` raises on rank 1 from the second checkpoint on."""

    def __init__(self) -> None:
        self.saves = 0

    def state_dict(self) -> dict[str, Any]:
        self.saves += 1
        if self.saves >= 2 and dist.get_rank() == 1:
            Path(self._root, "failed_at").write_text(str(time.time()))
            raise ValueError("boom in a callback's state_dict")
        return {"saves": self.saves}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._root = trainer.default_root_dir


class SaveEachStep(pl.Callback):
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        trainer.save_checkpoint(str(Path(trainer.default_root_dir, f"step{trainer.global_step}")))


def _fit(world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    from lightning_zero import ZeroStrategy

    root = Path(case["root"])
    root.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank()
    stage = case["stages"][rank]
    strategy = ZeroStrategy(stage=stage, timeout=TIMEOUT)
    callbacks = [RaisingState(), SaveEachStep()] if case["fail_in"] == "state_dict" else []
    uneven = {"use_distributed_sampler": False, "max_epochs": 1, "max_steps": -1} if case.get("uneven") else {}
    options: dict[str, Any] = {"max_steps": 6, "callbacks": callbacks, "default_root_dir": str(root), **uneven}
    trainer = make_trainer(world_size, strategy, **options)
    # Uneven: each rank its own loader, rank 1's half as long (one epoch: 12 batches against 6).
    loader = make_loader("two_layer", samples=48 // (rank + 1)) if uneven else make_loader("two_layer")
    started = time.time()
    try:
        trainer.fit(Failing(case["fail_in"], stage), loader)
    except Exception as error:
        raised_at = time.time()
        if rank == 1 and case.get("linger"):
            time.sleep(case["linger"])  # alive, its process group open: nothing closes the others' connections
        return {"error": f"{type(error).__name__}: {error}", "raised_at": raised_at, "started": started}
    finished_at = time.time()
    if rank == 1 and case.get("linger"):
        time.sleep(case["linger"])  # finished, alive (a notebook): the others' connections stay open
    return {"error": None, "global_step": trainer.global_step, "finished_at": finished_at}


CASES = {
    "stage_disagreement": {"stages": (2, 3), "fail_in": None},
    # Rank 1 raises, then stays alive for 8 s (a notebook) before its group is destroyed (which would close
    # the connections and end the others' waits anyway) in the first three.
    "setup_stage3": {"stages": (3, 3), "fail_in": "configure_optimizers", "linger": 8},
    "training_step_stage3": {"stages": (3, 3), "fail_in": "training_step", "linger": 8},
    "state_dict_stage3": {"stages": (3, 3), "fail_in": "state_dict", "linger": 8},
    "training_step_stage2": {"stages": (2, 2), "fail_in": "training_step"},
    # Rank 1 runs out of batches first and its fit ends normally, then its process group (a script's end).
    "uneven_batches_stage3": {"stages": (3, 3), "fail_in": None, "uneven": True},
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("failing")
    cases = [{"name": name, "root": str(base / name), **case} for name, case in CASES.items()]
    (base / "results").mkdir()
    per_rank = run_isolated(WORLD_SIZE, cases, str(base / "results"), fit=_fit)
    return {name: ([per_rank[r][i] for r in range(WORLD_SIZE)], base / name) for i, name in enumerate(CASES)}


def test_ranks_that_disagree_on_the_stage_raise_at_setup(outcomes: dict[str, Any]) -> None:
    results, _ = outcomes["stage_disagreement"]
    for rank, result in enumerate(results):
        assert result["error"] is not None, f"rank {rank} trained"
        assert result["error"].startswith("RuntimeError: ranks disagree on the strategy's options"), result["error"]
        assert "'stage' 2" in result["error"], result["error"]
        assert "has 3" in result["error"], result["error"]
        assert result["raised_at"] - result["started"] < WITHIN_S * 3, "the disagreement took the timeout"


@pytest.mark.parametrize("case", ["setup_stage3", "training_step_stage2", "training_step_stage3", "state_dict_stage3"])
def test_a_rank_that_raises_ends_the_others_within_seconds(outcomes: dict[str, Any], case: str) -> None:
    results, root = outcomes[case]
    assert results[1]["error"].startswith("ValueError: boom in"), results[1]["error"]
    error = results[0]["error"]
    assert error is not None, "rank 0 trained on"
    assert error.startswith("RankFailedError: rank 0 stopped waiting in "), error
    assert "rank 1 raised ValueError: boom in" in error, error  # named, though it is alive or its group went
    failed_at = float((root / "failed_at").read_text())
    assert results[0]["raised_at"] - failed_at < WITHIN_S, "rank 0 waited for the timeout"


def test_a_rank_that_finished_first_ends_the_others_naming_it(outcomes: dict[str, Any]) -> None:
    """Loaders of different lengths (use_distributed_sampler=False): rank 1's fit ends normally after 6 steps, while
    rank 0 waits in its seventh step's collectives. When rank 1's group goes, rank 0 raises naming where rank 1's
    fit ended (before: a lost rank "whose process ended (a crash, a kill, ...)", with no error in rank 1's log)."""
    results, _ = outcomes["uneven_batches_stage3"]
    assert results[1]["error"] is None, results[1]["error"]
    assert results[1]["global_step"] == 6
    error = results[0]["error"]
    assert error is not None, "rank 0 trained on"
    assert error.startswith("RankFinishedError: rank 0 stopped waiting in "), error
    assert "rank 1 finished: its fit ended normally after global step 6" in error, error
    assert "use_distributed_sampler=False" in error, error
    waited = results[0]["raised_at"] - results[1]["finished_at"]
    assert waited < WITHIN_S, f"rank 0 waited {waited:.1f} s"


def test_the_previous_checkpoint_stays_intact(outcomes: dict[str, Any]) -> None:
    from lightning_zero.checkpoint import ShardedCheckpoint

    _, root = outcomes["state_dict_stage3"]
    saved = sorted(p.name for p in root.iterdir() if p.name.startswith("step"))
    assert saved == ["step1"], saved  # the second save failed on rank 1 and left nothing behind
    checkpoint = ShardedCheckpoint(root / "step1")  # checks every file's size and CRC-32
    assert checkpoint.lightning_state()["global_step"] == 1
