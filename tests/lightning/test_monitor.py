"""ZeroMonitor logs the byte counts of the model states each rank holds, and they follow the ZeRO formulas.

TwoLayer(hidden=16) has Ψ = 179 parameter elements in 4 tensors and one param group, hence one flat buffer
padded to 180 elements for 2 ranks. With fp32 AdamW, per rank: parameters 4Ψ (+ padding) at both stages,
gradients 4Ψ (stage 1) or 4Ψ/2 (stage 2), optimizer states 8Ψ/2 (exp_avg and exp_avg_sq of the owned
elements) plus a 4-byte ``step`` per piece; each step moves 8Ψ bytes (reduce-scatter + all-gather, in the
units of lightning_zero.core.comm) plus a few bytes of agreement on which parameters got gradients.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy

from tests.helpers import run_on_ranks
from tests.lightning.models import TwoLayer, make_loader, make_trainer

WORLD_SIZE = 2
STEPS = 3
FP16_STEPS = 40
PSI = 179
N_TENSORS = 4
PADDED = math.ceil(PSI / WORLD_SIZE) * WORLD_SIZE
METRICS = (
    "zero/params_bytes",
    "zero/gradients_bytes",
    "zero/optimizer_states_bytes",
    "zero/offloaded_bytes",
    "zero/comm_bytes",
    "zero/intra_node_bytes",
    "zero/inter_node_bytes",
)
HYBRID_METRICS = ("zero/shard_group_bytes", "zero/replicate_group_bytes")
PEAK_KINDS = ("model_states", "gathered", "buckets", "temporaries")  # activations: CUDA only
# "2hybrid": every rank its own shard group (shard_size=1), so the gradients travel in the replicate group alone.
RUNS = {
    1: {"stage": 1},
    2: {"stage": 2},
    "2cpu": {"stage": 2, "offload_optimizer": "cpu"},
    "2hybrid": {"stage": 2, "shard_size": 1},
}


def _monitor_runs(rank: int, world_size: int, log_dir: str) -> dict[str, Any]:
    from lightning_zero import ZeroMonitor, ZeroPrecision, ZeroStrategy

    out: dict[str, Any] = {}
    for stage, kwargs in RUNS.items():
        model = TwoLayer(hidden=16)
        trainer = make_trainer(
            world_size,
            ZeroStrategy(**kwargs),
            max_steps=STEPS,
            logger=CSVLogger(log_dir, name=f"stage{stage}", version=0),
            log_every_n_steps=1,
            callbacks=[ZeroMonitor()],
        )
        trainer.fit(model, make_loader("two_layer"))
        strategy = trainer.strategy
        out[stage] = {
            "numel": sum(p.numel() for p in model.parameters()),
            "logged": {k: float(v) for k, v in trainer.logged_metrics.items()},
            "report": strategy.memory_report().as_dict(),
            "comm": strategy.comm_report().nbytes,
            "intra": strategy.comm_report().intra_node_bytes,
            "inter": strategy.comm_report().inter_node_bytes,
            "by_group": dict(strategy.comm_report().by_group),
        }
    # fp16 with a first scale far too large: the first steps overflow and are skipped, the scale halving each time.
    precision = ZeroPrecision("16-mixed", init_scale=2.0**40)
    trainer = make_trainer(
        world_size,
        ZeroStrategy(stage=2, precision_plugin=precision),
        max_steps=FP16_STEPS,
        logger=CSVLogger(log_dir, name="stagefp16", version=0),
        log_every_n_steps=1,
        callbacks=[ZeroMonitor()],
    )
    trainer.fit(TwoLayer(hidden=16), make_loader("two_layer"))
    assert precision.scaler is not None
    out["fp16"] = {"scale": precision.scaler.scale, "skipped": precision.scaler.skipped_steps}
    try:
        trainer = make_trainer(world_size, DDPStrategy(), max_steps=1, callbacks=[ZeroMonitor()])
        trainer.fit(TwoLayer(), make_loader("two_layer"))
        out["ddp_error"] = None
    except ValueError as error:
        out["ddp_error"] = str(error)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    log_dir = tmp_path_factory.mktemp("monitor_logs")
    return log_dir, run_on_ranks(_monitor_runs, WORLD_SIZE, str(log_dir))


def _csv_rows(log_dir: Path, stage: int) -> list[dict[str, str]]:
    path = log_dir / f"stage{stage}" / "version_0" / "metrics.csv"
    assert path.is_file(), f"CSVLogger wrote no {path}"
    with path.open() as handle:
        return [row for row in csv.DictReader(handle) if row.get(METRICS[0])]


@pytest.mark.parametrize("stage", list(RUNS))
def test_monitor_logs_the_strategy_report_every_step(runs: tuple[Path, list[dict[str, Any]]], stage: int) -> None:
    log_dir, per_rank = runs
    rows = _csv_rows(log_dir, stage)
    assert len(rows) == STEPS
    rank0 = per_rank[0][stage]
    expected = {
        "zero/params_bytes": rank0["report"]["params"],
        "zero/gradients_bytes": rank0["report"]["gradients"],
        "zero/optimizer_states_bytes": rank0["report"]["optimizer_states"],
        "zero/offloaded_bytes": rank0["report"]["offloaded"],
        "zero/comm_bytes": rank0["comm"],
        "zero/intra_node_bytes": rank0["intra"],
        "zero/inter_node_bytes": rank0["inter"],
    }
    assert rank0["inter"] == 0  # one node
    # Half of each count goes to the one peer (rounded down per collective).
    assert rank0["intra"] - rank0["comm"] // WORLD_SIZE in range(-8, 1)
    names = METRICS
    if stage == "2hybrid":
        names += HYBRID_METRICS
        expected["zero/shard_group_bytes"] = rank0["by_group"].get("shard", 0)
        expected["zero/replicate_group_bytes"] = rank0["by_group"]["replicate"]
        # The shard group is one rank: its reduce-scatter and all-gather send nothing and count nothing; the gradient
        # is all-reduced across the replicas (counted twice, fp32), what DDP moves.
        assert expected["zero/shard_group_bytes"] == 0
        assert expected["zero/replicate_group_bytes"] == 8 * PSI
    else:
        assert not any(name in rows[-1] for name in HYBRID_METRICS)
    # Offload moves the master and the state (fp32 AdamW: 12 bytes an owned element) off the device.
    assert (expected["zero/offloaded_bytes"] > 0) == (stage == "2cpu")
    assert (expected["zero/optimizer_states_bytes"] == 0) == (stage == "2cpu")
    assert {name: float(rows[-1][name]) for name in names} == expected
    assert {name: rank0["logged"][name] for name in names} == expected
    # Model states do not change size between steps; communication is the same every step.
    for row in rows[1:]:
        assert {name: float(row[name]) for name in names} == expected


@pytest.mark.parametrize("stage", list(RUNS))
def test_monitor_logs_the_step_peak_by_kind(runs: tuple[Path, list[dict[str, Any]]], stage: int) -> None:
    """The last step's row holds the peak that memory_report() gives after fit (nothing allocates after it)."""
    log_dir, per_rank = runs
    row, report = _csv_rows(log_dir, stage)[-1], per_rank[0][stage]["report"]
    logged = {kind: float(row[f"zero/peak_{kind}_bytes"]) for kind in PEAK_KINDS}
    assert logged == {kind: report[f"peak_{kind}"] for kind in PEAK_KINDS}
    assert float(row["zero/peak_bytes"]) == report["peak"] == sum(logged.values())
    assert "zero/peak_activations_bytes" not in row  # measured by the CUDA allocator only
    assert logged["model_states"] == report["total"]
    # Stage 1 in fp32 reduces in its persistent full gradient; stage 2 stages each bucket's full gradient.
    assert (logged["buckets"] > 0) == (stage != 1), logged
    assert logged["gathered"] == logged["temporaries"] == 0  # no stage 3, no master copies


