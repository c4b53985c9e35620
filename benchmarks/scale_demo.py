"""The scale demo of ZeRO-Infinity-style offload: a GPT whose fp32 Adam state per rank is many times the memory a
rank may use, trained with ``ZeroStrategy(stage=3, offload_optimizer="nvme", offload_params="nvme")``.

Each rank caps its own anonymous memory with ``RLIMIT_DATA`` (no root needed) at what the process holds when
Lightning calls ``setup`` (the interpreter, torch, Lightning, the process group) plus ``--budget-mib``: everything
the model needs afterwards (building it unit by unit from the meta device, the gathered units, activations, the
paged optimizer steps) has to fit in the budget. The model is sized so that its fp32 Adam state per rank (master,
exp_avg and exp_avg_sq: 12 bytes an owned parameter) is at least ``--ratio`` times the budget. A control run of
the same model without offload, under the same cap, must fail (the cap bites). Results: a JSON file and a table.

Run (2 CPU ranks, about 5 minutes and 6 GB of disk here)::

    python benchmarks/scale_demo.py --nvme-path /tmp/lz-scale --out benchmarks/out/scale_demo.json

Figures are in docs/offload.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
ADAM_STATE_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq per owned parameter


def _status(field: str) -> int:
    """A ``/proc/self/status`` size in bytes (``VmData``, ``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def shape_for(budget: int, ratio: float, world_size: int, n_embd: int) -> dict[str, int]:
    """The GPT shape (width ``n_embd``, depth as needed) whose fp32 Adam state per rank is ``ratio`` x ``budget``."""
    sys.path.insert(0, str(REPO))
    from examples.gpt import GPTConfig, count_params

    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=n_embd // 64, n_embd=n_embd)
    n_layer = 1
    while ADAM_STATE_BYTES * count_params(cfg) / world_size < ratio * budget:
        n_layer += 1
        cfg.n_layer = n_layer
    return {"n_layer": n_layer, "n_head": cfg.n_head, "n_embd": n_embd, "params": count_params(cfg)}


def worker(args: argparse.Namespace) -> None:
    """One rank (started by torchrun): fit a few steps under the memory cap, write what it saw."""
    import lightning as L
    import torch

    sys.path.insert(0, str(REPO))
    from examples.gpt import Block, ByteDataModule, GPTLightningModule
    from lightning_zero import ZeroStrategy

    class Budget(L.Callback):
        """Cap the rank's anonymous memory when Lightning sets up (before the model exists); record each step."""

        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self.baseline = 0
            self.started = 0.0

        def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
            self.baseline = _status("VmData")
            limit = self.baseline + args.budget_mib * 2**20
            resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.RLIM_INFINITY))

        def on_train_batch_start(self, trainer: L.Trainer, *rest: Any) -> None:
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *rest: Any) -> None:
            engine = trainer.strategy._engine
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.steps.append(
                {
                    "loss": float(loss),
                    "seconds": time.perf_counter() - self.started,
                    "vm_data": _status("VmData") - self.baseline,
                    "rss": _status("VmRSS"),
                    "disk_read": engine.io_counts.read,
                    "disk_written": engine.io_counts.written,
                }
            )

    torch.manual_seed(0)
    offload = {"offload_optimizer": "nvme", "offload_params": "nvme", "nvme_path": args.nvme_path}
    strategy = ZeroStrategy(stage=3, activation_checkpointing={Block}, **(offload if not args.control else {}))
    budget = Budget()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.world_size,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[budget],
    )
    shape = json.loads(args.shape)
    model = GPTLightningModule(
        block_size=64,
        n_layer=shape["n_layer"],
        n_head=shape["n_head"],
        n_embd=shape["n_embd"],
        lr=args.lr,
        warmup_steps=args.steps,
    )
    data = ByteDataModule(block_size=64, batch_size=args.batch_size)
    result: dict[str, Any] = {"rank": trainer.global_rank}
    try:
        trainer.fit(model, datamodule=data)
    except (RuntimeError, MemoryError) as error:  # the control run: the cap bites
        result["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        result["traceback"] = traceback.format_exc()[-3000:]
    else:
        report = trainer.strategy.memory_report()
        result.update(
            offloaded=report.offloaded,
            resident_model_states=report.params + report.gradients + report.optimizer_states,
            vm_hwm=_status("VmHWM"),
        )
    result.update(baseline_vm_data=budget.baseline, steps=budget.steps)
    resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    Path(args.result_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    sys.exit(0)


def launch(args: argparse.Namespace, shape: dict[str, int], control: bool) -> list[dict[str, Any]]:
    """torchrun the workers; their results, by rank."""
    result_dir = tempfile.mkdtemp(prefix="lz-scale-results-")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world_size}",
        __file__, "--worker", "--result-dir", result_dir, "--shape", json.dumps(shape),
        "--budget-mib", str(args.budget_mib), "--steps", str(args.steps), "--lr", str(args.lr),
        "--batch-size", str(args.batch_size), "--nvme-path", args.nvme_path, "--world-size", str(args.world_size),
    ]  # fmt: skip
    if control:
        command.append("--control")
    # glibc's dynamic mmap threshold would keep freed page-sized blocks in the heap, counted by RLIMIT_DATA.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    results = []
    for rank in range(args.world_size):
        path = Path(result_dir, f"rank{rank}.json")
        if not path.exists():
            raise SystemExit(f"rank {rank} wrote no result (exit {run.returncode}):\n{run.stderr[-4000:]}")
        results.append({**json.loads(path.read_text()), "wall_seconds": elapsed})
    return results


