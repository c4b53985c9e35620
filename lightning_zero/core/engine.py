"""ZeroEngine: shards a module's parameters, gradients and optimizer state for ZeRO stages 1 to 3.

The engine knows nothing about Lightning. Its life:

1. ``ZeroEngine(module, optimizers, config, comm)``: the ranks agree on parameters and options, rank 0's
   parameters and buffers are broadcast, and the parameters are packed into flat buffers (see [Note:
   flat layout]): for stages 1 and 2 the trainable parameters of each optimizer param group, in
   buckets of at most ``bucket_cap_mb``; for stage 3 every parameter of each gather unit (see [Note:
   stage-3 gather units]), which then keeps only its shard. Each param group's ``params`` are
   replaced by this rank's pieces (see [Note: parameter views and optimizer pieces]); existing
   optimizer state is sliced into them.
2. Backward: gradient hooks fill the buckets and reduce-scatter them (see [Note: bucket order]).
   At the end of a reducing backward the ranks agree on which parameters got gradients and each piece
   receives its slice of the reduced shard as ``grad`` (see [Note: gradient liveness]).
   Stage 3 gathers each unit around its forward and backward (see [Note: stage-3 life of a unit]).
3. ``prepare_step(optimizer)`` (mixed precision: fp32 gradients for the masters, unscaled, and the
   agreed overflow check), ``clip_grad_norm_`` / ``clip_grad_value_`` if asked, ``optimizer.step()`` by
   the caller, then ``finish_step(optimizer)``: the masters are rounded into the shard (see [Note:
   mixed-precision model states]); stages 1 and 2 all-gather the updated parameters; stage 3 gathers
   them when they are next used.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim import Optimizer

from lightning_zero.config import ZeroConfig
from lightning_zero.core.buckets import GradBucket, GradReducer
from lightning_zero.core.comm import CommStats, Communicator, wait_all
from lightning_zero.core.flat_buffer import FlatParamBuffer, MasterPiece
from lightning_zero.core.layout import Piece, plan_buckets
from lightning_zero.core.memory import MemoryReport, tensor_nbytes
from lightning_zero.core.mixed_precision import PrecisionPolicy
from lightning_zero.core.optim_state import shard_param_state
from lightning_zero.core.prefetch import Prefetcher
from lightning_zero.core.stage1 import FullGradBucket
from lightning_zero.core.stage2 import ShardGradBucket
from lightning_zero.core.stage3 import GatherUnit, assign_params, initialise, materialize_buffers, select_units

_BUCKET_TYPES: dict[int, type[GradBucket]] = {1: FullGradBucket, 2: ShardGradBucket, 3: ShardGradBucket}


@dataclass
class OptimizerBinding:
    """One user optimizer and the buckets that hold its parameters."""

    optimizer: Optimizer
    groups: list[list[nn.Parameter]]  # the original params of each param group, in the user's order
    buckets: list[GradBucket] = field(default_factory=list)


class ZeroEngine:
    """ZeRO stages 1-3 for ``module`` trained by ``optimizers``. See the module docstring."""

    def __init__(
        self,
        module: nn.Module,
        optimizers: list[Optimizer],
        config: ZeroConfig,
        comm: Communicator,
        device: torch.device | None = None,
        precision: PrecisionPolicy | None = None,
    ) -> None:
        """See the module docstring; ``device`` is where sharded tensors live (default: the parameters' device);
        ``precision`` the dtypes held (default: the parameters' own, no master copy).

        At stage 3 the module may be on the meta device: each unit is then created on ``device`` and initialised
        with its modules' ``reset_parameters()`` one at a time, so the full model never exists on one rank.
        """
        if config.stage not in _BUCKET_TYPES:
            raise NotImplementedError(f"ZeroEngine builds stages {sorted(_BUCKET_TYPES)}, got stage={config.stage}")
        self.module = module
        self.config = config
        self.comm = comm
        self.policy = precision or PrecisionPolicy()
        self._keep_dtype = _norm_params(module) if self.policy.param_dtype is not None else set()
        # Where sharded tensors and small control tensors (used-flags, norms) live; NCCL needs the GPU.
        self.device = device or next(module.parameters(), torch.empty(0)).device
        self.names = {param: name for name, param in module.named_parameters()}
        self.bindings = [OptimizerBinding(opt, [list(g["params"]) for g in opt.param_groups]) for opt in optimizers]
        self._check_optimizers()
        self._agree_across_ranks()
        if config.stage < 3:
            self.broadcast_module_states(module, comm)
        self.units: list[GatherUnit] = []  # stage 3 only; the root unit last
        self.buffers = self._build_units() if config.stage == 3 else self._build_buckets()
        bucket_type = _BUCKET_TYPES[config.stage]
        self.buckets = [
            bucket_type(b, comm, self.policy.reduce_dtype if b.master is not None else None)
            for b in self.buffers
            if b.params[0].requires_grad
        ]
        self.reducer = GradReducer(
            self.buckets,
            comm,
            config.overlap_comm,
            reduce_every_backward=config.stage >= 2,
            on_bucket_ready=self._on_bucket_ready if self.units else None,
            on_backward_end=self.reshard_all if self.units else None,
        )
        self.prefetcher = Prefetcher() if self.units and config.overlap_comm else None  # [Note: stage-3 prefetch]
        for unit in self.units:
            unit.on_backward_start = self.reducer.ensure_end_callback
            unit.prefetcher = self.prefetcher
        # Stage 3: per bucket its unit, and the buckets that must all be complete before that unit is freed.
        self._unit_of_bucket = [self._unit_of(bucket.buffer) for bucket in self.buckets]
        self._unit_buckets = {
            unit: [b for b, u in zip(self.buckets, self._unit_of_bucket, strict=True) if u is unit]
            for unit in self.units
        }
        for binding in self.bindings:
            self._bind_optimizer(binding)
        self.last_step_comm = CommStats()
        self._step_scale: dict[int, float | None] = {}  # id(optimizer) -> loss scale of its prepared step
        self._clipped: dict[int, bool] = {}  # id(optimizer) -> its step gradients were clipped

    # ------------------------------------------------------------------ setup
    def _check_optimizers(self) -> None:
        owner: dict[nn.Parameter, str] = {}
        for index, binding in enumerate(self.bindings):
            for group_index, params in enumerate(binding.groups):
                for param in params:
                    where = f"optimizer {index} param group {group_index}"
                    if param not in self.names:
                        raise ValueError(
                            f"{where} holds a parameter of shape {tuple(param.shape)} that is not in the model. "
                            "Create the optimizer in configure_optimizers() from self.parameters()."
                        )
                    if param in owner:
                        raise ValueError(
                            f"parameter {self.names[param]!r} is in both {owner[param]} and {where}; "
                            "each parameter may belong to one param group of one optimizer."
                        )
                    owner[param] = where

    def _agree_across_ranks(self) -> None:
        group_of = {p: (i, g) for i, b in enumerate(self.bindings) for g, ps in enumerate(b.groups) for p in ps}
        params = [
            (name, (tuple(p.shape), str(p.dtype), p.requires_grad, group_of.get(p)))
            for name, p in self.module.named_parameters()
        ]
        fix = "Build the same model and optimizers, with the same Trainer precision, on every rank before Trainer.fit."
        self.comm.agree("the model's parameters (shape, dtype, requires_grad, optimizer group)", params, fix)
        options = sorted(self.config.describe().items()) + list(self.policy.describe().items())
        fix = "Pass the same ZeroStrategy options and Trainer precision on every rank."
        self.comm.agree("ZeroStrategy options and precision", options, fix)

    @staticmethod
    def broadcast_module_states(module: nn.Module, comm: Communicator) -> None:
        """Give every rank rank 0's parameters and buffers, as DDP does at construction."""
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                comm.broadcast(tensor.data, src=0)

    def _build_buckets(self) -> list[FlatParamBuffer]:
        """Stages 1, 2: buffers per (optimizer, param group, dtype, device), in reverse registration order."""
        order = {p: i for i, p in enumerate(reversed(list(self.names)))}
        planned: list[list[nn.Parameter]] = []
        for binding in self.bindings:
            for params in binding.groups:
                trainable = sorted((p for p in params if p.requires_grad), key=order.__getitem__)
                for same in _split_by_dtype(trainable, self._keep_dtype):
                    cap = max(1, self.config.bucket_cap_bytes // same[0].element_size())
                    planned.extend(
                        [same[i] for i in indices] for indices in plan_buckets([p.numel() for p in same], cap)
                    )
        planned.sort(key=lambda members: order[members[0]])
        buffers = [FlatParamBuffer(members, self.comm.rank, self.comm.world_size) for members in planned]
        for buffer in buffers:  # every stage-1/2 buffer holds trainable parameters that an optimizer updates
            if buffer.params[0] not in self._keep_dtype:
                buffer.set_dtypes(self.policy.param_dtype, self.policy.master_dtype)
        return buffers

    def _build_units(self) -> list[FlatParamBuffer]:
        """Stage 3: per gather unit, buffers per (requires_grad, dtype, device), units in reverse order."""
        optimized = {p for binding in self.bindings for params in binding.groups for p in params}
        unit_modules = select_units(self.module, self.config.wrap_policy)
        assigned = assign_params(self.module, unit_modules)
        materialize_buffers(self.module, self.device)
        buffers: list[FlatParamBuffer] = []
        for unit_module in [*unit_modules, self.module]:
            params = assigned[unit_module]
            on_meta = [p for p in params if p.is_meta]
            unit_buffers = [
                FlatParamBuffer(same, self.comm.rank, self.comm.world_size, keep_full=False, device=self.device)
                for flag in (True, False)
                for same in _split_by_dtype([p for p in params if p.requires_grad is flag], self._keep_dtype)
            ]
            initialise(self.module, on_meta)
            for buffer in unit_buffers:  # rank 0's values everywhere, whatever each rank's RNG did
                self.comm.broadcast(buffer.data, src=0)
                # Only what an optimizer trains is held in 16 bits with a master; the rest keeps its dtype.
                first = buffer.params[0]
                if first.requires_grad and first not in self._keep_dtype and any(p in optimized for p in buffer.params):
                    buffer.set_dtypes(self.policy.param_dtype, self.policy.master_dtype)
                buffer.commit_shard()
            self.units.append(GatherUnit(unit_module, unit_buffers, self.comm, is_root=unit_module is self.module))
            buffers.extend(unit_buffers)
        with torch.no_grad():
            for tensor in self.module.buffers():
                self.comm.broadcast(tensor, src=0)
        # Backward meets the last units first: reverse registration order approximates it (see [Note: bucket order]).
        return list(reversed(buffers))

    def _unit_of(self, buffer: FlatParamBuffer) -> GatherUnit | None:
        return next((unit for unit in self.units if any(b is buffer for b in unit.buffers)), None)

    def _bind_optimizer(self, binding: OptimizerBinding) -> None:
        """Replace each param group's params by this rank's pieces, slicing any existing state."""
        piece_of = {
            param: (buffer, index)
            for buffer in self.buffers
            for index, param in enumerate(buffer.params)
            if param.requires_grad
        }
        optimizer = binding.optimizer
        old_state = optimizer.state
        optimizer.state = defaultdict(dict)
        members = {p for params in binding.groups for p in params}
        binding.buckets = [b for b in self.buckets if any(p in members for p in b.buffer.params)]
        for group, params in zip(optimizer.param_groups, binding.groups, strict=True):
            pieces: list[nn.Parameter] = []
            for param in params:
                if param not in piece_of:
                    continue  # frozen: not sharded for the optimizer
                buffer, index = piece_of[param]
                piece, piece_param = buffer.pieces[index], buffer.piece_params[index]
                if param in old_state:
                    state = shard_param_state(
                        old_state[param], piece, buffer.layout.slots[index].shape, self.names[param]
                    )
                    optimizer.state[piece_param] = state
                pieces.append(piece_param)
            group["params"] = pieces

    # ------------------------------------------------------------------ training
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside skip the reduction where the stage allows it (gradient accumulation)."""
        with self.reducer.no_sync():
            yield

    def prepare_step(self, optimizer: Optimizer, loss_scale: float | None = None) -> bool:
        """Give ``optimizer``'s master pieces fp32 gradients, divided by ``loss_scale``; with a ``loss_scale`` the
        ranks agree whether any of them holds an inf/NaN. Returns whether the step may run (collective then).

        Parameters changed in place since the last step (e.g. weight clipping at stages 1 and 2) are first taken
        into the masters. A no-op without master copies. See [Note: mixed-precision model states].
        """
        overflow = torch.zeros((), dtype=torch.uint8, device=self.device)
        self._step_scale[id(optimizer)] = loss_scale
        for buffer, live in self._live_master_pieces(optimizer):
            if buffer.keep_full:  # stages 1 and 2; a stage-3 parameter changes only via gathered(write_back=True)
                buffer.refresh_master()
            if not live:
                continue
            assert buffer.master is not None
            flat = torch.empty_like(buffer.master)  # one allocation per bucket; finish_step frees it
            for piece, master_piece in live:
                step_grad = FlatParamBuffer.shard_view(flat, piece)
                step_grad.copy_(master_piece.held_grad)
                if loss_scale is not None:
                    step_grad.mul_(1.0 / loss_scale)
                    overflow |= ~torch.isfinite(step_grad).all()  # no host sync per piece
                master_piece.step_grad = step_grad
        if loss_scale is None:
            return True
        self.comm.all_reduce(overflow, op="max")
        return not overflow.item()

    def finish_step(self, optimizer: Optimizer, stepped: bool = True) -> None:
        """After ``optimizer`` updated this rank's shard (``stepped``): round masters into it and all-gather it
        (stages 1 and 2). Drops the fp32 step gradients either way."""
        binding = self.binding(optimizer)
        self.drop_step_grads(optimizer, keep_clipped=stepped)
        if stepped:
            for bucket in binding.buckets:
                bucket.buffer.master_to_shard()
        if stepped and self.config.stage < 3:
            works = [self.comm.all_gather(b.buffer.data, b.buffer.shard, async_op=True) for b in binding.buckets]
            wait_all(works)
        self.last_step_comm = self.comm.stats.reset()

    def drop_step_grads(self, optimizer: Optimizer, keep_clipped: bool = False) -> None:
        """Free the fp32 step gradients of ``optimizer``'s masters. With ``keep_clipped`` a gradient that clipping
        changed is written back (rescaled) into the held 16-bit one, which accumulates on if ``zero_grad`` is
        not called, as torch keeps a clipped gradient."""
        clipped = self._clipped.pop(id(optimizer), False) and keep_clipped
        scale = self._step_scale.pop(id(optimizer), None)
        for _, live in self._live_master_pieces(optimizer):
            for _, master_piece in live:
                if master_piece.step_grad is None:
                    continue
                if clipped:
                    master_piece.held_grad.copy_(master_piece.step_grad * (scale or 1.0))
                master_piece.step_grad = None

    def _live_master_pieces(
        self, optimizer: Optimizer
    ) -> Iterator[tuple[FlatParamBuffer, list[tuple[Piece, MasterPiece]]]]:
        """Per buffer of ``optimizer``: its master pieces that belong to this optimizer and hold a gradient.

        At stage 3 a buffer may hold the parameters of several optimizers; only this one's are returned.
        """
        own = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for bucket in self.binding(optimizer).buckets:
            buffer = bucket.buffer
            live = [
                (piece, master_piece)
                for piece, master_piece in zip(buffer.pieces, buffer.piece_params, strict=True)
                if isinstance(master_piece, MasterPiece) and id(master_piece) in own and master_piece.grad is not None
            ]
            yield buffer, live

    def clip_grad_norm_(self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip ``optimizer``'s gradients by their global norm over all shards; returns the norm (collective)."""
        grads = self._piece_grads(optimizer)
        device = self.device
        if math.isinf(norm_type):
            local = torch.stack([g.abs().max() for g in grads]).max() if grads else torch.zeros((), device=device)
            total = local.float().clone()
            self.comm.all_reduce(total, op="max")
        else:
            local = sum(
                (torch.linalg.vector_norm(g, norm_type).float() ** norm_type for g in grads),
                torch.zeros((), device=device),
            )
            self.comm.all_reduce(local, op="sum")
            total = local ** (1.0 / norm_type)
        # Same coefficient as torch.nn.utils.clip_grad_norm_.
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        self._clipped[id(optimizer)] = True
        for grad in grads:
            grad.mul_(coefficient.to(grad.dtype))
        return total

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        self._clipped[id(optimizer)] = True
        for grad in self._piece_grads(optimizer):
            grad.clamp_(min=-clip_value, max=clip_value)

    def sync_buffers(self) -> None:
        """Broadcast rank 0's module buffers (e.g. BatchNorm statistics), as DDP does before each forward."""
        with torch.no_grad():
            for buffer in self.module.buffers():
                self.comm.broadcast(buffer, src=0)

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()
        for unit in self.units:
            unit.remove_hooks()

    def register_hooks(self) -> None:
        """Undo :meth:`remove_hooks`: the engine drives the module again (e.g. evaluation after ``fit``)."""
        self.reducer.register_hooks()
        for unit in self.units:
            unit.register_hooks()

    # ------------------------------------------------------------------ stage 3
    @contextmanager
    def gathered(self, write_back: bool = False) -> Iterator[None]:
        """Hold every parameter in full inside the block (stage 3; a no-op before).

        With ``write_back`` changes made to the parameters inside (e.g. ``load_state_dict``) are kept.
        """
        for unit in self.units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in self.units:
                if write_back:
                    unit.write_back()
                unit.reshard()
            if write_back:
                for buffer in self.buffers:
                    buffer.refresh_master()

    def full_state_dict(self, keep: bool) -> dict[str, Tensor]:
        """The module's ``state_dict`` with full tensors, gathered one buffer at a time (collective).

        Parameters with a master copy get its values (fp32), so the result resumes a mixed-precision run exactly.
        Only ranks with ``keep`` (e.g. the one that writes the file) collect the tensors; the others hold one
        gathered buffer at a time and get ``{}``.
        """
        collected: dict[Tensor, Tensor] = {}
        for buffer in self.buffers:
            full = buffer.full_values(self.comm)
            if keep:
                collected.update(zip(buffer.params, (v.clone() for v in buffer.param_views(full)), strict=True))
            del full
        if not keep:
            return {}
        state = self.module.state_dict(keep_vars=True)
        return {key: collected[value] if value in collected else value.detach().clone() for key, value in state.items()}

    def load_state_dict(self, state_dict: Mapping[str, Tensor], strict: bool = True) -> None:
        """Load an ordinary (unsharded) ``state_dict`` into the module, its shards and master copies (collective)."""
        with self.gathered(write_back=True):
            self.module.load_state_dict(state_dict, strict=strict)
        with torch.no_grad():  # the masters take the saved values themselves, not their 16-bit rounding
            for buffer in self.buffers:
                if buffer.master is None:
                    continue
                for piece, param in zip(buffer.pieces, buffer.params, strict=True):
                    saved = state_dict.get(self.names[param])
                    if piece.numel and saved is not None:
                        values = saved.detach().reshape(-1)[piece.start : piece.end]
                        FlatParamBuffer.shard_view(buffer.master, piece).copy_(values)

    def release_full_params(self) -> None:
        """Stage 3: give every parameter its own full tensor again and stop sharding them (collective).

        A parameter with a master copy gets the master's values and dtype, so a new engine starts from them. The
        optimizer pieces keep their shards, so the optimizer state can still be saved.
        """
        for unit in self.units:
            for buffer in unit.buffers:
                full = buffer.full_values(self.comm)
                for param, values in zip(buffer.params, buffer.param_views(full), strict=True):
                    param.data = values.clone()
                del full
            unit.remove_hooks()
        self.units = []

    def unshard_root(self) -> None:
        """Gather the root unit: Lightning's step methods use it without calling the root's forward."""
        if self.units:
            self.units[-1].unshard()

    def reshard_all(self) -> None:
        """Free every unit; a step (or an evaluation batch) is over."""
        for unit in self.units:
            unit.reshard()
        if self.prefetcher is not None:
            self.prefetcher.end_pass()

    def _on_bucket_ready(self, bucket_index: int) -> None:
        unit = self._unit_of_bucket[bucket_index]
        if unit is None or unit.holds_frozen:
            return
        if all(bucket.ready for bucket in self._unit_buckets[unit]):
            unit.reshard()

    # ------------------------------------------------------------------ state
    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state this rank holds now."""
        managed = {p for b in self.buffers for p in b.params}
        unmanaged = [p for p in self.module.parameters() if p not in managed]
        params = sum(b.nbytes for b in self.buffers) + sum(tensor_nbytes(p) for p in unmanaged)
        step_grads = {  # fp32 gradients of the masters exist only during an optimizer step
            id(p.step_grad.untyped_storage()): p.step_grad.untyped_storage().nbytes()
            for b in self.buffers
            for p in b.piece_params
            if isinstance(p, MasterPiece) and p.step_grad is not None
        }
        grads = sum(b.nbytes for b in self.buckets) + sum(tensor_nbytes(p.grad) for p in unmanaged)
        states = [v for binding in self.bindings for s in binding.optimizer.state.values() for v in s.values()]
        masters = sum(b.master_nbytes for b in self.buffers)  # counted with the optimizer, as in the ZeRO paper
        return MemoryReport(
            params=params,
            gradients=grads + sum(step_grads.values()),
            optimizer_states=sum(map(tensor_nbytes, states)) + masters,
        )

    # ------------------------------------------------------------------ helpers
    def binding(self, optimizer: Optimizer) -> OptimizerBinding:
        """The buckets and original param groups of ``optimizer``."""
        for binding in self.bindings:
            if binding.optimizer is optimizer:
                return binding
        raise ValueError(f"{type(optimizer).__name__} is not managed by this ZeroEngine")

    def _piece_grads(self, optimizer: Optimizer) -> list[Tensor]:
        return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _split_by_dtype(params: list[nn.Parameter], keep_dtype: set[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` grouped by (dtype, device, in ``keep_dtype``), each group in the given order."""
    groups: dict[tuple[torch.dtype, torch.device, bool], list[nn.Parameter]] = {}
    for param in params:
        groups.setdefault((param.dtype, param.device, param in keep_dtype), []).append(param)
    return list(groups.values())


def _norm_params(module: nn.Module) -> set[nn.Parameter]:
    """Parameters of batch-norm layers. Their running statistics stay fp32, and CPU ``batch_norm`` (no autocast op)
    needs its weight in their dtype, so a 16-bit policy leaves these parameters in fp32 (as FSDP's mixed precision
    does): the optimizer updates them directly, without a master."""
    return {p for m in module.modules() if isinstance(m, _BatchNorm) for p in m.parameters(recurse=False)}
