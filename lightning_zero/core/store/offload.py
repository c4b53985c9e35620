"""Offload (ZeRO-Offload, ZeRO-Infinity): the optimizer's copy of each shard, and stage-3 parameter shards, off the
device. :class:`Offload` is the engine's one object for it: it builds each trainable buffer's store (see
[Note: offloaded optimizer steps] and [Note: paged optimizer steps]), says where stage-3 shards rest, and owns the
rank's swap file."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch.optim import Optimizer

from lightning_zero.core.layout.flat_buffer import FlatParamBuffer
from lightning_zero.core.layout.host_memory import HOST
from lightning_zero.core.store.disk import DiskStore
from lightning_zero.core.store.host import HostStore
from lightning_zero.core.store.stores import ShardStore
from lightning_zero.core.store.swap import IOCounts, RestingTensor, SwapFile

log = logging.getLogger("lightning_zero")

# Optimizers with a fused CPU kernel: bitwise the same maths as their default, several times faster.
_FUSED_ON_CPU = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


class Offload:
    """Where offloaded model states of one engine live; with neither ``optimizer`` nor ``params`` it is the do-nothing
    form (every store on the device, no swap file), so the engine never asks whether there is an offload.

    Args:
        optimizer: ``"cpu"`` or ``"nvme"`` for the master and optimizer state, ``False`` to keep them on the device.
        params: ``"cpu"`` to rest stage-3 parameter shards in host memory, ``"nvme"`` in the swap file (read back
            for each use), ``False`` to keep them on the device.
        nvme_path: the directory of the swap file (``optimizer="nvme"``).
        rank: this rank (names the swap file in errors).
    """

    def __init__(self, optimizer: str | bool, params: str | bool, nvme_path: str | None, rank: int) -> None:
        self.optimizer = optimizer
        self.params = params
        nvme = "nvme" in (optimizer, params)
        self.swap = SwapFile(nvme_path, rank) if nvme and nvme_path else None

    def store(self, buffer: FlatParamBuffer, master_dtype: torch.dtype) -> ShardStore | None:
        """The store of a trainable floating-point buffer, or ``None`` when the optimizer stays on the device."""
        if self.optimizer == "nvme":
            assert self.swap is not None
            return DiskStore(buffer, master_dtype, self.swap)
        if self.optimizer == "cpu":
            return HostStore(buffer, master_dtype)
        return None

    @property
    def shard_home(self) -> torch.device | None:
        """Where stage-3 parameter shards rest (``None``: with the full buffer, on the device)."""
        return HOST if self.params else None

    def resting(self) -> RestingTensor | None:
        """Where one stage-3 shard rests between uses (``offload_params="nvme"``: a swap-file region)."""
        return RestingTensor(self.swap) if self.params == "nvme" and self.swap is not None else None

    @property
    def gradients_rest(self) -> bool:
        """Stage-3 gradient shards rest in the swap file between backward and step: with the parameters and the
        optimizer both on NVMe (ZeRO-Infinity), nothing that grows with the model stays in memory."""
        return self.optimizer == "nvme" and self.params == "nvme" and self.swap is not None

    def gradient_resting(self) -> tuple[RestingTensor, RestingTensor] | None:
        """Where one stage-3 gradient shard rests, and the result of a reduction that adds to it (see
        :class:`~lightning_zero.core.step.shard_bucket.ShardGradBucket`); ``None`` unless :attr:`gradients_rest`."""
        if not self.gradients_rest:
            return None
        assert self.swap is not None
        return RestingTensor(self.swap), RestingTensor(self.swap)

    @property
    def io(self) -> IOCounts:
        """Bytes the swap file read and wrote so far (zero without one)."""
        return self.swap.counts if self.swap is not None else IOCounts()

    @contextmanager
    def mapped_reads(self) -> Iterator[None]:
        """Reads of the swap file inside the block are read-only maps of it (a checkpoint save streams them)."""
        with self.swap.mapped_reads() if self.swap is not None else nullcontext():
            yield

    def close(self) -> None:
        if self.swap is not None:
            self.swap.close()
            self.swap = None


def prefer_fused_kernels(optimizers: list[Optimizer]) -> None:
    """Offloaded steps run on the CPU: give Adam, AdamW, Adagrad and momentum-free SGD param groups that chose
    neither ``fused`` nor ``foreach`` torch's fused CPU kernel (the same maths, several times faster), and say so
    once."""
    switched = []
    for optimizer in optimizers:
        if not isinstance(optimizer, _FUSED_ON_CPU):
            continue
        for index, group in enumerate(optimizer.param_groups):
            if isinstance(optimizer, torch.optim.SGD) and group.get("momentum"):
                # torch's fused SGD raises once one parameter has a momentum buffer and another gets its first
                # gradient (an unused parameter used later, a layer unfrozen): the default kernel does not.
                continue
            if group.get("fused") is None and group.get("foreach") is None and not group.get("differentiable"):
                group["fused"] = True
                switched.append(f"{type(optimizer).__name__} group {index}")
    if switched:
        log.info("offload: the optimizer steps on the CPU with torch's fused kernel (%s).", ", ".join(switched))