def summarise(args: argparse.Namespace, shape: dict[str, int], runs: list[dict[str, Any]], control: list) -> dict:
    budget = args.budget_mib * 2**20
    state = ADAM_STATE_BYTES * shape["params"] / args.world_size
    steps = runs[0]["steps"]
    later = steps[1:] or steps
    per_step_read = (steps[-1]["disk_read"] - steps[0]["disk_read"]) / max(1, len(steps) - 1)
    per_step_written = (steps[-1]["disk_written"] - steps[0]["disk_written"]) / max(1, len(steps) - 1)
    return {
        "command": "python benchmarks/scale_demo.py " + " ".join(sys.argv[1:]),
        "world_size": args.world_size,
        "shape": shape,
        "budget_bytes_per_rank": budget,
        "baseline_vm_data_per_rank": [r["baseline_vm_data"] for r in runs],
        "adam_state_bytes_per_rank": state,
        "state_over_budget": state / budget,
        "params_per_gib_of_budget": shape["params"] / (args.world_size * budget / 2**30),
        "loss": [s["loss"] for s in steps],
        "step_seconds": [s["seconds"] for s in steps],
        "mean_step_seconds_after_first": sum(s["seconds"] for s in later) / len(later),
        "disk_read_per_step_per_rank": per_step_read,
        "disk_written_per_step_per_rank": per_step_written,
        "max_vm_data_over_baseline": max(s["vm_data"] for r in runs for s in r["steps"]),
        "vm_hwm_per_rank": [r.get("vm_hwm") for r in runs],
        "offloaded_per_rank": [r.get("offloaded") for r in runs],
        "resident_model_states_per_rank": [r.get("resident_model_states") for r in runs],
        "errors": [r["error"] for r in runs if "error" in r],
        "control_without_offload": [r.get("error", "completed") for r in control],
        "wall_seconds": runs[0]["wall_seconds"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mib", type=int, default=256, help="anonymous memory per rank above its baseline")
    parser.add_argument("--ratio", type=float, default=8.0, help="fp32 Adam state per rank / budget, at least")
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--nvme-path", default=tempfile.gettempdir())
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "scale_demo.json"))
    parser.add_argument("--no-control", action="store_true", help="skip the run without offload")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--control", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result-dir", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    shape = shape_for(args.budget_mib * 2**20, args.ratio, args.world_size, args.n_embd)
    print(f"GPT {shape}: fp32 Adam state {ADAM_STATE_BYTES * shape['params'] / args.world_size / 2**30:.2f} GiB a rank")
    control = [] if args.no_control else launch(args, shape, control=True)
    runs = launch(args, shape, control=False)
    summary = summarise(args, shape, runs, control)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "runs": runs, "control": control}, indent=1))
    print(json.dumps(summary, indent=1))
    if summary["errors"]:
        raise SystemExit(f"the offloaded run failed: {summary['errors']}")


if __name__ == "__main__":
    main()
