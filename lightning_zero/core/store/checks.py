"""What offload needs of the machine, checked on every rank before the engine is built: a usable ``nvme_path`` with
room for every rank that shares its file system, and host memory for ``"cpu"``. A problem on any rank raises on
all of them (one small all-gather), so no rank waits in a collective for one that stopped."""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_zero.core.comm import Communicator

_WARNED: list[str] = []
ASSUMED_STATE_BYTES = 8  # per element, where the optimizer cannot be probed (Adam's two fp32 moments)


def state_bytes_per_element(optimizer: Optimizer) -> int:
    """Bytes of element-wise state ``optimizer`` keeps per parameter element, measured on a 2-element probe."""
    probe = nn.Parameter(torch.zeros(2))
    probe.grad = torch.ones(2)
    try:
        copy = type(optimizer)([probe], **optimizer.defaults)
        copy.step()
    except Exception:
        return ASSUMED_STATE_BYTES
    values = [v for v in copy.state[probe].values() if isinstance(v, torch.Tensor) and v.numel() == 2]
    return sum(v.element_size() for v in values)


def offloaded_bytes_per_rank(optimizers: Sequence[Optimizer], world_size: int, master_bytes: int = 4) -> int:
    """Bytes one rank keeps off the device with ``offload_optimizer``: its share of the master and of the state."""
    trainable = {id(p): p for o in optimizers for g in o.param_groups for p in g["params"] if p.requires_grad}
    numel = -(-sum(p.numel() for p in trainable.values()) // world_size)
    state = sum(state_bytes_per_element(o) for o in optimizers)
    return numel * (master_bytes + state)


def check_offload(target: str | bool, nvme_path: str | None, needed: int, comm: Communicator) -> None:
    """Raise on every rank if any rank cannot offload ``needed`` bytes to ``target``; warn about slow set-ups.
    Collective (``target`` is the same on every rank)."""
    problem = _nvme_problem(nvme_path, needed, comm) if target == "nvme" else _host_memory_problem(needed, comm)
    answers = comm.all_gather_object((problem, socket.gethostname()))
    found = [(rank, text) for rank, (text, _) in enumerate(answers) if text]
    if found:
        listed = "; ".join(f"rank {rank}: {text}" for rank, text in found)
        raise ValueError(f"offload_optimizer={target!r} cannot run: {listed}")
    here = sum(host == socket.gethostname() for _, host in answers)
    advice = single_thread_advice(torch.get_num_threads(), len(os.sched_getaffinity(0)), here)
    if advice is not None and not _WARNED:
        _WARNED.append("threads")
        warnings.warn(advice, stacklevel=3)


def single_thread_advice(threads: int, cores: int, ranks_here: int) -> str | None:
    """The warning for an offloaded optimizer stepping on one CPU thread where its rank has more cores (``cores``
    usable by the process, shared by the ``ranks_here`` ranks of its host); ``None`` where one is all it has."""
    per_rank = cores // max(ranks_here, 1)
    if threads != 1 or per_rank < 2:
        return None
    return (
        f"offload: this rank steps its optimizer on the CPU with a single thread, but its host has {cores} cores "
        f"for {ranks_here} rank(s); set OMP_NUM_THREADS={per_rank} for a faster step (torchrun sets it to 1)."
    )


def _nvme_problem(path: str | None, needed: int, comm: Communicator) -> str | None:
    where = (socket.gethostname(), _device_of(path))
    sharing = sum(1 for other in comm.all_gather_object(where) if other == where and where[1] is not None)
    if not path or not os.path.exists(path):
        return f"nvme_path={path!r} does not exist; create the directory (on a fast local disk) or pass another."
    if not os.path.isdir(path):
        return f"nvme_path={path!r} is not a directory; pass the directory the swap files go in."
    try:
        from lightning_zero.core.store.swap import SwapFile

        SwapFile(path, comm.rank).close()
    except OSError as error:
        return f"cannot create a swap file in nvme_path={path!r} ({error}); pass a directory this user can write."
    stats = os.statvfs(path)
    free = stats.f_bavail * stats.f_frsize
    if free < needed * sharing:
        return (
            f"nvme_path={path!r} has {free / 2**30:.2f} GiB free, but {sharing} rank(s) on this file system need "
            f"{needed * sharing / 2**30:.2f} GiB ({needed / 2**30:.2f} GiB each); free space or pass another path."
        )
    if _fstype(path) in ("tmpfs", "ramfs"):
        warnings.warn(
            f"offload: nvme_path={path!r} is on {_fstype(path)}, i.e. in RAM: NVMe offload then saves no memory.",
            stacklevel=4,
        )
    return None


def _host_memory_problem(needed: int, comm: Communicator) -> str | None:
    host = socket.gethostname()
    sharing = sum(1 for other in comm.all_gather_object(host) if other == host)
    available = _mem_available()
    if available is not None and available < needed * sharing:
        return (
            f"host memory has {available / 2**30:.2f} GiB available, but {sharing} rank(s) on {host} need "
            f"{needed * sharing / 2**30:.2f} GiB for the offloaded master and optimizer state; use "
            "offload_optimizer='nvme' with nvme_path, more ranks, or a machine with more memory."
        )
    return None


def _device_of(path: str | None) -> int | None:
    try:
        return os.stat(path).st_dev if path else None
    except OSError:
        return None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _fstype(path: str) -> str | None:
    """The file system type of the mount holding ``path`` (Linux), else ``None``."""
    real = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                inside = len(fields) >= 3 and (real == fields[1] or real.startswith(fields[1].rstrip("/") + "/"))
                if inside and len(fields[1]) >= len(best):
                    best, kind = fields[1], fields[2]
    except OSError:
        return None
    return kind
