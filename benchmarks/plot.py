"""Plots of bench_zero.py results: step time vs DDP and per-rank model-state bytes, one PNG each per JSON.

    pip install matplotlib        # or: pip install -e .[bench]
    python benchmarks/plot.py benchmarks/out/all_25m.json --out-dir docs/img

For ``benchmarks/out/NAME.json`` it writes ``NAME_step_ratio.png`` (median step time / DDP's median, bars;
the paired ratio as a marker; min-max of the step times relative to DDP's median as an error bar) and
``NAME_memory.png`` (the largest rank's params / gradients / optimizer states stacked, the ZeRO-paper formula
as a tick) under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

MIB = 2**20
PARTS = (
    ("params", "params", "#4c72b0"),
    ("gradients", "gradients", "#dd8452"),
    ("optimizer_states", "optimizer states", "#55a868"),
)


def systems(summary: dict[str, Any]) -> list[str]:
    return [name for name in summary if not name.startswith("_")]


def title(record: dict[str, Any]) -> str:
    config, summary = record["config"], record["summary"]
    numel = summary[systems(summary)[0]]["numel"]
    rounds = summary.get("_rounds", {})
    used = len(rounds.get("used_rounds", []))
    noisy = "" if rounds.get("used_clean_only", True) else " (NOISY)"
    precision = "fp32 and bf16-mixed (*_bf16)" if any(n.endswith("_bf16") for n in systems(summary)) else "fp32"
    backend = "nccl" if config.get("device") == "cuda" else "gloo"
    return (
        f"GPT Ψ={numel / 1e6:.1f}M, N={config['world_size']} {backend} ranks, batch {config['batch_size']}x"
        f"{config['block_size']}, AdamW {precision}, {config.get('threads', 1)} thread/rank\n"
        f"{config['warmup']} warmup + {used} rounds used{noisy}, torch {record['environment'].get('torch', '?')}"
    )


def plot_ratio(record: dict[str, Any], path: Path) -> None:
    summary = record["summary"]
    names = systems(summary)
    if "ddp" not in summary:
        print(f"skip {path.name}: no ddp in the results")
        return
    base = summary["ddp"]["step_ms_median"]
    ratios = [summary[n]["step_ms_median"] / base for n in names]
    lows = [r - summary[n]["step_ms_min"] / base for n, r in zip(names, ratios, strict=True)]
    highs = [summary[n]["step_ms_max"] / base - r for n, r in zip(names, ratios, strict=True)]
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 3, 4.2))
    bars = ax.bar(names, ratios, color="#4c72b0", yerr=[lows, highs], capsize=4, ecolor="#888888")
    paired = [summary[n].get("paired_ratio_median", float("nan")) for n in names]
    ax.plot(names, paired, "D", color="#c44e52", label="paired ratio (median of per-round ratios)")
    for bar, ratio, high in zip(bars, ratios, highs, strict=True):
        ax.annotate(
            f"{ratio:.3f}x",
            (bar.get_x() + bar.get_width() / 2, ratio + high),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_ylabel("median step time / DDP's")
    ax.set_ylim(0, max(ratios + [r + h for r, h in zip(ratios, highs, strict=True)]) * 1.15)
    ax.set_title(title(record), fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.text(0.01, 0.98, f"ddp median: {base:.0f} ms/step; bars: min-max", transform=ax.transAxes, fontsize=8, va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_memory(record: dict[str, Any], path: Path) -> None:
    summary = record["summary"]
    names = systems(summary)
    fig, ax = plt.subplots(figsize=(1.3 * len(names) + 3, 4.2))
    bottoms = [0.0] * len(names)
    largest = [max(summary[n]["model_state_bytes_per_rank"], key=lambda m: sum(m.values())) for n in names]
    for key, label, color in PARTS:
        values = [m[key] / MIB for m in largest]
        ax.bar(names, values, bottom=bottoms, label=label, color=color)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    formula = [summary[n]["formula_bytes"] / MIB for n in names]
    ax.scatter(names, formula, marker="_", s=900, color="black", zorder=3, label="formula (ZeRO paper)")
    for i, n in enumerate(names):
        ax.annotate(
            f"{bottoms[i]:.0f} MiB\n({summary[n]['measured_over_formula']:.3f}x)",
            (i, bottoms[i]),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("model-state MiB per rank (largest rank)")
    ax.set_ylim(0, max(bottoms + formula) * 1.25)
    ax.set_title(title(record), fontsize=9)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", help="result files of bench_zero.py --out")
    parser.add_argument("--out-dir", default="docs/img")
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.json:
        record = json.loads(Path(name).read_text())
        stem = Path(name).stem
        for suffix, plot in (("step_ratio", plot_ratio), ("memory", plot_memory)):
            path = out_dir / f"{stem}_{suffix}.png"
            plot(record, path)
            if path.exists():
                print(path)


if __name__ == "__main__":
    main()
