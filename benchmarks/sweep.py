"""Model-state memory per rank against model size: DDP and ZeRO stages 1-3, measured next to the formulas.

    pip install matplotlib        # or: pip install -e .[bench]
    python benchmarks/sweep.py                                  # 5M, 25M, 100M, 200M; 2 gloo ranks
    python benchmarks/sweep.py --sizes 5e6,25e6 --out benchmarks/out/sweep.json --png docs/img/scaling_memory.png

For every size (``gpt_config_for_params`` of examples/gpt.py) and system (``ddp``, ``zero1``, ``zero2``,
``zero3``, built exactly as in bench_zero.py) the ranks build the model, run ONE AdamW training step (so the
optimizer state exists) and count the bytes of model states this rank holds: ZeRO ``engine.memory_report()``,
DDP params + grads + optimizer-state tensors. Next to it the ZeRO-paper formula for fp32 Adam: DDP 16Ψ,
stage 1 8Ψ+8Ψ/N, stage 2 4Ψ+12Ψ/N, stage 3 16Ψ/N. Only one system lives in a process at a time. Timing is
not the point here (one step, no warmup); the step time is recorded only as a rough size indication.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from zero_bench.launch import on_ranks
from zero_bench.report import environment, formula_bytes
from zero_bench.systems import build_system

from examples.gpt import count_params, gpt_config_for_params

SWEEP_SYSTEMS = ("ddp", "zero1", "zero2", "zero3")
COLORS = {"ddp": "#333333", "zero1": "#4c72b0", "zero2": "#dd8452", "zero3": "#55a868", "zero1_torch": "#8172b3"}


def sweep_rank(rank: int, world_size: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for size in args.sizes:
        cfg = gpt_config_for_params(int(size), vocab_size=256, block_size=args.block_size)
        psi = count_params(cfg)
        generator = torch.Generator().manual_seed(args.seed + rank)
        x = torch.randint(0, 256, (args.batch_size, args.block_size), generator=generator)
        y = torch.randint(0, 256, (args.batch_size, args.block_size), generator=generator)
        for name in args.systems:
            dist.barrier()
            start = time.perf_counter()
            system = build_system(name, cfg, args, None)
            built = time.perf_counter()
            system.step(x, y)
            done = time.perf_counter()
            local = sum(p.numel() for p in system.model.parameters() if p.requires_grad)  # stage 3: shards
            rows.append(
                {
                    "target": size,
                    "model": vars(cfg),
                    "system": name,
                    "rank": rank,
                    "psi": psi,
                    "local_param_numel": local,
                    "memory": system.memory(),
                    "build_s": built - start,
                    "step_s": done - built,
                }
            )
            del system
            gc.collect()
            if rank == 0:
                print(f"# {size:.0e} {name}: build {built - start:.1f} s, step {done - built:.1f} s", flush=True)
    return rows


def formula(name: str, psi: int, n: int) -> float:
    return formula_bytes(name, psi, n)


def summarize(rows: list[dict[str, Any]], world_size: int) -> list[dict[str, Any]]:
    """One entry per (size, system): the largest rank's total next to the formula."""
    out = []
    keys = list(dict.fromkeys((r["target"], r["system"]) for r in rows))
    for target, name in keys:
        ranks = [r for r in rows if r["target"] == target and r["system"] == name]
        psi = ranks[0]["psi"]
        totals = [sum(r["memory"].values()) for r in ranks]
        expected = formula(name, psi, world_size)
        out.append(
            {
                "target": target,
                "system": name,
                "psi": psi,
                "model": ranks[0]["model"],
                "per_rank": [r["memory"] for r in ranks],
                "total_max_rank": max(totals),
                "formula_bytes": expected,
                "measured_over_formula": max(totals) / expected,
                "step_s_max_rank": max(r["step_s"] for r in ranks),
                "build_s_max_rank": max(r["build_s"] for r in ranks),
            }
        )
    return out


def plot(results: list[dict[str, Any]], world_size: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    names = list(dict.fromkeys(r["system"] for r in results))
    psis = sorted({r["psi"] for r in results})
    grid = [psis[0] * (psis[-1] / psis[0]) ** (i / 50) for i in range(51)]
    for name in names:
        mine = sorted((r for r in results if r["system"] == name), key=lambda r: r["psi"])
        color = COLORS.get(name)
        ax.plot(
            [r["psi"] for r in mine],
            [r["total_max_rank"] / 2**20 for r in mine],
            "o",
            color=color,
            markersize=7,
            label=f"{name} measured",
        )
        ax.plot(grid, [formula(name, int(p), world_size) / 2**20 for p in grid], "--", color=color, lw=1.2)
    ax.plot([], [], "--", color="grey", label="formula (ZeRO paper), same colour")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("Ψ (trainable parameters)")
    ax.set_ylabel("model-state MiB per rank (largest rank)")
    ax.set_title(
        f"Model states per rank after one AdamW fp32 step, N={world_size} gloo ranks\n"
        "DDP 16Ψ, stage 1 8Ψ+8Ψ/N, stage 2 4Ψ+12Ψ/N, stage 3 16Ψ/N",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="5e6,25e6,100e6,200e6", help="target parameter counts, comma-separated")
    parser.add_argument("--systems", default=",".join(SWEEP_SYSTEMS))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank (memory, not speed, is measured)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default="benchmarks/out/sweep.json")
    parser.add_argument("--png", default="docs/img/scaling_memory.png")
    parser.add_argument("--replot", action="store_true", help="only redraw --png from an existing --out JSON")
    args = parser.parse_args(argv)
    args.sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replot:
        record = json.loads(Path(args.out).read_text())
        plot(record["results"], record["config"]["world_size"], Path(args.png))
        return
    started = time.perf_counter()
    ranks = on_ranks(sweep_rank, args)
    rows = [row for rank_rows in ranks for row in rank_rows]
    results = summarize(rows, args.world_size)
    print("| Ψ | system | measured MiB (max rank) | formula MiB | measured/formula | step s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['psi']:,} | {r['system']} | {r['total_max_rank'] / 2**20:.1f} | {r['formula_bytes'] / 2**20:.1f} "
            f"| {r['measured_over_formula']:.4f} | {r['step_s_max_rank']:.1f} |"
        )
    worst = max(results, key=lambda r: abs(r["measured_over_formula"] - 1))
    print(
        f"# max |measured/formula - 1| = {abs(worst['measured_over_formula'] - 1):.2e} "
        f"({worst['system']}, Ψ={worst['psi']:,})"
    )
    print(f"# total: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"config": vars(args), "environment": environment(), "results": results, "rows": rows},
            indent=2,
            default=str,
        )
    )
    plot(results, args.world_size, Path(args.png))
    print(f"# wrote {out} and {args.png}", file=sys.stderr)


if __name__ == "__main__":
    main()
