"""Offload through Lightning: ``ZeroStrategy(offload_optimizer="cpu"|"nvme", offload_params="cpu")`` trains like
DDP, its checkpoints resume without offload at another world size and stage (and the reverse), it leaves nothing
in ``nvme_path`` (after fit, after an exception, after SIGKILL), and bad set-ups fail on every rank at setup.

Three spawns: 2 ranks train every mode against DDP and save stage-3 checkpoints with and without NVMe offload;
3 ranks resume both without offload at stage 1 and save a stage-1 checkpoint; 2 ranks resume that with NVMe
offload at stage 3 and without. 24 samples of batch 4 end an epoch at step 6 on 2 and 3 ranks (see SaveAt).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero.core.store import checks
from tests.helpers import run_on_ranks
from tests.lightning.models import (
    TiedLM,
    assert_every_case_finished,
    fit_cases,
    make_loader,
    make_trainer,
    max_rel_diff,
    result_of,
)

RTOL = 1e-5
SAVE_STEP, STEPS = 6, 9
TRAIN: dict[str, Any] = {
    "model": "tied",
    "model_kwargs": {"param_groups": True},
    "trainer": {"max_steps": 6, "accumulate_grad_batches": 2, "gradient_clip_val": 0.5},
}
SAVE: dict[str, Any] = {"model": "tied", "model_kwargs": {"param_groups": True}, "samples": 24}
MODES = {
    "cpu": {"offload_optimizer": "cpu"},
    "nvme": {"offload_optimizer": "nvme"},
    "cpu+params": {"offload_optimizer": "cpu", "offload_params": "cpu"},
    "nvme+nvmeparams": {"offload_optimizer": "nvme", "offload_params": "nvme"},
}
TRAINED = [(stage, mode) for stage in (1, 2, 3) for mode in MODES if stage == 3 or "params" not in mode]


def _kwargs(mode: str | None, nvme: Path) -> dict[str, Any]:
    if mode is None:
        return {"state_dict_type": "sharded"}
    kwargs = dict(MODES[mode], state_dict_type="sharded")
    if "nvme" in (kwargs["offload_optimizer"], kwargs.get("offload_params")):
        kwargs["nvme_path"] = str(nvme)
    return kwargs


def _save_case(stage: int, mode: str | None, path: Path, nvme: Path) -> dict[str, Any]:
    trainer = {"max_steps": STEPS}
    return {
        **SAVE,
        "strategy": stage,
        "strategy_kwargs": _kwargs(mode, nvme),
        "trainer": trainer,
        "save_at": (SAVE_STEP, str(path)),
    }


def _resume_case(stage: int, mode: str | None, path: Path, nvme: Path) -> dict[str, Any]:
    trainer = {"max_steps": STEPS}
    return {
        **SAVE,
        "strategy": stage,
        "strategy_kwargs": _kwargs(mode, nvme),
        "trainer": trainer,
        "ckpt_path": str(path),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("offload")
    nvme = root / "nvme"
    nvme.mkdir()
    trained = [{**TRAIN, "strategy": "ddp"}] + [
        {**TRAIN, "strategy": stage, "strategy_kwargs": _kwargs(mode, nvme)} for stage, mode in TRAINED
    ]
    saves = [_save_case(3, "nvme", root / "z3_nvme", nvme), _save_case(3, None, root / "z3", nvme)]
    first = run_on_ranks(fit_cases, 2, trained + saves)
    after_first = sorted(os.listdir(nvme))
    resumes_on_3 = [
        _resume_case(1, None, root / "z3_nvme", nvme),
        _resume_case(1, None, root / "z3", nvme),
        _save_case(1, None, root / "z1_3", nvme),
    ]
    second = run_on_ranks(fit_cases, 3, resumes_on_3)
    resumes_on_2 = [
        _resume_case(3, "nvme", root / "z1_3", nvme),
        _resume_case(3, None, root / "z1_3", nvme),
        _resume_case(3, "nvme", root / "z3_nvme", nvme),
    ]
    third = run_on_ranks(fit_cases, 2, resumes_on_2)
    return {
        "root": root,
        "trained": {key: [r[i] for r in first] for i, key in enumerate(["ddp", *TRAINED])},
        "saved": {"z3_nvme": [r[-2] for r in first], "z3": [r[-1] for r in first]},
        "on_3": [list(r) for r in zip(*second, strict=True)],
        "on_2": [list(r) for r in zip(*third, strict=True)],
        "nvme_entries": (after_first, sorted(os.listdir(nvme))),
    }


def _assert_close(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], what: str) -> None:
    bad = {key: diff for key, diff in max_rel_diff(expected, actual).items() if not diff <= RTOL}
    assert not bad, f"{what}: relative differences {bad}"


def test_every_case_finished_on_every_rank(runs: dict[str, Any]) -> None:
    """Also the cases no other test reads: the 3-rank stage-1 run that writes the checkpoint resumed on 2 ranks."""
    cases = {("trained", key): per_rank for key, per_rank in runs["trained"].items()}
    cases.update({("saved", name): per_rank for name, per_rank in runs["saved"].items()})
    cases.update({(spawn, i): per_rank for spawn in ("on_3", "on_2") for i, per_rank in enumerate(runs[spawn])})
    assert_every_case_finished(cases)


@pytest.mark.parametrize(("stage", "mode"), TRAINED)
def test_offload_trains_like_ddp_with_accumulation_and_clipping(runs: dict[str, Any], stage: int, mode: str) -> None:
    for rank, (ddp, zero) in enumerate(zip(runs["trained"]["ddp"], runs["trained"][(stage, mode)], strict=True)):
        _assert_close(result_of(ddp)["state"], result_of(zero)["state"], f"rank {rank}, stage {stage}, {mode}")


def test_nvme_offload_saves_what_the_run_without_offload_saves(runs: dict[str, Any]) -> None:
    for rank, (nvme, plain) in enumerate(zip(runs["saved"]["z3_nvme"], runs["saved"]["z3"], strict=True)):
        _assert_close(result_of(plain)["state"], result_of(nvme)["state"], f"rank {rank}: uninterrupted runs")
    files = {p.name for p in (runs["root"] / "z3_nvme").iterdir()}
    assert files == {"metadata.json", "lightning.pt", "rank_0.pt", "rank_1.pt"}


def test_nvme_checkpoint_resumes_without_offload_at_another_world_size_and_stage(runs: dict[str, Any]) -> None:
    """Saved with NVMe offload on 2 ranks at stage 3, resumed on 3 ranks at stage 1 without it: the same as
    resuming the checkpoint the run without offload wrote."""
    from_nvme, from_plain = runs["on_3"][0], runs["on_3"][1]
    for rank, (a, b) in enumerate(zip(from_plain, from_nvme, strict=True)):
        assert result_of(a)["global_step"] == result_of(b)["global_step"] == STEPS
        _assert_close(result_of(a)["state"], result_of(b)["state"], f"rank {rank} of 3")


def test_checkpoint_without_offload_resumes_with_nvme_offload_at_stage3(runs: dict[str, Any]) -> None:
    with_nvme, without = runs["on_2"][0], runs["on_2"][1]
    for rank, (a, b) in enumerate(zip(without, with_nvme, strict=True)):
        assert result_of(a)["global_step"] == result_of(b)["global_step"] == STEPS
        _assert_close(result_of(a)["state"], result_of(b)["state"], f"rank {rank} of 2")


def test_same_world_size_stage_and_offload_resume_bit_exactly(runs: dict[str, Any]) -> None:
    resumed, uninterrupted = runs["on_2"][2], runs["saved"]["z3_nvme"]
    for rank, (a, b) in enumerate(zip(uninterrupted, resumed, strict=True)):
        for key, value in result_of(a)["state"].items():
            assert torch.equal(value, result_of(b)["state"][key]), f"rank {rank}: {key} differs after resuming"


def test_consolidate_reads_an_nvme_offloaded_checkpoint(runs: dict[str, Any]) -> None:
    from lightning_zero.checkpoint import consolidate

    for name in ("z3_nvme", "z3"):
        consolidate(runs["root"] / name, runs["root"] / f"{name}.ckpt")
    nvme = torch.load(runs["root"] / "z3_nvme.ckpt", weights_only=False)
    plain = torch.load(runs["root"] / "z3.ckpt", weights_only=False)
    _assert_close(plain["state_dict"], nvme["state_dict"], "consolidated weights")
    for index, state in plain["optimizer_states"][0]["state"].items():
        _assert_close(state, nvme["optimizer_states"][0]["state"][index], f"optimizer state of param {index}")


def test_nvme_path_is_empty_after_every_run(runs: dict[str, Any]) -> None:
    assert runs["nvme_entries"] == ([], [])


# ---------------------------------------------------------------------------------------------- hygiene and errors
class _RaisesAtStep3(TiedLM):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == 3:
            raise RuntimeError("boom at step 3")
        return super().training_step(batch, batch_idx)


def _fit_that_raises(rank: int, world_size: int, nvme: str) -> str:
    from lightning_zero import ZeroStrategy

    trainer = make_trainer(world_size, ZeroStrategy(stage=3, offload_optimizer="nvme", nvme_path=nvme))
    try:
        trainer.fit(_RaisesAtStep3(), make_loader("tied", 24))
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_nvme_path_is_empty_after_an_exception(tmp_path: Path) -> None:
    assert run_on_ranks(_fit_that_raises, 2, str(tmp_path)) == ["boom at step 3"] * 2
    assert os.listdir(tmp_path) == []


KILLED_MID_FIT = textwrap.dedent(
    """
    import os, signal, sys
    import lightning.pytorch as pl
    from lightning_zero import ZeroStrategy
    from tests.lightning.models import TiedLM, make_loader, make_trainer

    class Kill(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                print("swap bytes", trainer.strategy._engine.io_counts.written, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    strategy = ZeroStrategy(stage=2, offload_optimizer="nvme", nvme_path=sys.argv[1])
    make_trainer(1, strategy, callbacks=[Kill()]).fit(TiedLM(), make_loader("tied", 24))
    """
)


def test_nvme_path_is_empty_after_sigkill(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", KILLED_MID_FIT, str(tmp_path)], cwd=repo, capture_output=True, text=True, check=False
    )
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert "swap bytes" in run.stdout
    assert int(run.stdout.split()[-1]) > 0  # the file was in use when killed
    assert os.listdir(tmp_path) == []


def _engine_with(rank: int, world_size: int, target: str, paths: list[str], patch: str | None) -> str:
    from lightning_zero.core.comm import Communicator
    from lightning_zero.core.engine import ZeroEngine
    from lightning_zero.core.options import EngineOptions

    if patch == "no_space":
        checks.os.statvfs = lambda path: os.statvfs_result((4096, 4096, 10, 1, 1, 10, 10, 10, 0, 255))  # type: ignore[attr-defined]
    if patch == "no_memory":
        checks._mem_available = lambda: 1024
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    options = EngineOptions(stage=2, offload_optimizer=target, nvme_path=paths[rank])
    try:
        ZeroEngine(model, [optimizer], options, Communicator())
    except ValueError as error:
        return str(error)
    return "built"


@pytest.mark.parametrize(
    ("problem", "target", "patch", "expected"),
    [
        ("missing", "nvme", None, r"rank 1: nvme_path='.*/missing' does not exist"),
        ("file", "nvme", None, r"rank 1: nvme_path='.*/a-file' is not a directory"),
        ("unwritable", "nvme", None, r"rank 1: cannot create a swap file in nvme_path='/proc/self'"),
        ("no_space", "nvme", "no_space", r"rank 0: nvme_path=.* has 0.00 GiB free, but 2 rank\(s\) on this file"),
        ("no_memory", "cpu", "no_memory", r"rank 0: host memory has 0.00 GiB available, but 2 rank\(s\)"),
    ],
)
def test_offload_setup_problems_raise_on_every_rank(
    tmp_path: Path, problem: str, target: str, patch: str | None, expected: str
) -> None:
    import re

    (tmp_path / "a-file").write_text("")
    bad = {"missing": tmp_path / "missing", "file": tmp_path / "a-file", "unwritable": Path("/proc/self")}
    paths = [str(tmp_path), str(bad.get(problem, tmp_path))]
    messages = run_on_ranks(_engine_with, 2, target, paths, patch)
    for rank, message in enumerate(messages):
        assert re.search(expected, message), f"rank {rank}: {message}"
        assert f"offload_optimizer={target!r} cannot run" in message


def test_offload_params_nvme_needs_nvme_path() -> None:
    from lightning_zero import ZeroStrategy

    with pytest.raises(ValueError, match=r"offload to 'nvme' needs nvme_path"):
        ZeroStrategy(stage=3, offload_optimizer="cpu", offload_params="nvme")


def test_fused_kernel_is_chosen_once_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    from lightning_zero.core.store.offload import prefer_fused_kernels

    model = torch.nn.Linear(4, 4)
    chosen = torch.optim.AdamW(model.parameters(), foreach=True)
    default = torch.optim.AdamW(model.parameters())
    momentum = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain_sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level("INFO", logger="lightning_zero"):
        prefer_fused_kernels([chosen, default, momentum, plain_sgd])
    assert chosen.param_groups[0]["fused"] is None  # the user's choice stays
    assert default.param_groups[0]["fused"] is True
    assert momentum.param_groups[0]["fused"] is None  # torch's fused SGD cannot take a late first gradient
    assert plain_sgd.param_groups[0]["fused"] is True
    assert "fused kernel (AdamW group 0, SGD group 0)." in caplog.text
