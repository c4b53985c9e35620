"""Benchmark: DDP, lightning-zero stages 1-3 and FSDP2 on one GPT, fp32 and bf16-mixed, in one run, interleaved.

Run on demand (never from the tests), from the repository root with the package installed::

    python benchmarks/bench_zero.py                        # ~25M-parameter GPT, 2 gloo ranks
    python benchmarks/bench_zero.py --out benchmarks/out/zero.json
    python benchmarks/bench_zero.py --params 5e6 --steps 5 --warmup 2 --rss-steps 2   # quick smoke run
    python benchmarks/bench_zero.py --systems ddp,zero2,ddp_bf16,zero2_bf16,zero3_bf16,fsdp2_bf16
    python benchmarks/bench_zero.py --device cuda          # NCCL, rank r on cuda:r (NOT RUN YET, see below)

What it does
------------
1. **Timing run.** ``--world-size`` processes are spawned once (``torch.multiprocessing``, gloo, one
   torch thread each). Every rank builds every system in ``--systems`` from the same seed, so all
   start from identical weights, and draws one fixed stream of batches (seed + rank) that every
   system trains on. The systems are *interleaved*: step ``i`` of every system runs in round ``i``,
   and the order inside a round rotates, so machine noise hits all of them alike. Each timed step
   starts after a barrier; a step's time is the slowest rank's. AdamW, in the precision of each system
   (fp32, or bf16-mixed for the ``*_bf16`` systems). The core
   :class:`~lightning_zero.core.engine.ZeroEngine` is driven directly in a plain PyTorch loop (no
   Trainer), so the numbers measure the sharding, not Lightning.
2. **Shared machines.** After each round the ranks compare the machine's busy CPU time
   (``/proc/stat``) with their own: a round in which other processes used more than
   ``--max-foreign`` of the CPUs is *disturbed*. Rounds go on until ``--steps`` undisturbed ones were
   measured (at most ``--max-rounds``), and the statistics use only those when there are enough
   (else all rounds, flagged NOISY in the output).
3. **RSS runs.** Peak RSS (``ru_maxrss``) is per process, so it cannot be split between systems that
   share one. For each system the ranks are spawned again, build only that system and run
   ``--rss-steps`` steps; this is done once with the environment as is and once with
   ``MALLOC_MMAP_THRESHOLD_=65536``. A fixed glibc mmap threshold turns off glibc's dynamic threshold,
   which otherwise (after the first free of a large block) serves blocks of up to 32 MiB from the
   heap, where freed memory may stay resident: with it the peak follows live memory instead of the
   allocator's history. Both variants are reported (``--rss-variants``).

Systems, fp32: ``ddp`` (``DistributedDataParallel``, ``gradient_as_bucket_view=True``: gradients live in
its buckets, 16Ψ bytes of model states), ``ddp_copy`` (DDP defaults: a separate bucket copy of the
gradients, 4Ψ more that the tensor count does not see), ``zero1``, ``zero2``, ``zero3``, ``fsdp2``, and
``zero1_torch`` (DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer`` over AdamW, PyTorch's stage 1).

Systems with whole-tensor owners (``partition="parameter"``): ``zero1_owner``-``zero3_owner`` and their
``_bf16`` variants; the summary adds the trained elements of the most and least loaded rank
(``owned_elements_max_min``); their formula is the flat one (the most loaded rank's excess is the imbalance).

Systems, bf16-mixed (forward and loss under ``torch.autocast(dtype=torch.bfloat16)``, gradients reduced
in fp32, AdamW updating fp32 values): ``ddp_bf16`` (as ``ddp``, with fp32 parameters: what Lightning's
DDP does for ``precision="bf16-mixed"``; 16Ψ), ``zero1_bf16``, ``zero2_bf16``, ``zero3_bf16`` (the
engine with ``PrecisionPolicy(torch.bfloat16, torch.float32, torch.float32)``: bf16 parameters and
gradients, fp32 master shards; ``prepare_step`` makes the masters' fp32 gradients) and ``fsdp2_bf16``
(``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``:
fp32 shards, gathered in bf16). Each system is compared with the DDP of its own precision: step-time
ratios with ``ddp_bf16`` (and, as for every system, with ``ddp``), final parameters with ``ddp_bf16``
(with ``ddp``, said so, if ``ddp_bf16`` is not in the run). ZeRO's parameters there are its fp32
masters (``engine.full_state_dict(keep=True)``). ``ddp_bf16`` is not the same maths as ``zero*_bf16``
either: its LayerNorms, embeddings and residual stream stay in fp32, theirs hold bf16 parameters; so
only the zero*_bf16 systems are bit-equal among themselves.

Reported per system: median step time, its ratio to ``ddp``'s median and the median of the per-round
ratios, the same two against the same-precision DDP, tokens/s, per-phase times and minor page faults
per step, per-rank model-state bytes counted from the tensors (ZeRO: ``engine.memory_report()``, which
counts the fp32 masters under optimizer states; DDP and FSDP2: param + grad + optimizer-state bytes),
the ZeRO-paper formula (fp32 Adam: DDP 16Ψ, stage 1 4Ψ+4Ψ+8Ψ/N, stage 2 4Ψ+12Ψ/N, stage 3 and FSDP2
16Ψ/N; bf16-mixed, section 3.1: DDP 16Ψ, stage 1 4Ψ+12Ψ/N, stage 2 2Ψ+14Ψ/N, stage 3 16Ψ/N, FSDP2's
fp32 shards 16Ψ/N; Ψ trainable parameters, N ranks) and measured/formula, bytes moved by collectives
per step (ZeRO: ``engine.last_step_comm.nbytes``; DDP, ``ddp_bf16`` too: 2 x 4Ψ, the all-reduce of the
fp32 gradients counted as in [Note: counting communication] of ``core/comm/stats.py``; FSDP2,
not measured: 3 x 4Ψ, bf16 2Ψ + 2Ψ + 4Ψ), RSS per rank (peak, and after the last step) and, after the
run, the largest per-tensor relative parameter difference and the relative L2 difference of all
parameters from the same-precision DDP. See docs/benchmarks.md for results.

GPUs (``--device cuda``; NOT RUN YET: written and read, never executed, as no GPU was at hand): NCCL for
the world group and every per-system group, ``torch.cuda.set_device(rank)`` before it starts, models and
batches on ``cuda:{rank}`` (one node, a GPU per rank), ``torch.cuda.synchronize()`` before every reading of
the clock in a step (so step and phase times include the GPU work), FSDP2's mesh and autocast on
``"cuda"``, and the RSS runs also report ``torch.cuda.max_memory_allocated()`` (reset before the system is
built) as the GPU peak. The ``/proc/stat`` filter still measures the CPUs. All of it lives in the device
helpers of ``zero_bench/names.py`` (``device_for``, ``backend_for``, ``sync``, ``now``, ...) and in the launcher
(``tests/helpers.py``), which binds rank ``r`` to ``cuda:r``; with ``--device cpu`` (the default) they change nothing.

Layout: this file is the command line (``parse_args``, ``main``); ``zero_bench/`` holds the rest, one concern a
module: ``names`` (what a system's name encodes, devices), ``systems`` (how each system is built and stepped),
``launch`` (the ranks, through the shared launcher), ``measure`` (the rank bodies, load, RSS, disk) and ``report``
(statistics, formula, tables, environment). ``sweep.py``, ``phase_memory.py``, ``bench_deepspeed.py`` and
``gpu_check.py`` import those modules.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from zero_bench.launch import on_ranks  # importing zero_bench puts the repository root on sys.path
from zero_bench.measure import disk_bandwidth, machine_busy_s, model_config, own_cpu_s, rss_rank, timing_rank
from zero_bench.names import BACKENDS, FUSED_ENV, RSS_VARIANTS, SYSTEMS, offload_of
from zero_bench.report import environment, markdown, summarize

from examples.gpt import DEFAULT_DATA


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=25e6, help="target parameter count of the GPT")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per system (clean rounds wanted)")
    parser.add_argument(
        "--max-rounds", type=int, help="measure at most this many rounds while waiting for clean ones (2 x --steps)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per system before those")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--device",
        choices=sorted(BACKENDS),
        default="cpu",
        help="cpu: gloo ranks; cuda: NCCL ranks, rank r on cuda:r (one node; not run yet)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--systems", default="ddp,zero1,zero2", help=f"comma-separated, from {','.join(SYSTEMS)}")
    parser.add_argument("--rss-variants", default="as-is,mmap64k", help="comma-separated from as-is,mmap64k; '' = none")
    parser.add_argument("--rss-steps", type=int, default=3, help="steps per system in each RSS run")
    parser.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP and ZeRO bucket size")
    parser.add_argument(
        "--max-foreign",
        type=float,
        default=0.05,
        help="rounds in which other processes used more than this share of the CPUs are left out of the statistics",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--nvme-path", default=tempfile.gettempdir(), help="swap directory of the *_nvme systems")
    parser.add_argument(
        "--adamw-fused", action="store_true", help="every system's AdamW with fused=True (offload picks it anyway)"
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--out", help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    if args.adamw_fused:
        os.environ[FUSED_ENV] = "1"  # read by make_adamw in every spawned rank
    args.max_rounds = args.max_rounds or 2 * args.steps
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.rss_variants = [v.strip() for v in args.rss_variants.split(",") if v.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS] + [v for v in args.rss_variants if v not in RSS_VARIANTS]
    if unknown:
        parser.error(f"unknown systems or RSS variants {unknown}; systems: {SYSTEMS}, variants: {list(RSS_VARIANTS)}")
    if len(set(args.systems)) != len(args.systems) or not args.systems:
        parser.error("--systems needs distinct names")
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        parser.error(f"--device cuda needs a GPU per rank: {torch.cuda.device_count()} GPUs, {args.world_size} ranks")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("MKL_NUM_THREADS", str(args.threads))
    cfg = model_config(args)
    print(f"# {cfg} | {environment()}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    busy_before, own_before = machine_busy_s(), own_cpu_s()
    timing = on_ranks(timing_rank, args)
    wall = time.perf_counter() - started
    # CPU time that other processes took from this machine during the timing run (children's time
    # counts once they have been joined, as they are by now).
    foreign = (machine_busy_s() - busy_before) - (own_cpu_s() - own_before)
    load = {"wall_s": wall, "foreign_cpu_s": foreign, "foreign_share": foreign / (wall * (os.cpu_count() or 1))}
    print(f"# timing run: {wall:.0f} s, foreign CPU {foreign:.1f} s", file=sys.stderr, flush=True)
    rss: dict[str, dict[str, list]] = {}
    for variant in args.rss_variants:
        rss[variant] = {}
        for name in args.systems:
            t = time.perf_counter()
            rss[variant][name] = on_ranks(rss_rank, args, name, env=RSS_VARIANTS[variant])
            print(f"# rss run {variant}/{name}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    summary = summarize(args, timing, rss)
    if any(offload_of(name)[0] == "nvme" for name in args.systems):
        summary["_disk"] = disk_bandwidth(args.nvme_path)
        print(f"# disk behind --nvme-path: {summary['_disk']}", file=sys.stderr, flush=True)
    combined = [r["combined_peak_rss"] for r in timing]
    print(markdown(args, summary, combined, load))
    print(f"# total: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            "model": vars(cfg),
            "environment": environment(),
            "summary": summary,
            "combined_peak_rss_per_rank": combined,
            "timing_run_load": load,
            "wall_s": time.perf_counter() - started,
        }
        out.write_text(json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    main()
