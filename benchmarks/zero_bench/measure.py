"""What the ranks measure: the data they train on, the bodies of the timing and RSS runs, and the machine's load.

``timing_rank`` trains every system interleaved and reads step times, page faults and the CPU time other
processes took; ``rss_rank`` runs one system alone for its peak RSS. ``disk_bandwidth`` reads what the
``*_nvme`` systems' swap directory can do.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from examples.gpt import GPTConfig, gpt_config_for_params

from .names import BF16, accelerator_bytes, backend_for, device_for, now, reset_accelerator_peak, same_precision_ddp
from .systems import build_system


def model_config(args: argparse.Namespace) -> GPTConfig:
    return gpt_config_for_params(int(args.params), vocab_size=256, block_size=args.block_size)


def batch_stream(args: argparse.Namespace, rank: int) -> Iterator[tuple[Tensor, Tensor]]:
    """Random windows of the corpus, ``(x, y)`` with ``y`` shifted by one; a fixed stream per rank (seed + rank),
    drawn on the CPU and placed on the rank's device."""
    data = torch.frombuffer(bytearray(Path(args.data).read_bytes()), dtype=torch.uint8).long()
    generator = torch.Generator().manual_seed(args.seed + rank)
    device = device_for(rank, args)
    while True:
        starts = torch.randint(0, data.numel() - args.block_size - 1, (args.batch_size,), generator=generator)
        chunk = torch.stack([data[s : s + args.block_size + 1] for s in starts.tolist()])
        yield chunk[:, :-1].contiguous().to(device), chunk[:, 1:].contiguous().to(device)


def _cpus() -> int:
    return os.cpu_count() or 1


