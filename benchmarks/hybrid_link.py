"""Hybrid sharding over a slow link: 2 "nodes" x 2 processes, the nodes joined by one throttled network link.

Run on demand (never from the tests), as root (it creates network namespaces), from the repository root::

    python benchmarks/hybrid_link.py                       # --rate 500mbit, ~12M-parameter GPT
    python benchmarks/hybrid_link.py --rate off --json /tmp/hybrid_off.json   # the same, link not throttled
    python benchmarks/hybrid_link.py --systems zero3,zero3_hybrid --steps 3 --warmup 1   # quick
    python benchmarks/hybrid_link.py --systems zero3,zero3_qw,zero3_qg,zero3_hp,zero3_pp,zero3_hybrid,fsdp2,fsdp2_hsdp

What it does
------------
``tests/netns.py`` builds two hosts (network namespaces ``node0``, ``node1``) joined by a veth pair, and
``HostPair.throttle`` shapes both directions of that link with a token bucket at ``--rate``. Four gloo ranks
run, ranks 0 and 1 on ``node0`` and ranks 2 and 3 on ``node1``, with ``GLOO_SOCKET_IFNAME`` set to the link's
interface: every rank's gloo endpoint is its node's address on the link. Traffic between the two ranks of one node
goes to the node's own address, which the kernel delivers through the node's loopback: it never crosses the link
and is not throttled, as on a cluster where the processes of a node talk over shared memory or NVLink and only
what goes to the other node crosses the (slower) network. The link's byte counters therefore count exactly the
traffic between the nodes.

Every rank builds every system in ``--systems`` from the same seed (a GPT of about ``--params`` parameters, fp32,
AdamW) and trains them interleaved, one step of each per round, the order rotating between rounds. Each step
sits between barriers; its time is the slowest rank's, its link bytes those the link's ``node0`` end received
and sent (``HostPair.link_bytes``) between a reading before the step and one after it, less the bytes of one
barrier (measured at the start). The table gives per system the median step time of the ``--steps`` measured
rounds (after ``--warmup``), its ratio to flat stage 3's (``zero3``), the MiB across the link per step (both
directions) and the link-bound floor: the busier direction's bytes at ``--rate``, the least time the step can
take on that link.

Systems: ``ddp`` (``DistributedDataParallel``), ``fsdp2`` (``fully_shard`` per block over all 4 ranks),
``fsdp2_hsdp`` (``fully_shard`` over a 2-D mesh, sharded inside a node, replicated across nodes), ``zero2``,
``zero3`` (the engine, flat shards over all 4 ranks), ``zero3_hybrid`` (and, not by default, ``zero2_hybrid``):
the engine with ``EngineOptions(stage=3, shard_size=--shard-size)``; the ZeRO++ systems of flat stage 3:
``zero3_qw`` (``quantize_weights``), ``zero3_qg`` (``quantize_gradients``), ``zero3_hp`` (``secondary_shard_size=
--shard-size``) and ``zero3_pp`` (all three). A system that cannot be built on this
checkout (a core without ``shard_size``) is reported as ``unavailable: <error>`` and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from zero_bench.hybrid import DEFAULT_SYSTEMS, HYBRID_SYSTEMS, REFERENCE, build_hybrid_system
from zero_bench.measure import batch_stream, model_config
from zero_bench.systems import System

from examples.gpt import DEFAULT_DATA, GPTConfig, count_params
from tests.netns import INTERFACE, Host, HostPair, network_hosts, unavailable_reason, wait_all

DEFAULT_RATE = "500mbit"
NODES, PER_NODE = 2, 2
PORT = 29500
MIB = 2**20
_RATE = re.compile(r"(?P<value>\d+(?:\.\d+)?)(?P<unit>[kmgt]?)bit", re.IGNORECASE)
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_LAUNCH_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "GLOO_SOCKET_IFNAME",
)
_BARRIER_PROBES = 20


def rate_bits_per_s(rate: str) -> float | None:
    """``"500mbit"`` -> 5e8 (tc's decimal units); ``"off"`` -> ``None`` (the link not throttled)."""
    if rate == "off":
        return None
    match = _RATE.fullmatch(rate.strip())
    if match is None:
        raise ValueError(f"--rate {rate!r} is not a rate in bits/s like '200mbit', '1gbit' or 'off'")
    return float(match["value"]) * _UNITS[match["unit"].lower()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default=DEFAULT_RATE, help="the link's rate each way (tc syntax), or 'off'")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated, from {HYBRID_SYSTEMS}")
    parser.add_argument("--params", type=float, default=12e6, help="target parameter count of the GPT")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per system")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps per system before those")
    parser.add_argument("--shard-size", type=int, default=PER_NODE, help="ranks per shard group of the hybrids")
    parser.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP and ZeRO bucket size")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--timeout-s", type=float, default=900, help="the whole run's deadline")
    parser.add_argument("--json", help="also write the results as JSON to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a rank: its output directory
    parser.add_argument("--link-namespace", help=argparse.SUPPRESS)  # a rank: node0's namespace
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in HYBRID_SYSTEMS]
    if unknown or not args.systems or len(set(args.systems)) != len(args.systems):
        parser.error(f"--systems needs distinct names from {HYBRID_SYSTEMS}, got {args.systems}")
    try:
        args.rate_bits = rate_bits_per_s(args.rate)
    except ValueError as error:
        parser.error(str(error))
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be at least 1 (the first step of a system is its availability check)")
    if (NODES * PER_NODE) % args.shard_size:
        parser.error(f"--shard-size {args.shard_size} does not divide the world size {NODES * PER_NODE}")
    return args


