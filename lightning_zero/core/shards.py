"""The records of one sharded model: a :class:`BufferGroup` per flat buffer, and the :class:`ShardedModel` that holds
them with the optimizers' steps. The engine builds them; checkpoints (through core/named_state.py), memory reports
and the backward driver read them, never the engine.

[Note: buffer groups]
Each flat buffer comes with what serves it: the store of its optimizer copy and its gradient bucket (trainable
buffers only) and, at stage 3, the gather unit it belongs to. One small record holds the four together (FSDP2's
``FSDPParamGroup`` idea), so a reader asks the record instead of looking the buffer up in per-role tables; the
records are in launch order (see [Note: bucket order]) and are made by the packer (see core/packing.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.core.comm.topology import Topology
from lightning_zero.core.layout.flat_buffer import FlatParamBuffer
from lightning_zero.core.layout.resting import RestingParameter, engine_access
from lightning_zero.core.memory import MemoryReport, StepPeak, tensor_nbytes
from lightning_zero.core.peak import PeakLedger
from lightning_zero.core.stage3.no_scheduler import NoScheduler
from lightning_zero.core.stage3.scheduler import Stage3Scheduler
from lightning_zero.core.stage3.units import GatherUnit
from lightning_zero.core.step.buckets import GradBucket
from lightning_zero.core.step.optimizer_step import OptimizerStep
from lightning_zero.core.store.offload import Offload
from lightning_zero.core.store.stores import ShardStore


@dataclass(eq=False)
class BufferGroup:
    """One flat buffer and what serves it. See [Note: buffer groups].

    Attributes:
        buffer: the parameters, flat, with this rank's shard.
        store: the optimizer's copy of the shard (``None``: frozen, stage 3 only).
        bucket: its gradient bucket (``None`` exactly when ``store`` is).
        unit: the stage-3 gather unit holding the buffer (``None`` at stages 1 and 2).
    """

    buffer: FlatParamBuffer
    store: ShardStore | None = None
    bucket: GradBucket | None = None
    unit: GatherUnit | None = None

    def best_values(self) -> Tensor:
        """This rank's shard in the best precision held (the fp32 master where there is one)."""
        if self.store is None:
            return self.buffer.shard
        if self.buffer.may_change_at_rest:
            self.store.sync_from_params()  # in-place writes since the last step (e.g. an averaging callback)
        return self.store.best()