@pytest.mark.parametrize("stage", [1, 2])
def test_memory_report_follows_the_zero_formulas(runs: tuple[Path, list[dict[str, Any]]], stage: int) -> None:
    _, per_rank = runs
    assert per_rank[0][stage]["numel"] == PSI
    own = PADDED // WORLD_SIZE  # elements of a shard, padding included
    for rank, results in enumerate(per_rank):
        report = results[stage]["report"]
        assert 4 * PSI <= report["params"] <= 4 * PADDED, f"rank {rank}: {report}"
        if stage == 1:
            assert 4 * PSI <= report["gradients"] <= 4 * PADDED, f"rank {rank}: {report}"
        else:
            assert 4 * PSI / WORLD_SIZE <= report["gradients"] <= 4 * own, f"rank {rank}: {report}"
        real = own - (WORLD_SIZE - 1)  # at least this many real (not padding) elements in any shard
        steps = 4 * N_TENSORS  # every rank lists one (maybe empty) piece per tensor, each with a 4-byte step
        assert 8 * real + steps <= report["optimizer_states"] <= 8 * own + steps, f"rank {rank}: {report}"
    # Over all ranks the moments cover every element exactly once, plus the steps.
    total = sum(results[stage]["report"]["optimizer_states"] for results in per_rank)
    assert total == 8 * PSI + 4 * N_TENSORS * WORLD_SIZE


@pytest.mark.parametrize("stage", [1, 2])
def test_comm_bytes_are_one_reduce_scatter_and_one_all_gather(
    runs: tuple[Path, list[dict[str, Any]]], stage: int
) -> None:
    _, per_rank = runs
    for rank, results in enumerate(per_rank):
        comm = results[stage]["comm"]
        assert 8 * PSI <= comm <= 8 * PADDED + 64, f"rank {rank}: {comm} bytes"


def test_monitor_logs_the_loss_scale_and_the_skipped_steps_with_fp16(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    log_dir, per_rank = runs
    rows = _csv_rows(log_dir, "fp16")
    assert len(rows) == FP16_STEPS
    scales = [float(row["zero/loss_scale"]) for row in rows]
    skipped = [float(row["zero/skipped_steps"]) for row in rows]
    final = per_rank[0]["fp16"]
    assert 0 < final["skipped"] < FP16_STEPS  # some steps overflowed, then the scale was low enough
    assert (scales[-1], skipped[-1]) == (final["scale"], final["skipped"])
    # Each row is the state after its step: a skipped step halves the scale, a clean one keeps it.
    for before, after, skips_before, skips_after in zip(scales, scales[1:], skipped, skipped[1:], strict=False):
        assert after == (before / 2 if skips_after == skips_before + 1 else before), (before, after)
    assert scales[0] == 2.0**40 / 2 ** skipped[0]
    fp32_rows = _csv_rows(log_dir, 1)
    assert "zero/loss_scale" not in fp32_rows[-1]


def test_monitor_rejects_other_strategies(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    _, per_rank = runs
    for rank, results in enumerate(per_rank):
        assert results["ddp_error"] is not None, f"rank {rank}: ZeroMonitor accepted DDPStrategy"
        assert "ZeroStrategy" in results["ddp_error"]
