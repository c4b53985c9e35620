"""benchmarks/lightning_peak.py without running it (a run spawns a pair of processes per system: by hand only): its
options, and its statistics and table on readings made up here, with a failed run among them."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from tests.unit.bench_scripts import benchmark_script

MIB = 2**20


@pytest.fixture(scope="module")
def peak() -> Iterator[ModuleType]:
    with benchmark_script("lightning_peak") as module:
        yield module


def test_options(peak: ModuleType) -> None:
    args = peak.parse_args([])
    assert args.systems == list(peak.SYSTEMS)
    assert {"fsdp", "fsdp2_pl", "zero3_bf16", "fsdp2_pl_bf16", "raw_ddp_bf16"} <= set(args.systems)
    assert args.malloc == ["mmap64k"]
    chosen = peak.parse_args(["--systems", "ddp, zero2", "--malloc", "mmap64k,as-is", "--rounds", "2"])
    assert (chosen.systems, chosen.malloc, chosen.rounds) == (["ddp", "zero2"], ["mmap64k", "as-is"], 2)
    for wrong in (["--systems", "zero4"], ["--systems", "ddp,ddp"], ["--malloc", "tcmalloc"], ["--steps", "0"]):
        with pytest.raises(SystemExit):
            peak.parse_args(wrong)


def _run(step_ms: float, peak_mib: float, states_mib: float, **gap: Any) -> dict[str, Any]:
    return {
        "step_ms": step_ms,
        "peak_over_baseline": peak_mib * MIB,
        "model_states": states_mib * MIB,
        "peak_over_states": (peak_mib - states_mib) * MIB,
        **gap,
    }


def test_ratios_are_medians_of_rounds_and_a_failed_system_keeps_its_row(peak: ModuleType) -> None:
    args = peak.parse_args(["--systems", "ddp,raw_ddp,fsdp2,zero3,fsdp", "--rounds", "3"])
    exact = {"max_rel_param_diff": 0.0, "rel_l2_param_diff": 0.0, "bitwise_equal": True}
    rounds = [
        {
            "mmap64k": {
                "ddp": _run(100 * k, 300, 100),
                "raw_ddp": _run(90 * k, 290, 100, **exact),
                "fsdp2": _run(150 * k, 200, 50, **exact),
                "zero3": _run(r * 60 * k, 180, 50, **exact),
                "fsdp": {"error": "RuntimeError: no"},
            }
        }
        for k, r in ((1.0, 1.0), (2.0, 1.5), (1.5, 2.0))  # machine drift k; zero3's own ratio 0.6, 0.9, 1.2
    ]
    full = peak.summarize(args, rounds)
    summary = full["mmap64k"]
    assert summary["zero3"]["vs_ddp"] == pytest.approx(0.9)
    assert summary["zero3"]["step_ms"] == pytest.approx(180)  # median of 60, 180, 180
    assert summary["zero3"]["step_ms_min_max"] == (60, 180)
    assert summary["raw_ddp"]["vs_ddp"] == pytest.approx(0.9)
    assert summary["ddp"]["vs_raw_ddp"] == pytest.approx(1 / 0.9)
    assert summary["zero3"]["bitwise_equal"]
    assert summary["ddp"]["max_rel_param_diff"] is None  # the reference
    assert summary["fsdp"]["failed"] == ["RuntimeError: no"] * 3
    table = peak.markdown(args, full, 25_000_000)
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines() if line.startswith("| ")}
    assert "FAILED: RuntimeError: no" in rows["fsdp"]
    cells = [cell.strip() for cell in rows["zero3"].strip("|").split("|")]
    # system, precision, step, vs ddp, vs raw_ddp, peak - baseline, states, peak over states, - ddp, - fsdp2, - fsdp
    assert cells[2:11] == ["180 (60-180)", "0.900x", "1.000x", "180.0", "50.0", "130.0", "-70.0", "-20.0", "-"]
    assert cells[11] == "bit-equal"
    assert len(cells) == len(rows["system"].strip("|").split("|"))