class ShardedModel:
    """A module's parameters as buffer groups, the optimizers stepping them, and where states rest.

    Args:
        module: the model.
        optimizers: the user's optimizers over it.
        topology: the groups (``comm``: the shard group, over which the buffers are sharded).
        offload: where offloaded states live (its do-nothing form without offload).
        stage: the ZeRO stage (1 to 3).
    """

    def __init__(
        self, module: nn.Module, optimizers: list[Optimizer], topology: Topology, offload: Offload, stage: int
    ) -> None:
        self.module = module
        self.stage = stage
        self.names = {param: name for name, param in module.named_parameters()}
        self.optimizers = optimizers
        self.topology = topology
        self.comm = topology.shard
        self.offload = offload
        self.groups: list[BufferGroup] = []
        self.steps: list[OptimizerStep] = []
        self.scheduler: Stage3Scheduler | NoScheduler = NoScheduler()
        self.ledger = PeakLedger()  # the transient buffers of a step (see [Note: step peak ledger])

    # ------------------------------------------------------------------ the records
    @property
    def buffers(self) -> list[FlatParamBuffer]:
        return [group.buffer for group in self.groups]

    @property
    def trained(self) -> list[BufferGroup]:
        """The groups an optimizer trains (those with a store and a bucket), in launch order."""
        return [group for group in self.groups if group.store is not None]

    @property
    def buckets(self) -> list[GradBucket]:
        return [group.bucket for group in self.groups if group.bucket is not None]

    @property
    def units(self) -> list[GatherUnit]:
        return list(self.scheduler.units)

    def release(self) -> None:
        """Give every parameter a full tensor of its own in its best precision (the fp32 masters where there are
        some); close the stores and the swap file; no stage-3 scheduling after it (collective)."""
        with torch.no_grad(), engine_access():
            for group in self.groups:
                buffer, best = group.buffer, group.best_values()
                if best is buffer.shard and buffer.may_change_at_rest:
                    continue  # already full and in its own dtype
                full = buffer.full_values(best, self.comm)
                for param, values in zip(buffer.params, buffer.param_views(full), strict=True):
                    param.data = values.clone()
                    RestingParameter.release(param)
                del full
        for group in self.trained:
            group.store.close()  # type: ignore[union-attr]
        for bucket in self.buckets:
            bucket.drop_feedback()
        self.offload.close()
        self.scheduler.remove_hooks()  # the units' forward hooks go with the engine
        self.scheduler = NoScheduler()

    def managed_ids(self) -> set[int]:
        """``id`` of every parameter a trained buffer holds."""
        return {id(p) for group in self.trained for p in group.buffer.params}

    # ------------------------------------------------------------------ optimizers
    def step_of(self, optimizer: Optimizer) -> OptimizerStep:
        for step in self.steps:
            if step.optimizer is optimizer:
                return step
        raise ValueError(f"{type(optimizer).__name__} is not managed by this ZeroEngine")

    def manages(self, optimizer: Optimizer) -> bool:
        return any(step.optimizer is optimizer for step in self.steps)

    def absorb_optimizer_state(self, optimizer: Optimizer) -> None:
        """Optimizer state set from outside (a checkpoint, state made before setup) moves into paged stores."""
        for store, params in self._paged_params(optimizer):
            store.absorb_state(optimizer, params)  # type: ignore[attr-defined]

    def optimizer_state(self, optimizer: Optimizer) -> dict[int, dict]:
        """``optimizer``'s state by ``id(param)``, with state that rests in paged stores read back (copies)."""
        states = {id(p): dict(s) for p, s in optimizer.state.items() if s}
        for store, params in self._paged_params(optimizer):
            states.update(store.read_state(optimizer, params))  # type: ignore[attr-defined]
        return states

    def _paged_params(self, optimizer: Optimizer) -> list[tuple[ShardStore, list[tuple[nn.Parameter, int]]]]:
        by_store: dict[int, tuple[ShardStore, list[tuple[nn.Parameter, int]]]] = {}
        for step in self.steps:
            if step.optimizer is optimizer:
                for entry in step.entries:
                    if entry.store.paged:
                        by_store.setdefault(id(entry.store), (entry.store, []))[1].append((entry.param, entry.slot))
        return list(by_store.values())

    def attach_ledger(self) -> None:
        """Let every unit, bucket and optimizer step report its transient buffers to :attr:`ledger` (again after
        changes added some)."""
        memory = [self.scheduler.memory] if isinstance(self.scheduler, Stage3Scheduler) else []
        for owner in [*self.units, *self.buckets, *self.steps, *memory]:
            owner.ledger = self.ledger

    def step_peak(self, report: MemoryReport, allocated: int | None) -> StepPeak:
        """The peak since :meth:`PeakLedger.reset` by kind; ``report``'s model states less the transient buffers
        held now (which it counts under parameters and gradients), with each bucket's gradients as held at the end
        of the last step where they are fewer now (emptied after it: ``zero_grad`` or [Note: freeing gradients
        after the step]; they were held through the backward and the step)."""
        held = sum(self.ledger.current.values())
        at_step_end = {key: nbytes for step in self.steps for key, nbytes in step.held_at_step_end.items()}
        freed = sum(max(0, at_step_end.get(id(b), 0) - b.nbytes) for b in self.buckets)
        return StepPeak.of(report.total - held + freed, self.ledger.peak, allocated)

    # ------------------------------------------------------------------ reading the state
    @contextmanager
    def gathered(self, write_back: bool = False) -> Iterator[None]:
        """Hold every parameter in full inside the block (stage 3; a no-op before). With ``write_back`` changes made
        to the parameters inside (e.g. ``load_state_dict``) are kept. What it gathers is not counted in the step's
        peak."""
        stores = lambda: [group.store for group in self.trained]  # noqa: E731
        with self.ledger.not_counted(), self.scheduler.gathered(write_back, stores):  # type: ignore[arg-type]
            yield

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Around a checkpoint save: state that rests in the swap file is given as read-only maps of it, so the
        save streams it instead of holding the rank's share in memory (see core/store/disk.py)."""
        with self.offload.mapped_reads():
            yield

    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state this rank holds now."""
        managed = {id(p) for b in self.buffers for p in b.params}
        unmanaged = [p for p in self.module.parameters() if id(p) not in managed]
        with engine_access():
            params = sum(b.nbytes for b in self.buffers) + sum(tensor_nbytes(p) for p in unmanaged)
            grads = sum(b.nbytes for b in self.buckets) + sum(tensor_nbytes(p.grad) for p in unmanaged)
        grads += sum(step.step_grad_nbytes for step in self.steps)
        grads += sum(bucket.feedback_nbytes for bucket in self.buckets)  # quantize_gradients' residuals
        params += sum(unit.secondary.nbytes for unit in self.units if unit.secondary is not None)  # hpZ slices
        stores = [group.store for group in self.trained]
        masters = sum(store.nbytes for store in stores)  # type: ignore[union-attr]  # counted with the optimizer
        offloaded = sum(store.offloaded_nbytes for store in stores)  # type: ignore[union-attr]
        offloaded += sum(b.shard_nbytes for b in self.buffers if getattr(b, "shard_offloaded", False))
        offloaded += sum(bucket.offloaded_nbytes for bucket in self.buckets)
        host_params = {id(e.param) for s in self.steps for e in s.entries if e.store.offloaded}
        resident = offloaded_states = 0
        for optimizer in self.optimizers:
            for param, state in optimizer.state.items():
                nbytes = sum(map(tensor_nbytes, state.values()))
                if id(param) in host_params:
                    offloaded_states += nbytes
                else:
                    resident += nbytes
        owned = [0] * self.comm.world_size  # per rank (layouts are the same on every rank, so no collective)
        for group in self.trained:
            for rank in range(self.comm.world_size):
                owned[rank] += group.buffer.layout.shard_size(rank)
        return MemoryReport(
            params=params,
            gradients=grads,
            optimizer_states=resident + masters,
            offloaded=offloaded + offloaded_states,
            owned_max=max(owned),
            owned_min=min(owned),
        )