def current_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def machine_busy_s() -> float:
    """CPU seconds all processes on this machine spent busy since boot (user+nice+system+irq+softirq+steal)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def own_cpu_s() -> float:
    """CPU seconds of this process and its joined children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def disk_bandwidth(path: str, nbytes: int = 256 * 2**20, chunk: int = 8 * 2**20) -> dict[str, float]:
    """Write then read ``nbytes`` through the offload's own swap file (O_DIRECT where the file system takes it)
    in ``chunk``-sized transfers: the bandwidth an *_nvme system can expect, in bytes/s."""
    try:
        from lightning_zero.core.store.swap import SwapFile, aligned_empty
    except ImportError:  # a checkout from before the core was laid out by axis (benchmarks/ab_core.py)
        from lightning_zero.core.offload.disk import SwapFile, aligned_empty  # type: ignore[no-redef]

    swap = SwapFile(path, rank=0)
    regions = [swap.allocate(chunk) for _ in range(nbytes // chunk)]
    page = aligned_empty(chunk)
    start = time.perf_counter()
    for region in regions:
        swap.write(region, page)
    written = time.perf_counter() - start
    start = time.perf_counter()
    for region in regions:
        swap.read(region)
    read = time.perf_counter() - start
    swap.close()
    return {"write_bytes_per_s": nbytes / written, "read_bytes_per_s": nbytes / read, "direct_io": swap.direct}


def timing_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """Build every system, train them interleaved, return per-step times, bytes and final parameter gaps.

    After ``--warmup`` rounds, rounds go on until ``--steps`` of them were clean (other processes used at
    most ``--max-foreign`` of the CPUs) or ``--max-rounds`` were measured, so that a shared machine
    still yields ``--steps`` undisturbed rounds where it can.
    """
    cfg = model_config(args)
    names = list(args.systems)
    device = device_for(rank, args)
    batches = batch_stream(args, rank)
    systems = {}
    for name in names:  # one process group each, created in the same order on every rank
        systems[name] = build_system(name, cfg, args, dist.new_group(backend=backend_for(args)))
    reference = systems[names[0]].full_state()
    for name in names[1:]:  # identical starting weights
        for key, value in systems[name].full_state().items():
            assert torch.equal(value, reference[key]), f"{name} starts from other weights than {names[0]} ({key})"

    times: dict[str, list[float]] = {name: [] for name in names}
    phases: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    page_faults: dict[str, list[int]] = {name: [] for name in names}  # minor faults: pages the step touched fresh
    load: list[float] = []  # per round: share of the CPUs used by other processes (rank 0's reading)
    clean = 0
    while len(load) < args.warmup or (clean < args.steps and len(load) < args.warmup + args.max_rounds):
        index = len(load)
        x, y = next(batches)
        dist.barrier()
        mark = (time.perf_counter(), machine_busy_s(), time.process_time())
        for name in names[index % len(names) :] + names[: index % len(names)]:  # the order rotates every round
            dist.barrier()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = now(device)
            phases[name].append(systems[name].step(x, y))
            times[name].append(now(device) - start)
            page_faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        load.append(foreign_share_since(*mark, device=device))
        clean += index >= args.warmup and load[-1] <= args.max_foreign

    result: dict[str, Any] = {"times": times, "phases": phases, "page_faults": page_faults, "load": load, "systems": {}}
    bases = {ref: systems[ref].full_state() for ref in ("ddp", f"ddp{BF16}") if ref in systems}  # not collectives
    for name, system in systems.items():
        full = system.full_state()  # a collective for the sharded systems: every rank, in the same order
        reference = diff_reference(name, names)
        entry: dict[str, Any] = {
            "memory": system.memory(),
            "comm_nbytes": system.comm_bytes(),
            "comm_detail": getattr(system, "last_comm", None),
            "owned_elements": system.owned_elements() if hasattr(system, "owned_elements") else None,
            "numel": sum(t.numel() for t in full.values()),
            "param_diff_reference": reference,
        }
        if reference is not None:
            entry.update(parameter_gap(full, bases[reference]))
        result["systems"][name] = entry
    result["combined_peak_rss"] = peak_rss_bytes()
    return result


def diff_reference(name: str, names: list[str]) -> str | None:
    """The DDP whose final parameters ``name``'s are compared with: the same precision's if it ran, else ``ddp``."""
    return next((ref for ref in (same_precision_ddp(name), "ddp") if ref in names), None)


def foreign_share_since(wall: float, busy: float, own: float, device: torch.device) -> float:
    """Share of the CPUs that other processes used since the mark (collective: rank 0's verdict for all).

    The tensors live on ``device``: the world group is NCCL's with ``--device cuda``.
    """
    dist.barrier()
    own_total = torch.tensor([time.process_time() - own], dtype=torch.float64, device=device)
    dist.all_reduce(own_total)  # every rank's CPU time (all its threads)
    foreign = max(0.0, machine_busy_s() - busy - own_total.item())
    share = torch.tensor([foreign / ((time.perf_counter() - wall) * _cpus())], dtype=torch.float64, device=device)
    dist.broadcast(share, src=0)
    return share.item()


def parameter_gap(state: dict[str, Tensor], base: dict[str, Tensor]) -> dict[str, Any]:
    """max over tensors of max|a - b| / max|b|, the largest absolute gap, whether all are bit-equal, and
    ||a - b|| / ||b|| over all parameters together.

    The per-tensor maximum is at the mercy of tensors that start at zero (biases): after a few steps they hold
    about steps x lr, and where their gradient is only rounding noise (the attention's key bias, whose true
    gradient is zero) Adam's normalised steps go either way. The global norm ratio is not.
    """
    rel, absolute, equal = 0.0, 0.0, True
    diff_sq, base_sq = 0.0, 0.0
    assert list(state) == list(base)
    for name, a in state.items():
        b = base[name]
        gap = (a.detach() - b.detach()).abs().max().item()
        absolute = max(absolute, gap)
        rel = max(rel, gap / max(b.detach().abs().max().item(), 1e-30))
        equal = equal and torch.equal(a, b)
        diff_sq += (a.detach().double() - b.detach().double()).square().sum().item()
        base_sq += b.detach().double().square().sum().item()
    return {
        "max_rel_param_diff": rel,
        "max_abs_param_diff": absolute,
        "bitwise_equal": equal,
        "rel_l2_param_diff": (diff_sq / max(base_sq, 1e-300)) ** 0.5,
    }


def rss_rank(rank: int, world_size: int, args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Only ``name`` in this process: baseline RSS, then peak RSS over ``--rss-steps`` steps.

    With ``--device cuda`` also the peak of ``torch.cuda.max_memory_allocated`` over the same span (``None`` on the
    CPU), and the allocated bytes at the baseline (the batches).
    """
    cfg = model_config(args)
    device = device_for(rank, args)
    stream = batch_stream(args, rank)
    batches = [next(stream) for _ in range(args.rss_steps)]
    baseline = current_rss_bytes()
    reset_accelerator_peak(device)
    baseline_accelerator = accelerator_bytes(device, peak=False)
    system = build_system(name, cfg, args, None)
    times = []
    for x, y in batches:
        dist.barrier()
        start = now(device)
        system.step(x, y)
        times.append(now(device) - start)
    return {
        "baseline_rss": baseline,
        "peak_rss": peak_rss_bytes(),
        "end_rss": current_rss_bytes(),
        "baseline_accelerator": baseline_accelerator,
        "peak_accelerator": accelerator_bytes(device, peak=True),
        "times": times,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }
