"""Sharded checkpoints (``state_dict_type="sharded"``) through ``trainer.save_checkpoint`` and ``fit(ckpt_path=dir)``.

Three spawns: 2 ranks save (DDP full file, stage 1 and stage 3 sharded); 3 ranks save (DDP, stage 3) and resume
the 2-rank checkpoints; 2 ranks resume everything else. 24 samples with batch size 4 give 3 steps per epoch on
2 ranks and 2 on 3 ranks, so step 6 ends an epoch on both (see ``SaveAt``). Cross-world-size resumes are
compared with DDP resuming DDP's checkpoint at the same world size (Lightning splits the data differently).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
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

SAVE_STEP = 6
STEPS = 9
RTOL = 1e-5
BASE: dict[str, Any] = {
    "model": "tied",
    "model_kwargs": {"param_groups": True},
    "samples": 24,
    "strategy_kwargs": {"state_dict_type": "sharded"},
    "trainer": {"max_steps": STEPS},
}
# name: (world size, strategy); DDP writes one full file.
SAVES = {"ddp2": (2, "ddp"), "z1_2": (2, 1), "z3_2": (2, 3), "ddp3": (3, "ddp"), "z3_3": (3, 3)}
# (checkpoint, world size that resumes, strategy that resumes)
RESUMES_ON_3 = [("ddp2", "ddp"), ("z1_2", 3)]
RESUMES_ON_2 = [("z1_2", 1), ("z3_2", 3), ("z3_2", 2), ("ddp3", "ddp"), ("z3_3", 1)]
RESUMES_ON_1 = [("ddp3", "ddp"), ("z3_3", 2)]


def _saves(directory: Path, world_size: int) -> list[dict[str, Any]]:
    return [
        {**BASE, "strategy": strategy, "save_at": (SAVE_STEP, str(directory / name))}
        for name, (size, strategy) in SAVES.items()
        if size == world_size
    ]


def _resumes(directory: Path, resumes: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    return [{**BASE, "strategy": strategy, "ckpt_path": str(directory / name)} for name, strategy in resumes]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("sharded")
    first = run_on_ranks(fit_cases, 2, _saves(directory, 2))
    second = run_on_ranks(fit_cases, 3, _saves(directory, 3) + _resumes(directory, RESUMES_ON_3))
    broken = directory / "z3_3_missing"
    shutil.copytree(directory / "z3_3", broken)
    (broken / "rank_2.pt").unlink()
    failing = [
        {**BASE, "strategy": 1, "ckpt_path": str(broken)},
        {**BASE, "model": "two_layer", "model_kwargs": {}, "strategy": 3, "ckpt_path": str(directory / "z3_3")},
    ]
    cases = _resumes(directory, RESUMES_ON_2) + failing
    third = run_on_ranks(_resumes_and_model_checkpoint, 2, cases, str(directory / "mc"))
    fourth = run_on_ranks(fit_cases, 1, _resumes(directory, RESUMES_ON_1))
    saved, resumed = {}, {}
    runs_by_size = ((first, 2, []), (second, 3, RESUMES_ON_3), (third, 2, RESUMES_ON_2), (fourth, 1, RESUMES_ON_1))
    for per_rank, world_size, resumes in runs_by_size:
        saving = per_rank is first or per_rank is second
        names = [n for n, (size, _) in SAVES.items() if size == world_size] if saving else []
        keys = names + [(name, world_size, strategy) for name, strategy in resumes]
        for index, key in enumerate(keys):
            (saved if isinstance(key, str) else resumed)[key] = [results[index] for results in per_rank]
    errors = {"missing": [r[-3] for r in third], "other_model": [r[-2] for r in third]}
    return {"dir": directory, "saved": saved, "resumed": resumed, "model_checkpoint": [r[-1] for r in third], **errors}


class _Validated(TiedLM):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx), sync_dist=True)


def _resumes_and_model_checkpoint(rank: int, world_size: int, cases: list[dict], directory: str) -> list[Any]:
    """The resume cases, then ModelCheckpoint writing sharded directories at stage 3 (keeping the best 2 and
    last), validate() from the last one at stages 1 and 3, and fit resumed from it at stage 2."""
    results: list[Any] = fit_cases(rank, world_size, cases)
    try:
        callback = ModelCheckpoint(directory, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max")
        callback.save_last = True
        trainer = make_trainer(world_size, ZeroStrategy(stage=3), callbacks=[callback], enable_checkpointing=True)
        trainer.fit(_Validated(param_groups=True), make_loader("tied", 24))
        weights = f"{directory}-weights"
        trainer.save_checkpoint(weights, weights_only=True)
        metrics = []
        for stage, path in ((1, callback.last_model_path), (3, callback.last_model_path), (1, weights)):
            evaluator = make_trainer(world_size, ZeroStrategy(stage=stage))
            metrics.append(evaluator.validate(_Validated(param_groups=True), make_loader("tied", 24), ckpt_path=path))
        resumed = make_trainer(world_size, ZeroStrategy(stage=2), max_steps=8)
        resumed.fit(_Validated(param_groups=True), make_loader("tied", 24), ckpt_path=callback.last_model_path)
        results.append({"files": sorted(os.listdir(directory)), "metrics": metrics, "step": resumed.global_step})
    except Exception:
        results.append({"error": f"rank {rank}:\n{traceback.format_exc()}"})
    return results


def _assert_close(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor], what: str) -> None:
    diffs = max_rel_diff(expected, actual)
    bad = {key: diff for key, diff in diffs.items() if not diff <= RTOL}
    assert not bad, f"{what}: relative differences {bad}"


def test_every_case_finished_on_every_rank(runs: dict[str, Any]) -> None:
    """Saves and resumes whose other ranks no test reads (DDP's saves, z3_3 beyond rank 0, the stage 3 -> 2 resume's
    rank 1) still fail if they raised; the broken and foreign checkpoints' errors are their tests' outcome."""
    cases = {("saved", name): per_rank for name, per_rank in runs["saved"].items()}
    cases.update({("resumed", key): per_rank for key, per_rank in runs["resumed"].items()})
    assert_every_case_finished({**cases, "model_checkpoint": runs["model_checkpoint"]})


@pytest.mark.parametrize("name", ["z1_2", "z3_2", "z3_3"])
def test_sharded_save_writes_a_directory_of_rank_files(runs: dict[str, Any], name: str) -> None:
    result_of(runs["saved"][name][0])
    path = runs["dir"] / name
    world_size, stage = SAVES[name]
    assert path.is_dir()
    expected = {"metadata.json", "lightning.pt", *(f"rank_{r}.pt" for r in range(world_size))}
    assert {p.name for p in path.iterdir()} == expected
    assert not [p for p in runs["dir"].iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    metadata = json.loads((path / "metadata.json").read_text())
    assert (metadata["world_size"], metadata["stage"]) == (world_size, stage)
    assert list(metadata["tensors"]) == ["embed.weight", "up.weight", "up.bias", "down.weight", "down.bias"]
    assert ["head.weight", "embed.weight"] in metadata["state_dict_keys"]
    lightning_state = torch.load(path / "lightning.pt", weights_only=False)
    assert lightning_state["global_step"] == SAVE_STEP
    assert not {"state_dict", "optimizer_states"} & set(lightning_state)
    assert lightning_state["lr_schedulers"]
    # Each rank stores only the elements it owns: together they hold each parameter exactly once.
    files = [torch.load(path / f"rank_{r}.pt") for r in range(world_size)]
    assert sum(f["params"]["up.weight"].numel() for f in files if "up.weight" in f["params"]) == 45


@pytest.mark.parametrize(("name", "strategy"), [("z1_2", 1), ("z3_2", 3)], ids=["stage1-2ranks", "stage3-2ranks"])
def test_same_world_size_and_stage_resumes_bit_exactly(runs: dict[str, Any], name: str, strategy: int) -> None:
    pairs = zip(runs["resumed"][(name, 2, strategy)], runs["saved"][name], strict=True)
    for rank, (resumed, uninterrupted) in enumerate(pairs):
        resumed, uninterrupted = result_of(resumed), result_of(uninterrupted)
        assert resumed["global_step"] == uninterrupted["global_step"] == STEPS
        for key, value in uninterrupted["state"].items():
            assert torch.equal(value, resumed["state"][key]), f"rank {rank}: {key} differs after resuming"


def test_stage3_resumes_at_stage2_like_the_uninterrupted_run(runs: dict[str, Any]) -> None:
    resumed, uninterrupted = runs["resumed"][("z3_2", 2, 2)][0], runs["saved"]["z3_2"][0]
    _assert_close(result_of(uninterrupted)["state"], result_of(resumed)["state"], "stage 3 -> stage 2")


@pytest.mark.parametrize(
    ("name", "world_size", "strategy", "oracle"),
    [("z3_3", 2, 1, "ddp3"), ("z1_2", 3, 3, "ddp2"), ("z3_3", 1, 2, "ddp3")],
    ids=["stage3-3ranks-to-stage1-2ranks", "stage1-2ranks-to-stage3-3ranks", "stage3-3ranks-to-stage2-1rank"],
)
def test_resume_at_another_world_size_and_stage_matches_ddp(
    runs: dict[str, Any], name: str, world_size: int, strategy: int, oracle: str
) -> None:
    expected = runs["resumed"][(oracle, world_size, "ddp")]
    actual = runs["resumed"][(name, world_size, strategy)]
    for rank, (ddp, zero) in enumerate(zip(map(result_of, expected), map(result_of, actual), strict=True)):
        assert zero["global_step"] == ddp["global_step"] == STEPS
        _assert_close(ddp["state"], zero["state"], f"rank {rank} of {world_size}: resumed ZeRO vs resumed DDP")


LOAD_WITHOUT_LIGHTNING_ZERO = """
import sys, torch
from tests.lightning.models import TiedLM
model = TiedLM.load_from_checkpoint(sys.argv[1], map_location="cpu", param_groups=True)
assert "lightning_zero" not in sys.modules, "loading imported lightning_zero"
torch.save({k: v.clone() for k, v in model.state_dict().items()}, sys.argv[2])
"""


def test_consolidated_checkpoint_equals_ddp_and_loads_without_lightning_zero(runs: dict[str, Any]) -> None:
    from lightning_zero.cli import main

    result_of(runs["saved"]["z3_3"][0])
    out = runs["dir"] / "z3_3.ckpt"
    assert main(["consolidate", str(runs["dir"] / "z3_3"), str(out)]) == 0
    consolidated = torch.load(out, weights_only=False)
    reference = torch.load(runs["dir"] / "ddp3", weights_only=False)
    assert list(consolidated["state_dict"]) == list(reference["state_dict"])
    _assert_close(reference["state_dict"], consolidated["state_dict"], "consolidated weights vs DDP's")
    assert consolidated["global_step"] == reference["global_step"] == SAVE_STEP
    assert consolidated["lr_schedulers"] == reference["lr_schedulers"]
    ddp_opt, zero_opt = reference["optimizer_states"][0], consolidated["optimizer_states"][0]
    assert zero_opt["param_groups"] == ddp_opt["param_groups"]
    assert sorted(zero_opt["state"]) == sorted(ddp_opt["state"])
    for index, state in ddp_opt["state"].items():
        _assert_close(state, zero_opt["state"][index], f"optimizer state of param {index}")
    weights = runs["dir"] / "loaded.pt"
    repo = Path(__file__).resolve().parents[2]
    script = [sys.executable, "-c", LOAD_WITHOUT_LIGHTNING_ZERO, str(out), str(weights)]
    loaded = subprocess.run(script, capture_output=True, text=True, cwd=repo, check=False)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    _assert_close(consolidated["state_dict"], torch.load(weights), "load_from_checkpoint vs the file")


def test_consolidate_names_a_missing_rank_file(runs: dict[str, Any], tmp_path: Path) -> None:
    import lightning_zero
    from lightning_zero.cli import main

    broken = tmp_path / "broken"
    shutil.copytree(runs["dir"] / "z3_3", broken)
    (broken / "rank_1.pt").unlink()
    with pytest.raises(RuntimeError, match=r"metadata lists 3 ranks, shard files for ranks \[1\] are missing"):
        lightning_zero.consolidate(broken, tmp_path / "out.ckpt")
    assert main(["consolidate", str(broken), str(tmp_path / "out.ckpt")]) == 1
    assert not (tmp_path / "out.ckpt").exists()


def test_consolidate_into_a_place_it_cannot_write_says_so(
    runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A message naming the output, not a traceback of an internal temporary file."""
    from lightning_zero.cli import main

    assert main(["consolidate", str(runs["dir"] / "z3_3"), str(tmp_path / "missing" / "out.ckpt")]) == 1
    assert f"{tmp_path / 'missing'} does not exist: create it first" in capsys.readouterr().err
    assert main(["consolidate", str(runs["dir"] / "z3_3"), "/proc/out.ckpt"]) == 1  # not writable, even by root
    assert "lightning-zero consolidate: cannot write /proc/out.ckpt: " in capsys.readouterr().err