# ----------------------------------------------------------------------------- the ranks


def _agree(error: str | None) -> str | None:
    """The first rank's error among all ranks' (a collective), ``None`` if every rank succeeded."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"rank {rank}: {e}" for rank, e in enumerate(errors) if e is not None), None)


def _attempt(fn: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
    """``fn(*args)`` and ``None``, or ``None`` and the error's first line."""
    try:
        return fn(*args), None
    except Exception as error:  # reported as the system's row; every rank agrees before going on
        return None, f"{type(error).__name__}: {error}".splitlines()[0][:300]


class _LinkCounter:
    """Rank 0's reading of the link's bytes at node0's end (received + sent = all that crossed the link); the
    other ranks read zeros."""

    def __init__(self, namespace: str | None) -> None:
        self.pair = HostPair((Host(namespace, "node0", ""), Host(namespace, "node1", ""))) if namespace else None

    def read(self) -> tuple[int, int]:
        return self.pair.link_bytes(self.pair.hosts[0]) if self.pair else (0, 0)


def _barrier_bytes(counter: _LinkCounter) -> tuple[float, float]:
    """(received, sent) link bytes of one barrier, averaged over a few."""
    dist.barrier()
    before = counter.read()
    for _ in range(_BARRIER_PROBES):
        dist.barrier()
    after = counter.read()
    return (after[0] - before[0]) / _BARRIER_PROBES, (after[1] - before[1]) / _BARRIER_PROBES


def _build(args: argparse.Namespace, cfg: GPTConfig) -> tuple[dict[str, System], dict[str, dict[str, Any]]]:
    """The systems every rank could build, and an ``unavailable`` row for each of the others."""
    systems, rows = {}, {}
    for name in args.systems:
        system, error = _attempt(build_hybrid_system, name, cfg, args)
        error = _agree(error)
        if error is None:
            systems[name] = system
        else:
            rows[name] = {"status": f"unavailable: {error}"}
    return systems, rows


def _measured_step(
    system: System, x: Tensor, y: Tensor, counter: _LinkCounter, barrier: tuple[float, float]
) -> tuple[float, list[float], str | None]:
    """One step between barriers: its seconds on this rank, the link bytes (rx, tx) less the two barriers inside
    the reading, and the error that stopped it (``None``: none)."""
    dist.barrier()
    before = counter.read()
    dist.barrier()
    start = time.perf_counter()
    _, error = _attempt(system.step, x, y)
    elapsed = time.perf_counter() - start
    if error is not None:
        return elapsed, [], error
    dist.barrier()
    after = counter.read()
    return elapsed, [a - b - 2 * c for a, b, c in zip(after, before, barrier, strict=True)], None


