"""The benchmark's system names and what they encode, and the helpers that make a run device-agnostic.

A name says how a system shards (``ddp``, ``zero2``, ``fsdp2``, ...), then optionally where it offloads
(``_cpu``, ``_nvme``, ``_cpuparams``, ``_nvmeparams``) or that it owns whole tensors (``_owner``), then its
precision (``_bf16``). The device helpers (``device_for``, ``backend_for``, ``sync``, ``now``, ...) are what
``--device cuda`` changes; with ``--device cpu`` they change nothing.
"""

from __future__ import annotations

import argparse
import time

import torch

from tests.helpers import BACKENDS

BF16 = "_bf16"  # suffix of the bf16-mixed systems
SYSTEMS = (
    "ddp",
    "ddp_copy",
    "zero1",
    "zero2",
    "zero3",
    "fsdp2",
    "zero1_torch",
    "base1",
    "base2",
    "base3",
    *(f"{base}{BF16}" for base in ("ddp", "zero1", "zero2", "zero3", "fsdp2", "base1", "base2", "base3")),
)
# Offload systems: the engine with the optimizer on the CPU ("_cpu"), paged from a swap file in --nvme-path
# ("_nvme"), and at stage 3 with the parameter shards on the host ("_cpuparams") or on NVMe too ("_nvmeparams");
# "_bf16" after that.
OFFLOADS = {
    "_cpu": ("cpu", False),
    "_nvme": ("nvme", False),
    "_cpuparams": ("cpu", "cpu"),
    "_nvmeparams": ("nvme", "nvme"),
}
_OFFLOADED = tuple(
    f"zero{stage}{suffix}" for suffix in OFFLOADS for stage in (1, 2, 3) if stage == 3 or "params" not in suffix
)
SYSTEMS = (*SYSTEMS, *_OFFLOADED, *(f"{name}{BF16}" for name in _OFFLOADED))
# Whole-tensor owners (partition="parameter"): "zero2_owner", "zero2_owner_bf16", ...
OWNER = "_owner"
_OWNERS = tuple(f"zero{stage}{OWNER}" for stage in (1, 2, 3))
SYSTEMS = (*SYSTEMS, *_OWNERS, *(f"{name}{BF16}" for name in _OWNERS))
# base1-base3: an earlier commit's core, imported under the package name in this variable (see ab_core.py).
BASELINE_ENV = "BENCH_BASELINE_PACKAGE"
FUSED_ENV = "BENCH_ADAMW_FUSED"  # "1": every AdamW with fused=True (--adamw-fused, read in the ranks)
RSS_VARIANTS = {"as-is": {}, "mmap64k": {"MALLOC_MMAP_THRESHOLD_": "65536"}}


def is_bf16(name: str) -> bool:
    return name.endswith(BF16)


def base_system(name: str) -> str:
    """``zero2_bf16`` -> ``zero2``: how the system shards, whatever its precision."""
    return name.removesuffix(BF16)


def offload_of(name: str) -> tuple[str | bool, str | bool]:
    """``zero2_nvme_bf16`` -> ``("nvme", False)``: the system's (offload_optimizer, offload_params)."""
    base = base_system(name)
    for suffix, offload in OFFLOADS.items():
        if base.endswith(suffix):
            return offload
    return False, False


def partition_of(name: str) -> str:
    """``zero2_owner_bf16`` -> ``"parameter"``; every other system shards ``"flat"``."""
    return "parameter" if base_system(name).endswith(OWNER) else "flat"


def same_precision_ddp(name: str) -> str:
    """The DDP of ``name``'s precision: what its step time and parameters are compared with."""
    return f"ddp{BF16}" if is_bf16(name) else "ddp"


def device_type(args: argparse.Namespace) -> str:
    return getattr(args, "device", "cpu")  # benchmarks/sweep.py builds systems with a namespace of its own


def backend_for(args: argparse.Namespace) -> str:
    return BACKENDS[device_type(args)]


def device_for(rank: int, args: argparse.Namespace) -> torch.device:
    """Where rank ``rank`` keeps its model and batches: ``cuda:{rank}`` (one node, one GPU per rank) or the CPU."""
    return torch.device("cuda", rank) if device_type(args) == "cuda" else torch.device("cpu")


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device``: a GPU step is over when its kernels are, not when they are queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device) -> float:
    """``time.perf_counter()`` after the work queued on ``device`` is done; every step time is read with it."""
    sync(device)
    return time.perf_counter()


def reset_accelerator_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def accelerator_bytes(device: torch.device, peak: bool) -> int | None:
    """``torch.cuda.max_memory_allocated`` (``peak``) or ``memory_allocated``; ``None`` on the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)
