"""Lightning's own launcher starts the ranks: ``Trainer(devices=2, strategy=ZeroStrategy(start_method=...))``.

No ``run_on_ranks`` here: the test process is the launcher's main process, as in a notebook or a script.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from lightning_zero import ZeroStrategy
from tests.helpers import free_port, run_on_ranks
from tests.lightning.models import RecordingTwoLayer, make_loader, make_trainer, max_rel_diff, state_of

WORLD_SIZE = 2
STEPS = 4
TIMEOUT_S = 120


@contextlib.contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    """Fail instead of hanging the whole suite if the launched ranks never finish."""

    def on_alarm(signum: int, frame: object) -> None:
        raise TimeoutError(f"the launched ranks did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _launch_fit(model: pl.LightningModule, strategy: ZeroStrategy, tmp_path: Path, **trainer_kwargs: Any) -> pl.Trainer:
    """``trainer.fit`` with Lightning's launcher starting the ranks; a hang fails, and no rank outlives the test."""
    trainer = make_trainer(WORLD_SIZE, strategy, max_steps=STEPS, default_root_dir=str(tmp_path), **trainer_kwargs)
    try:
        with _deadline(TIMEOUT_S):
            trainer.fit(model, make_loader("two_layer"))
    finally:
        for proc in getattr(strategy.launcher, "procs", []):
            if proc.is_alive():
                proc.kill()
    return trainer


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_lightning_launcher_trains_on_two_ranks(
    start_method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The launcher publishes MASTER_PORT in this process's environment; monkeypatch takes it back afterwards.
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    model = RecordingTwoLayer(str(tmp_path))
    initial = state_of(model)
    trainer = _launch_fit(model, ZeroStrategy(stage=2, start_method=start_method), tmp_path)

    assert trainer.state.fn == TrainerFn.FITTING
    assert trainer.state.status == TrainerStatus.FINISHED
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)]
    for rank, record in enumerate(ranks):
        assert record["global_rank"] == rank
        assert record["world_size"] == WORLD_SIZE
        assert record["global_step"] == STEPS
        assert max(max_rel_diff(ranks[0]["state"], record["state"]).values()) == 0.0, f"rank {rank} differs"
    # The launcher hands rank 0's trained weights back to the model in this process.
    assert max(max_rel_diff(ranks[0]["state"], state_of(model)).values()) == 0.0
    assert min(max_rel_diff(initial, state_of(model)).values()) > 1e-4, "training did not change the weights"


class RecordingMasters(RecordingTwoLayer):
    """Writes the full weights a rank holds at the end of training, gathered with the fp32 masters (stage 3 keeps
    only shards in the module, bf16-mixed only rounded parameters)."""

    def on_train_end(self) -> None:
        state = self.trainer.strategy._engine.full_state_dict(keep=True)  # collective: every rank is here
        torch.save({"state": state}, f"{self.out_dir}/rank{self.global_rank}.pt")


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_launcher_returns_the_fp32_masters_of_a_stage3_bf16_run(
    start_method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lightning's launcher sends module.state_dict() back: at stage 3 freed shards (a crash in the main process
    # before), in 16-bit runs the rounded parameters. ZeroStrategy's sends the gathered fp32 masters.
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    model = RecordingMasters(str(tmp_path))
    trainer = _launch_fit(model, ZeroStrategy(stage=3, start_method=start_method), tmp_path, precision="bf16-mixed")

    assert trainer.state.status == TrainerStatus.FINISHED
    masters = torch.load(tmp_path / "rank0.pt", weights_only=False)["state"]
    returned = state_of(model)
    assert all(value.dtype == torch.float32 for value in returned.values())
    assert max(max_rel_diff(masters, returned).values()) == 0.0
    # fp32 values that bf16 cannot hold: the masters, not the rounded parameters, came back.
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in returned.values())