def test_model_checkpoint_keeps_sharded_directories_that_validate_and_resume(runs: dict[str, Any]) -> None:
    for rank, outcome in enumerate(runs["model_checkpoint"]):
        outcome = result_of(outcome)
        assert outcome["files"] == ["epoch=1-step=4.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"], f"rank {rank}"
        assert all((runs["dir"] / "mc" / name / "metadata.json").is_file() for name in outcome["files"])
        stage1, stage3, weights_only = (m[0]["val_loss"] for m in outcome["metrics"])
        assert stage1 == pytest.approx(stage3, rel=1e-6)
        assert weights_only == pytest.approx(stage1, rel=1e-6)  # saved with weights_only=True after the same step
        assert not json.loads((runs["dir"] / "mc-weights" / "metadata.json").read_text())["optimizers"]
        assert outcome["step"] == 8


def test_consolidated_weights_only_checkpoint_has_no_optimizer_states(runs: dict[str, Any], tmp_path: Path) -> None:
    # As Lightning's own weights-only checkpoints: no key, so resuming fit from it gives Lightning's clear error.
    import lightning_zero

    out = tmp_path / "weights.ckpt"
    lightning_zero.consolidate(runs["dir"] / "mc-weights", out)
    checkpoint = torch.load(out, weights_only=False)
    assert "optimizer_states" not in checkpoint
    assert checkpoint["state_dict"]


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing", "is incomplete: metadata lists 3 ranks, shard files for ranks [2] are missing."),
        ("other_model", "is of a different model: it has no tensor 'a.weight'."),
    ],
)
def test_resuming_from_a_broken_or_foreign_checkpoint_fails_on_every_rank(
    runs: dict[str, Any], case: str, expected: str
) -> None:
    for rank, outcome in enumerate(runs[case]):
        assert "error" in outcome, f"rank {rank} resumed from the {case} checkpoint without an error"
        assert "CheckpointError" in outcome["error"]
        assert expected in outcome["error"], outcome["error"][-2000:]
