"""From the ranks' readings to the report: statistics over the clean rounds, the ZeRO paper's formula, the
markdown tables, and the record of the code and machine that were measured."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

from .names import OWNER, backend_for, base_system, device_type, is_bf16, offload_of, same_precision_ddp


def formula_bytes(name: str, numel: int, world_size: int) -> float:
    """Model-state bytes per rank for AdamW in the ZeRO paper's accounting (fp32; bf16-mixed: section 3.1)."""
    psi, n = numel, world_size
    target, params = offload_of(name)
    if target:  # what stays on the device: parameters and gradients (the master and AdamW states are offloaded)
        width = 2 if is_bf16(name) else 4
        stage = int(base_system(name)[4])
        on_device = 0 if params else (width * psi / n if stage == 3 else width * psi)
        return on_device + (width * psi / n if stage >= 2 else width * psi)
    base = base_system(name).replace("base", "zero").removesuffix(OWNER)  # a baseline core / owners: the stage
    if base.startswith("ddp"):  # ddp_bf16 too: fp32 parameters, gradients and AdamW states
        return 16 * psi
    if is_bf16(name):  # bf16 parameters (2) and gradients (2); fp32 master (4) and AdamW states (8)
        if base == "zero1":
            return 2 * psi + 2 * psi + 12 * psi / n
        if base == "zero2":
            return 2 * psi + 14 * psi / n
        return 16 * psi / n  # zero3_bf16; fsdp2_bf16, whose persistent states are fp32 shards (4 + 4 + 8)
    if base in ("zero1", "zero1_torch"):  # zero1_torch shards whole tensors: near, not exactly, 8Ψ/N
        return 4 * psi + 4 * psi + 8 * psi / n
    if base == "zero2":
        return 4 * psi + 12 * psi / n
    return 16 * psi / n  # zero3, fsdp2


