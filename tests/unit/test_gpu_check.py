"""benchmarks/gpu_check.py, the prepared check of the CUDA/NCCL path: its options, its refusal without CUDA, its
table, its reading of a profiler trace, and a dry run of the same code on the CPU (gloo, a tiny GPT)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["gpu_check"]
        raise
    yield module
    del sys.modules["gpu_check"]


def test_options_take_gpu_or_dry_run_defaults_and_keep_given_values(gpu_check: ModuleType) -> None:
    gpu = gpu_check.parse_args([])
    dry = gpu_check.parse_args(["--dry-run", "--steps", "7"])
    assert (gpu.params, gpu.block_size, gpu.budget_s, gpu.dry_run) == (1e9, 1024, 420.0, False)
    assert (dry.params, dry.block_size, dry.steps, dry.dry_run) == (2e6, 64, 7, True)
    assert (type(dry.steps), type(dry.timeout_s)) == (int, float)
    assert gpu.checks == list(gpu_check.CHECKS)
    assert gpu_check.parse_args(["--checks", "systems, offload"]).checks == ["systems", "offload"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--checks", "systems,gpu"], "unknown \\['gpu'\\]"), (["--steps", "0"], "need --steps >= 1")],
)
def test_bad_options_name_the_problem(
    gpu_check: ModuleType, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(argv)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_without_cuda_it_exits_2_and_says_why(
    gpu_check: ModuleType, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--checks", "systems"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err
    assert "--dry-run" in err


def test_table_has_one_cell_per_column_and_marks_missing_figures(gpu_check: ModuleType) -> None:
    rows = [
        {"check": "zero1_fp32", "status": "ok", "step_ms": 12.3456, "max_rel_diff": 0.0, "notes": "a | b"},
        {"check": "lost_rank", "status": "skipped: not possible on one GPU"},
        {"check": "zero2_bf16", "status": "FAIL: boom", "max_rel_diff": 1.5e-7, "peak_gib": float("nan")},
    ]
    lines = gpu_check.format_table(rows).splitlines()
    assert len(lines) == 2 + len(rows)
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:2] == ["check", "status"]
    assert "max rel diff" in header
    for line, row in zip(lines[2:], rows, strict=True):
        cells = [c.strip() for c in line.strip("|").replace("\\|", "/").split("|")]
        assert len(cells) == len(header)
        assert cells[:2] == [row["check"], row["status"]]
    first = dict(zip(header, [c.strip() for c in lines[2].strip("|").replace("\\|", "/").split("|")], strict=True))
    assert (first["step ms"], first["max rel diff"], first["tokens/s"], first["notes"]) == ("12.35", "0", "-", "a / b")
    third = dict(zip(header, [c.strip() for c in lines[4].strip("|").split("|")], strict=True))
    assert (third["max rel diff"], third["peak GiB"]) == ("1.500e-07", "nan")


def test_copy_overlap_is_the_share_of_copy_time_under_a_kernel(gpu_check: ModuleType) -> None:
    def event(cat: str, name: str, ts: float, dur: float, stream: int) -> dict:
        return {"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "bytes": 100}}

    events = [
        event("kernel", "gemm", 0, 10, 7),
        event("kernel", "gemm", 5, 10, 7),  # merged with the first: 0..15
        event("kernel", "add", 30, 10, 7),
        event("kernel", "ncclDevKernel_AllGather_RING_LL", 15, 20, 9),  # communication: not compute
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 10, 10, 20),  # 5 of 10 under 0..15
        event("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 20, 10, 20),  # none
        event("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 32, 4, 7),  # all under 30..40
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},
    ]
    summary = gpu_check.summarize_copies(events)
    assert (summary["kernel_us"], summary["kernel_streams"]) == (25, [7])
    assert (summary["HtoD"]["count"], summary["HtoD"]["us"], summary["HtoD"]["bytes"]) == (2, 20, 200)
    assert summary["HtoD"]["overlap"] == pytest.approx(5 / 20)
    assert summary["HtoD"]["streams"] == [20]
    assert summary["DtoH"]["overlap"] == pytest.approx(1.0)
    text = gpu_check.overlap_text({"measured": True, **summary})
    htod, dtoh = text.removeprefix("copies: ").split("; ")
    assert htod.startswith("HtoD 2x 0.0 ms, 25% overlapped, on streams [20], 1 of 2 kinds pageable")
    assert dtoh.startswith("DtoH 1x 0.0 ms, 100% overlapped, on the compute stream, 1 of 1 kinds pageable")


def test_a_spent_budget_skips_every_check_and_still_exits_0(gpu_check: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "skipped.json"
    assert gpu_check.main(["--dry-run", "--budget-s", "0", "--checks", "systems", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["finished"] is True
    assert report["results"]
    assert [r["status"].split(" of ")[0] for r in report["results"]] == ["skipped: budget"] * len(report["results"])


def test_a_failing_check_is_a_row_with_its_traceback_and_the_run_goes_on(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_group(*args: object) -> None:
        raise RuntimeError("NCCL error: unhandled system error\nmore detail")

    monkeypatch.setattr(gpu_check, "init_group", broken_group)
    out = tmp_path / "failed.json"
    assert gpu_check.main(["--dry-run", "--checks", "systems,offload", "--out", str(out)]) == 0
    rows = {row["check"]: row for row in json.loads(out.read_text())["results"]}
    group = rows["process group (gloo, world size 1)"]
    assert group["status"] == "FAIL: RuntimeError: NCCL error: unhandled system error"
    assert "more detail" in group["traceback"]
    assert rows["environment"]["status"] == "ok"
    assert (
        rows["systems"]["status"]
        == rows["offload"]["status"]
        == "skipped: " + ("this process has no process group (see its row)")
    )


def test_dry_run_of_the_in_process_checks_and_the_trainer_subprocess(tmp_path: Path) -> None:
    """The same code as on a GPU: the systems against DDP, compiled blocks (aot_eager here), the Trainer in a
    subprocess, every offload mode. The
    two-rank checks spawn two more interpreters each (about 15 s of CPU on top): `--dry-run` without `--checks`
    runs them too, by hand."""
    out = tmp_path / "dry.json"
    sizes = ["--params", "5e5", "--offload-params", "5e5"]
    checks = "systems,compile,lightning,offload"
    result = _run_script("--dry-run", *sizes, "--checks", checks, "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:]
    report = json.loads(out.read_text())
    rows = {row["check"]: row for row in report["results"]}
    failed = {name: row["status"] for name, row in rows.items() if row["status"] != "ok"}
    assert not failed, failed
    assert report["table"] in result.stdout
    assert {"environment", "lightning fit + barrier", "swap disk"} <= set(rows)
    for stage in (1, 2, 3):  # fp32 at world size 1: the same maths as DDP, bit for bit
        assert rows[f"zero{stage}_fp32"]["details"]["vs_ddp"]["bitwise_equal"], rows[f"zero{stage}_fp32"]
        assert rows[f"zero{stage}_fp32"]["states_gib"] == pytest.approx(
            rows[f"zero{stage}_fp32"]["formula_gib"], rel=1e-3
        )
    gathered = float(rows["zero3_fp32"]["step_peak"].split(" + ")[0])
    assert gathered > 0  # stage 3's step peak holds gathered units (memory_report().step_peak)
    assert "step_peak" not in rows["ddp_fp32"]
    for name in ("ddp_fp32 compiled", "zero3_fp32 compiled", "zero3_bf16 compiled"):  # nothing compiled again
        assert rows[name]["details"]["graphs_after_one_more_step"] == rows[name]["details"]["graphs"] >= 1
    assert rows["zero3_fp32 compiled"]["details"]["vs_ddp"]["bitwise_equal"]  # == DDP compiled the same way
    offloaded = [row for name, row in rows.items() if " opt " in name or "params+opt" in name]
    assert len(offloaded) == 4
    assert all(row["details"]["vs_no_offload"] for row in offloaded)


def _run_script(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