def _gloo_threads() -> int:
    """Threads of this process that gloo's groups run (torch names them)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            names.append((task / "comm").read_text().strip())
    return sum(name.startswith(("pt_gloo", "gloo")) for name in names)


def _stage3_groups() -> Any:
    """The shard group's communicator and stage 3's companion group (see core/comm/topology.py), both used once."""
    from lightning_zero.core.comm import Communicator

    comm = Communicator()
    companion = comm.companion()
    comm.barrier()
    companion.barrier()
    return companion


def _wrapped_run_destroys_the_group(rank: int, world_size: int) -> dict[str, Any]:
    import queue

    import torch.distributed as dist

    from lightning_zero.launcher import ZeroMultiProcessingLauncher

    companion = _stage3_groups()
    strategy = ZeroStrategy(stage=3)
    strategy.parallel_devices = [torch.device("cpu")]
    launcher = ZeroMultiProcessingLauncher(strategy, start_method="spawn")
    before = dist.is_initialized(), _gloo_threads()
    launcher._wrapping_function(0, None, lambda: "done", (), {}, queue.Queue())
    after = dist.is_initialized(), _gloo_threads()
    try:
        companion.barrier()
        later = "the companion group still works"
    except RuntimeError as error:
        later = str(error)
    return {"before": before, "after": after, "later": later}


def test_a_rank_that_finished_destroys_its_process_groups_before_exit() -> None:
    """Lightning's spawn/fork worker returns with the gloo groups alive; a rank exiting so may abort in interpreter
    teardown ("terminate called without an active exception"). The launcher's worker destroys them first, stage 3's
    companion group too (``destroy_process_group`` alone left its threads running: the communicator held it)."""
    (result,) = run_on_ranks(_wrapped_run_destroys_the_group, 1)
    initialized, threads = result["before"]
    assert initialized
    assert threads > 0  # the check below sees gloo's threads
    assert result["after"] == (False, 0)
    assert "process groups were destroyed" in result["later"]


def _exit_hook(rank: int, world_size: int) -> dict[str, tuple[bool, int]]:
    import torch.distributed as dist

    from lightning_zero import process_exit

    _stage3_groups()
    ZeroStrategy(stage=3).on_exception(RuntimeError("a failed run"))  # as Lightning calls it
    process_exit._destroy_groups_unless_raised()
    after_exception = dist.is_initialized(), _gloo_threads()
    process_exit._Exit.raised = False  # a process that saw none
    process_exit._destroy_groups_unless_raised()
    return {"after_exception": after_exception, "after_success": (dist.is_initialized(), _gloo_threads())}


def test_the_exit_hook_destroys_the_groups_unless_the_process_saw_an_exception() -> None:
    """Ranks that run the script themselves (popen, torchrun) destroy their groups at exit after a run that ended
    well; after an exception the groups stay (another rank may still be in a collective)."""
    results = run_on_ranks(_exit_hook, WORLD_SIZE)
    for result in results:
        initialized, threads = result["after_exception"]
        assert initialized
        assert threads > 0
        assert result["after_success"] == (False, 0)


def test_popen_launched_stage3_ranks_exit_cleanly(tmp_path: Path) -> None:
    """Lightning's popen launcher: the script is rank 0 and starts itself again as rank 1. Two runs at once (more
    contention, as on a busy machine) of a stage-3 fit with collectives right before the end; every process exits
    with status 0 and none aborts in teardown (about 1 process in 10 did before the exit hook: a race, so a pass
    here is evidence, and benchmarks/clean_exits.py --start-method popen --after-fit gather measures the rate)."""
    script = Path(__file__).with_name("popen_exit.py")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("LOCAL_RANK", None)  # (set, Lightning would take this process for a rank it started)
    runs = []
    for run in range(2):
        with open(tmp_path / f"run{run}.err", "w") as err:
            command = [sys.executable, str(script)]
            env["MASTER_PORT"] = str(free_port())
            runs.append(subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=err))
    try:
        statuses = [run.wait(timeout=TIMEOUT_S) for run in runs]
    finally:
        for run in runs:
            run.kill()
    for run, status in enumerate(statuses):
        stderr = (tmp_path / f"run{run}.err").read_text()
        assert status == 0, stderr[-3000:]
        assert "rank 1 exit status 0" in stderr, stderr[-3000:]
        assert "terminate called" not in stderr, stderr[-3000:]


def _worker_raises(rank: int, world_size: int) -> Any:
    import queue
    import time

    from lightning_zero.core.comm import Communicator
    from lightning_zero.launcher import ZeroMultiProcessingLauncher

    strategy = ZeroStrategy(stage=2)
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.session.comm = Communicator()
    if rank == 1:  # its spawned worker's function raises; the process stays alive a while
        launcher = ZeroMultiProcessingLauncher(strategy, start_method="spawn")
        try:
            launcher._wrapping_function(0, None, _raise, (), {}, queue.Queue())
        except ValueError:
            time.sleep(5)
        return "raised"
    start = time.monotonic()
    try:
        strategy.session.comm.barrier()
    except RuntimeError as error:
        return type(error).__name__, str(error), time.monotonic() - start
    return "no error"


def _raise() -> None:
    raise ValueError("the worker's own failure")


def test_a_spawned_worker_that_raises_ends_the_other_ranks_waits() -> None:
    """The spawn launcher posts the failure of its worker's function (as ``on_exception`` does in the main process):
    the other ranks stop waiting within seconds, the error naming the rank and its exception."""
    waiting, raised = run_on_ranks(_worker_raises, 2, timeout_s=60)
    assert raised == "raised"
    name, message, seconds = waiting
    assert name == "RankFailedError", waiting
    assert "rank 1" in message, message
    assert "the worker's own failure" in message, message
    assert seconds < 4, seconds