def select_rounds(args: argparse.Namespace, load: list[float]) -> tuple[list[int], dict[str, Any]]:
    """The measured rounds the statistics use, and a description of the choice.

    Rounds in which other processes left the machine alone (at most ``--max-foreign`` of the CPUs), if there are
    enough of them; else every measured round (flagged by ``used_clean_only=False``).
    """
    measured = range(args.warmup, len(load))
    clean = [i for i in measured if load[i] <= args.max_foreign]
    rounds = clean if len(clean) >= max(3, args.steps // 2) else list(measured)
    info = {
        "foreign_share_per_round": load,
        "measured_rounds": len(measured),
        "clean_rounds": clean,
        "used_rounds": rounds,
        "used_clean_only": rounds == clean,
    }
    return rounds, info


def rounds_sentence(args: argparse.Namespace, rounds: dict[str, Any]) -> str:
    """How the statistics chose their rounds (see :func:`select_rounds`), for the report's header."""
    if rounds["used_clean_only"]:
        used, share = len(rounds["used_rounds"]), 100 * args.max_foreign
        return f"statistics over the {used} rounds in which other processes used <= {share:.0f}% of the CPUs."
    return f"statistics over all of them (only {len(rounds['clean_rounds'])} were free of other load: NOISY)."


def summarize(args: argparse.Namespace, timing: list[dict[str, Any]], rss: dict[str, dict[str, list]]) -> dict:
    names = list(args.systems)
    world = args.world_size
    tokens = args.batch_size * args.block_size * world  # tokens per optimizer step, all ranks
    rounds, rounds_info = select_rounds(args, timing[0]["load"])
    summary: dict[str, Any] = {"_rounds": rounds_info}
    for name in names:
        # A step lasts as long as its slowest rank; warmup rounds are dropped.
        per_step = [max(r["times"][name][i] for r in timing) for i in rounds]
        phase_names = timing[0]["phases"][name][0].keys()
        phases = {
            p: statistics.median(max(r["phases"][name][i][p] for r in timing) for i in rounds) for p in phase_names
        }
        info = timing[0]["systems"][name]
        memory = [r["systems"][name]["memory"] for r in timing]
        totals = [sum(m.values()) for m in memory]
        formula = formula_bytes(name, info["numel"], world)
        summary[name] = {
            "step_ms_median": 1e3 * statistics.median(per_step),
            "step_ms_min": 1e3 * min(per_step),
            "step_ms_max": 1e3 * max(per_step),
            "step_ms_all": [1e3 * t for t in per_step],
            "phase_ms_median": {p: 1e3 * v for p, v in phases.items()},
            "page_faults_per_step_median": statistics.median(
                max(r["page_faults"][name][i] for r in timing) for i in rounds
            ),
            "tokens_per_s": tokens / statistics.median(per_step),
            "model_state_bytes_per_rank": memory,
            "model_state_total_max_rank": max(totals),
            "formula_bytes": formula,
            "measured_over_formula": max(totals) / formula,
            "comm_bytes_per_step": [r["systems"][name]["comm_nbytes"] for r in timing],
            "comm_detail": info["comm_detail"],
            "owned_elements_max_min": info.get("owned_elements"),
            "max_rel_param_diff": max(r["systems"][name].get("max_rel_param_diff", float("nan")) for r in timing),
            "max_abs_param_diff": max(r["systems"][name].get("max_abs_param_diff", float("nan")) for r in timing),
            "bitwise_equal": all(r["systems"][name].get("bitwise_equal", False) for r in timing),
            "rel_l2_param_diff": max(r["systems"][name].get("rel_l2_param_diff", float("nan")) for r in timing),
            "param_diff_reference": info["param_diff_reference"],
            "precision": "bf16-mixed" if is_bf16(name) else "fp32",
            "numel": info["numel"],
            "rss": {variant: per_system[name] for variant, per_system in rss.items() if name in per_system},
        }
    if "ddp" in summary:
        for name in names:
            ratio, paired = step_ratios(summary, name, "ddp")
            summary[name]["ratio_to_ddp"] = ratio
            summary[name]["paired_ratio_median"] = paired
    for name in names:  # bf16 systems against ddp_bf16, fp32 ones against ddp (then the same as above)
        reference = same_precision_ddp(name)
        if reference in summary:
            ratio, paired = step_ratios(summary, name, reference)
            summary[name]["same_precision_ddp"] = reference
            summary[name]["ratio_to_same_precision_ddp"] = ratio
            summary[name]["paired_ratio_same_precision_ddp"] = paired
    return summary


def step_ratios(summary: dict[str, Any], name: str, reference: str) -> tuple[float, float]:
    """``name``'s median step / ``reference``'s, and the median over rounds of the ratio within each round."""
    ratio = summary[name]["step_ms_median"] / summary[reference]["step_ms_median"]
    # Robust to slow drifts of machine speed: the ratio within each round, then the median.
    paired = [a / b for a, b in zip(summary[name]["step_ms_all"], summary[reference]["step_ms_all"], strict=True)]
    return ratio, statistics.median(paired)


def diff_cell(name: str, s: dict[str, Any]) -> str:
    """The parameter-difference cell: against the same-precision DDP, else against ``ddp`` (said so)."""
    reference = s["param_diff_reference"]
    if name == reference:
        return "(reference)"
    cell = f"{s['max_rel_param_diff']:.1e}" + (" (bit-equal)" if s["bitwise_equal"] else "")
    if reference is not None and reference != same_precision_ddp(name):
        cell += f" (vs {reference}: {same_precision_ddp(name)} did not run)"
    return cell


def precision_text(names: list[str]) -> str:
    """Which systems train in which precision, for the header line."""
    groups = {
        "fp32": [name for name in names if not is_bf16(name)],
        "bf16-mixed": [name for name in names if is_bf16(name)],
    }
    return "; ".join(f"{label}: {', '.join(members)}" for label, members in groups.items() if members)


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def markdown(args: argparse.Namespace, summary: dict[str, Any], combined_rss: list[int], load: dict) -> str:
    names = [name for name in summary if not name.startswith("_")]
    rounds = summary["_rounds"]
    numel = summary[names[0]]["numel"]
    lines = [
        f"GPT {numel / 1e6:.2f}M trainable parameters (Ψ = {numel:,}), N = {args.world_size} {backend_for(args)} "
        f"ranks{' on cuda:0-' + str(args.world_size - 1) if device_type(args) == 'cuda' else ''}, "
        f"batch {args.batch_size} x block {args.block_size} per rank, AdamW, precision per system "
        f"({precision_text(names)}), "
        f"{args.warmup} warmup + {rounds['measured_rounds']} measured rounds of one step per system, interleaved; "
        + rounds_sentence(args, rounds),
        "",
        "| system | median step ms (min-max) | vs ddp | paired | vs same-precision ddp (paired) | tokens/s "
        "| params MiB | grads MiB | optim MiB | total MiB | formula MiB | measured/formula | comm MiB/step "
        "| max rel param diff vs same-precision ddp | rel L2 param diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for name in names:
        s = summary[name]
        mem = max(s["model_state_bytes_per_rank"], key=lambda m: sum(m.values()))
        same = (
            f"{s['ratio_to_same_precision_ddp']:.3f}x ({s['paired_ratio_same_precision_ddp']:.3f}x)"
            if "ratio_to_same_precision_ddp" in s
            else "-"
        )
        lines.append(
            f"| {name} | {s['step_ms_median']:.0f} ({s['step_ms_min']:.0f}-{s['step_ms_max']:.0f}) "
            f"| {s.get('ratio_to_ddp', nan):.3f}x | {s.get('paired_ratio_median', nan):.3f}x "
            f"| {same} "
            f"| {s['tokens_per_s']:.0f} "
            f"| {mib(mem['params'])} | {mib(mem['gradients'])} | {mib(mem['optimizer_states'])} "
            f"| {mib(s['model_state_total_max_rank'])} | {mib(s['formula_bytes'])} | {s['measured_over_formula']:.4f} "
            f"| {mib(max(s['comm_bytes_per_step']))} | {diff_cell(name, s)} "
            f"| {'-' if name == s['param_diff_reference'] else format(s['rel_l2_param_diff'], '.1e')} |"
        )
    lines += [
        "",
        "vs ddp = median step / ddp's median step; paired = median over rounds of step / ddp's step in the same "
        "round; vs same-precision ddp: the same against ddp_bf16 for the bf16-mixed systems (against ddp for the fp32 "
        f"ones). Other processes used {load['foreign_cpu_s']:.0f} CPU-s during the {load['wall_s']:.0f} s timing "
        f"run ({100 * load['foreign_share']:.0f}% of the machine). Param diffs after the run: max rel = the largest "
        "max|a - b| / max|b| of any tensor (zero-initialised biases dominate it once results are not bit-equal); "
        "rel L2 = ||a - b|| / ||b|| over all parameters.",
    ]
    if any(is_bf16(name) for name in names):
        lines += [
            "",
            "bf16-mixed: the forward and loss under bf16 autocast; gradients reduced in fp32; AdamW updates fp32 "
            'values. ddp_bf16: fp32 parameters and gradients (Lightning\'s DDP with precision="bf16-mixed"); '
            "zero*_bf16: bf16 parameters and gradients and fp32 master shards, counted under optim "
            "(PrecisionPolicy(bf16, fp32, fp32)); fsdp2_bf16: fp32 shards gathered in bf16 "
            "(MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)). Their parameters after the run "
            "(ZeRO: the fp32 masters) are compared with ddp_bf16's.",
        ]
    lines += ["", "Median phase times per step (ms, slowest rank):", ""]
    phase_names = list(dict.fromkeys(p for name in names for p in summary[name]["phase_ms_median"]))
    lines += [
        "| system | " + " | ".join(phase_names) + " | minor page faults per step (MiB touched fresh) |",
        "|---|" + "---|" * (len(phase_names) + 1),
    ]
    for name in names:
        values = summary[name]["phase_ms_median"]
        faults = summary[name]["page_faults_per_step_median"]
        cells = [f"{values[p]:.1f}" if p in values else "-" for p in phase_names]
        cells.append(f"{faults:.0f} ({faults * os.sysconf('SC_PAGE_SIZE') / 2**20:.0f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += rss_table(args, summary, names)
    lines += [
        "",
        f"Peak RSS of the timing run (all systems live in each process): "
        f"{' / '.join(mib(b) for b in combined_rss)} MiB per rank.",
        "Comm: ZeRO = engine.last_step_comm.nbytes; DDP = 2 x 4Ψ (its fp32 gradient all-reduce, counted as in "
        "[Note: counting communication] of lightning_zero/core/comm/stats.py; ddp_bf16 too); FSDP2 not "
        "measured: "
        "3 x 4Ψ (fsdp2_bf16: 2Ψ + 2Ψ + 4Ψ, the bf16 all-gathers and the fp32 reduce-scatter).",
    ]
    return "\n".join(lines)


def rss_table(args: argparse.Namespace, summary: dict[str, Any], names: list[str]) -> list[str]:
    """Markdown lines: peak RSS per system and malloc variant, next to the model-state bytes."""
    rows = [(name, variant, summary[name]["rss"][variant]) for name in names for variant in summary[name]["rss"]]
    if not rows:
        return []
    gpu = device_type(args) == "cuda"  # the peak accelerator memory of the same runs, in one more column
    lines = [
        "",
        f"RSS per rank, MiB (rank 0 / rank 1): one system per process, {args.rss_steps} steps; baseline = RSS "
        "after imports and data, before the model is built; model states = params + grads + optimizer states "
        "counted from the tensors" + ("; GPU peak = torch.cuda.max_memory_allocated over the run" if gpu else "") + ":",
        "",
        "| system | malloc | peak (ru_maxrss) | peak - baseline | after the last step - baseline | model states |"
        + (" GPU peak MiB |" if gpu else ""),
        "|---|---|---|---|---|---|" + ("---|" if gpu else ""),
    ]
    for name, variant, ranks in rows:
        states = max(sum(m.values()) for m in summary[name]["model_state_bytes_per_rank"])
        lines.append(
            f"| {name} | {variant} | {' / '.join(mib(r['peak_rss']) for r in ranks)} "
            f"| {' / '.join(mib(r['peak_rss'] - r['baseline_rss']) for r in ranks)} "
            f"| {' / '.join(mib(r['end_rss'] - r['baseline_rss']) for r in ranks)} | {mib(states)} |"
            + (f" {' / '.join(mib(r['peak_accelerator']) for r in ranks)} |" if gpu else "")
        )
    lines += [
        "",
        "malloc as-is: the environment unchanged (glibc's dynamic mmap threshold); mmap64k: "
        "`MALLOC_MMAP_THRESHOLD_=65536` in the ranks' environment, so freed large blocks go back to the system.",
    ]
    return lines


def code_version() -> dict[str, Any]:
    """Which lightning_zero was measured: its path, a hash of its sources, and git's view where there is one."""
    import hashlib
    import subprocess

    import lightning_zero

    package = Path(lightning_zero.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    version: dict[str, Any] = {"lightning_zero_path": str(package), "lightning_zero_sha256": digest.hexdigest()[:16]}
    try:
        git = ["git", "-C", str(package.parent)]
        version["git_commit"] = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", str(package)], capture_output=True, text=True, check=True
        ).stdout.split("\n")
        version["lightning_zero_uncommitted"] = [line[3:] for line in dirty if line.strip()]
    except (OSError, subprocess.CalledProcessError):
        version["git_commit"] = None
    return version


def environment() -> dict[str, Any]:
    import lightning

    return {
        **code_version(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "malloc_mmap_threshold_env": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        **gpus(),
    }


def gpus() -> dict[str, Any]:
    """The GPUs and CUDA of this machine, where there are any (nothing on a CPU-only one)."""
    if not torch.cuda.is_available():
        return {}
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"cuda": torch.version.cuda, "gpus": names}