def rank_main(args: argparse.Namespace) -> None:
    """One rank: build the systems, step them interleaved, and (rank 0) write the result to ``--worker``."""
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    counter = _LinkCounter(args.link_namespace if rank == 0 else None)
    barrier = _barrier_bytes(counter)
    cfg = model_config(args)
    batches = batch_stream(args, rank)
    systems, rows = _build(args, cfg)
    times: dict[str, list[float]] = {name: [] for name in systems}
    link: dict[str, list[list[float]]] = {name: [] for name in systems}
    for index in range(args.warmup + args.steps):
        x, y = next(batches)
        names = list(systems)
        if not names:
            break
        for name in names[index % len(names) :] + names[: index % len(names)]:  # the order rotates every round
            elapsed, nbytes, error = _measured_step(systems[name], x, y, counter, barrier)
            if index == 0 and (error := _agree(error)) is not None:  # a system's first step may fail on this core
                rows[name] = {"status": f"unavailable: {error}"}
                del systems[name]
            elif error is not None:  # the others wait in a collective: fail the run
                raise RuntimeError(f"{name} failed after its first step: {error}")
            elif index >= args.warmup:
                times[name].append(elapsed)
                link[name].append(nbytes)
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, times)
    for name, system in systems.items():
        rows[name] = {
            "status": "ok",
            "step_s": [max(ranks[name][i] for ranks in per_rank) for i in range(args.steps)],  # the slowest rank's
            "link_rx_tx_bytes": link[name],
            "engine_nbytes": (getattr(system, "last_comm", None) or {}).get("nbytes"),
        }
    if rank == 0:
        result = {"rows": rows, "barrier_rx_tx_bytes": barrier, "model": vars(cfg), "numel": count_params(cfg)}
        (Path(args.worker) / "result.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the run


def _rank_env(rank: int, host: Host, master: Host) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    repo = str(Path(__file__).resolve().parent.parent)
    env.update(
        MASTER_ADDR=master.address,
        MASTER_PORT=str(PORT),
        RANK=str(rank),
        LOCAL_RANK=str(rank % PER_NODE),
        LOCAL_WORLD_SIZE=str(PER_NODE),
        NODE_RANK=str(rank // PER_NODE),
        WORLD_SIZE=str(NODES * PER_NODE),
        GLOO_SOCKET_IFNAME=host.interface,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")])),
    )
    return env


def run(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Start the 4 ranks on the two hosts, with the link throttled, and return rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="hybrid_link_") as out, network_hosts() as pair:
        node0, _ = pair.hosts
        throttle = pair.throttle(args.rate) if args.rate_bits is not None else contextlib.nullcontext()
        with throttle:
            processes, logs = [], []
            for rank in range(NODES * PER_NODE):
                host = pair.hosts[rank // PER_NODE]
                log_path = Path(out) / f"rank{rank}.log"
                logs.append(log_path)
                command = [sys.executable, __file__, *argv, "--worker", out, "--link-namespace", node0.namespace]
                with log_path.open("wb") as log:
                    processes.append(
                        pair.popen(host, command, env=_rank_env(rank, host, node0), cwd=Path.cwd(), log=log)
                    )
            codes = wait_all(processes, args.timeout_s)
            if any(code != 0 for code in codes):
                tails = "\n".join(
                    f"--- rank {r} (exit {c}):\n{p.read_text(errors='replace')[-3000:]}"
                    for r, (p, c) in enumerate(zip(logs, codes, strict=True))
                )
                raise SystemExit(f"the ranks failed (exit codes {codes}):\n{tails}")
            return json.loads((Path(out) / "result.json").read_text())


def summarize(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    """Per system: median step ms, ratio to flat stage 3, MiB across the link per step, link-bound floor."""
    rows = result["rows"]
    reference = rows.get(REFERENCE, {})
    ref_ms = statistics.median(reference["step_s"]) * 1e3 if reference.get("status") == "ok" else None
    summary = {}
    for name in args.systems:
        row = rows[name]
        if row["status"] != "ok":
            summary[name] = {"status": row["status"]}
            continue
        step_ms = statistics.median(row["step_s"]) * 1e3
        rx = statistics.median(r for r, _ in row["link_rx_tx_bytes"])
        tx = statistics.median(t for _, t in row["link_rx_tx_bytes"])
        floor = max(rx, tx) * 8 / args.rate_bits * 1e3 if args.rate_bits else None
        summary[name] = {
            "status": "ok",
            "step_ms_median": step_ms,
            "step_ms": [s * 1e3 for s in row["step_s"]],
            "ratio_to_zero3": step_ms / ref_ms if ref_ms else None,
            "link_mib_per_step": (rx + tx) / MIB,
            "link_rx_tx_mib_per_step": [rx / MIB, tx / MIB],
            "link_floor_ms": floor,
            "engine_nbytes_per_rank": row.get("engine_nbytes"),
        }
    return summary


def markdown(args: argparse.Namespace, summary: dict[str, Any]) -> str:
    lines = [
        f"link rate: {args.rate} each way; ratio: step time / {REFERENCE}'s; link MiB: both directions per step; "
        "floor: the busier direction's bytes at the link rate",
        "",
        "| system | step ms (median) | ratio to zero3 | MiB across link / step | link floor ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in summary.items():
        if row["status"] != "ok":
            lines.append(f"| {name} | {row['status']} | | | |")
            continue
        ratio = f"{row['ratio_to_zero3']:.2f}" if row["ratio_to_zero3"] else "n/a"
        floor = f"{row['link_floor_ms']:.0f}" if row["link_floor_ms"] is not None else "n/a"
        lines.append(f"| {name} | {row['step_ms_median']:.0f} | {ratio} | {row['link_mib_per_step']:.1f} | {floor} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        rank_main(args)
        return
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"hybrid_link.py needs two network namespaces: {reason}")
    started = time.perf_counter()
    result = run(args, argv)
    summary = summarize(args, result)
    wall = time.perf_counter() - started
    model = f"GPT {result['numel'] / 1e6:.1f}M parameters {result['model']}"
    print(f"# {model}, {NODES}x{PER_NODE} gloo ranks over {INTERFACE}; {wall:.0f} s", file=sys.stderr, flush=True)
    print(markdown(args, summary))
    if args.json:
        record = {
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "worker", "link_namespace")},
            "model": result["model"],
            "numel": result["numel"],
            "barrier_rx_tx_bytes": result["barrier_rx_tx_bytes"],
            "summary": summary,
            "torch": torch.__version__,
            "wall_s": wall,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
