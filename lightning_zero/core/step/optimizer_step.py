"""One optimizer's step over the shards: what it sees while ``optimizer.step()`` runs, and what follows.

[Note: the step window]
The optimizer's param groups hold the user's own parameters. Hooks on ``optimizer.step`` open a window
around the call: each managed parameter's ``data`` becomes its piece in the store (the shard, or the fp32
master), and its ``grad`` the piece's step gradient (made by :meth:`OptimizerStep.prepare` from the held,
reduced gradient: cast, divided by the loss scale); when the call returns, the parameter is a view of its
full buffer again, the stores finish (masters rounded into the shard) and stages 1 and 2 gather the new
shards. A step whose gradients overflowed on any rank runs with every ``grad`` empty, so the optimizer
changes nothing, on every rank. ``optimizer.zero_grad()`` empties the held gradients (see [Note: gradient
liveness]); the optimizer's class is swapped, once, for a subclass that does so first.

[Note: freeing gradients after the step]
torch keeps gradients until ``zero_grad``, and Lightning's automatic optimization calls it inside the next
iteration's closure, after ``training_step``: the held gradients of the last step live through the next forward.
With ``free_gradients_after_step`` each step empties the held gradients of its own parameters when it ends (stepped
or skipped for an overflow), as DeepSpeed's engine does, so the next backward makes them again. A parameter that
several optimizers step keeps its gradient until ``zero_grad``: each of them must step on it, in whatever order,
and a step prepared (clipped) before another one ends reads it. Nothing is communicated, so the order of
collectives is unchanged, and what an optimizer steps on is unchanged; only what reads gradients after the step sees
them empty. The step's peak still counts them (``ShardedModel.step_peak``): they were held through its backward
and step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence, Set
from enum import Enum, auto

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_zero.core.comm import wait_all
from lightning_zero.core.comm.topology import Topology
from lightning_zero.core.layout.resting import engine_access
from lightning_zero.core.mixed_precision import DynamicLossScaler
from lightning_zero.core.peak import PeakLedger
from lightning_zero.core.step.buckets import GradBucket
from lightning_zero.core.step.entry import StepEntry
from lightning_zero.core.step.loss_weight import LossWeights
from lightning_zero.core.step.paged import run_paged
from lightning_zero.core.step.step_grads import StepGrads
from lightning_zero.core.step.zero_grad import clearing_class


class StepState(Enum):
    """Where an optimizer is between two steps."""

    IDLE = auto()  # no step gradients exist
    PREPARED = auto()  # step gradients made (clipping may change them); optimizer.step() comes next
    STEPPING = auto()  # inside optimizer.step(): parameters hold their pieces


class LossScaling:
    """What the held gradients are divided by before a step: the fp16 loss scale (``scaler``) they were produced
    with, times the divisor of a weighted loss (see [Note: weighted loss])."""

    def __init__(self, scaler: DynamicLossScaler | None, weights: LossWeights | None = None) -> None:
        self.scaler = scaler
        self.weights = weights
        self.backward_scale: float | None = None  # every optimizer stepped on a backward's gradients unscales so

    def scale_for_step(self, loss_scale: float | None = None) -> float | None:
        scale = loss_scale
        if scale is None and self.scaler is not None:
            scale = self.backward_scale if self.backward_scale is not None else self.scaler.scale
        divisor = self.weights.divisor if self.weights is not None else None
        return scale if divisor is None else (scale or 1.0) * divisor

    @property
    def weight_skips(self) -> bool:
        """The step's global loss weight is 0: it changes nothing, and says nothing about overflow."""
        return self.weights is not None and self.weights.skips


def _norm_term(norm_type: float, device: torch.device) -> Callable[[Tensor], Tensor]:
    """One gradient's part of a ``norm_type`` norm over many, on the control ``device`` (offloaded gradients rest on
    the host): its largest magnitude for the infinity norm, else the sum of its magnitudes to the power."""
    if math.isinf(norm_type):
        return lambda g: g.abs().max().to(device)
    return lambda g: (torch.linalg.vector_norm(g, norm_type).float() ** norm_type).to(device)


class OptimizerStep:
    """The step of one optimizer over sharded parameters. See [Note: the step window].

    Args:
        optimizer: the user's optimizer (its param groups hold the module's parameters).
        entries: the managed parameters among its param groups.
        topology: the groups: clipping norms and the gather of new shards in the shard group, the agreements on
            overflow and I/O failures in the world group.
        device: where small control tensors (overflow flags, norms) live; NCCL needs the GPU.
        scaling: the loss scale shared by every optimizer of the engine.
        on_step_end: called after every step (the engine takes the step's communication counts).
        on_prepare: called before the step gradients are made (the engine agrees on the loss weight there).
        free_after_step: empty the held gradients when a step ends (see [Note: freeing gradients after the step]).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        entries: Sequence[StepEntry],
        topology: Topology,
        device: torch.device,
        scaling: LossScaling,
        on_step_end: Callable[[], None],
        on_prepare: Callable[[], None] = lambda: None,
        free_after_step: bool = False,
    ) -> None:
        self.optimizer = optimizer
        self.free_after_step = free_after_step
        # Per bucket (by id): the gradient bytes it held when this optimizer's last step ended (see step_peak).
        self.held_at_step_end: dict[int, int] = {}
        self.on_prepare = on_prepare
        self._weight_skipped = False
        self.comm, self.world = topology.shard, topology.world
        self.device = device
        self.scaling = scaling
        self.on_step_end = on_step_end
        self.state = StepState.IDLE
        self.steps_ended = 0  # steps whose window closed: every rank's count agrees (see HyperparameterAgreement)
        self.reductions_held = 0  # reducing backwards folded into the held gradients since the last zero_grad: too
        self._finite = True
        self.step_grads = StepGrads()
        self._handles: list[RemovableHandle] = []
        self._paging = False
        self.set_entries(entries)

    def set_entries(self, entries: Sequence[StepEntry], shared: Set[int] = frozenset()) -> None:
        """``shared``: ids of parameters that other optimizers step too (their gradients outlive this step)."""
        self.discard()
        self.entries = list(entries)
        self.step_grads.entries = self.entries
        self._managed = {id(entry.param) for entry in self.entries}
        self._freed_after_step = self._managed - shared
        self.step_grads.freed_after_step = self._freed_after_step if self.free_after_step else frozenset()
        self._buffers = list({id(e.store.buffer): e.store.buffer for e in self.entries}.values())
        self._stores = list({id(e.store): e.store for e in self.entries}.values())

    def install(self) -> None:
        """Hook ``optimizer.step`` and ``zero_grad`` (idempotent)."""
        if self._handles:
            return
        self._handles = [
            self.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self._enter()),
            self.optimizer.register_step_post_hook(lambda optimizer, args, kwargs: self._exit()),
        ]
        base = type(self.optimizer)
        if not getattr(base, "_zero_grad_clears_shards", False):
            self.optimizer.__class__ = clearing_class(base)
        self.optimizer._zero_step = self  # type: ignore[attr-defined]

    def uninstall(self) -> None:
        """Undo :meth:`install`: the optimizer is the user's plain optimizer again."""
        self.discard()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if getattr(type(self.optimizer), "_zero_grad_clears_shards", False):
            self.optimizer.__class__ = type(self.optimizer).__mro__[1]
        self.optimizer.__dict__.pop("_zero_step", None)

    # ------------------------------------------------------------------ before the step
    def prepare(self, loss_scale: float | None = None) -> bool:
        """Make the step gradients (once per step) and agree whether they are finite; returns whether the step
        may run (collective when the loss is scaled). See [Note: mixed-precision model states]."""
        self.abort()  # an earlier optimizer.step() raised inside the window
        if self.state is StepState.PREPARED:
            return self._finite
        self.on_prepare()
        scale = self.scaling.scale_for_step(loss_scale)
        for store in self._stores:
            if store.buffer.may_change_at_rest:  # parameters written in place since the last step
                store.sync_from_params()
        self.step_grads.make(scale)
        self._finite = True
        self._weight_skipped = self.scaling.weight_skips  # a step over no tokens (see [Note: weighted loss])
        if self._weight_skipped:
            self._finite = False
        elif scale is not None:
            overflow = self.step_grads.overflow(self.device)
            self.world.all_reduce(overflow, op="max")
            self._finite = not overflow.item()
        self.state = StepState.PREPARED
        return self._finite

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the step gradients by their global norm over all shards; returns the norm (collective)."""
        self.prepare()
        device = self.device
        terms = self.step_grads.per_gradient(_norm_term(norm_type, device))
        if math.isinf(norm_type):
            local = torch.stack(terms).max() if terms else torch.zeros((), device=device)
            total = local.float().clone()
            self.comm.all_reduce(total, op="max")
        else:
            total = sum(terms, torch.zeros((), device=device))
            self.comm.all_reduce(total, op="sum")
            total = total ** (1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch.nn.utils.clip_grad_norm_'s
        self.step_grads.transform(lambda grad: grad.mul_(coefficient.to(grad.device, grad.dtype)))
        return total

    def grad_norms(self, norm_type: float = 2.0) -> dict[int, Tensor]:
        """The norm of each parameter's step gradient over every shard (collective), by ``id`` of the parameter: those
        that got a gradient in this step. Before clipping when called first (``on_before_optimizer_step``)."""
        self.prepare()
        local = torch.zeros(len(self.step_grads.entries), dtype=torch.float32, device=self.device)
        for index, term in self.step_grads.per_entry(_norm_term(norm_type, self.device)).items():
            local[index] = term
        self.comm.all_reduce(local, op="max" if math.isinf(norm_type) else "sum")
        norms = local if math.isinf(norm_type) else local ** (1.0 / norm_type)
        return {
            id(entry.param): norms[index]
            for index, entry in enumerate(self.step_grads.entries)
            if entry.bucket.live[entry.slot]
        }

    def clip_grad_value_(self, clip_value: float) -> None:
        self.prepare()
        self.step_grads.transform(lambda grad: grad.clamp_(min=-clip_value, max=clip_value))

    def gradients(self) -> list[Tensor]:
        """The gradients the optimizer would see now, of this rank's pieces: the step gradients once prepared (cast,
        unscaled, clipped; copies for paged stores), else the held reduced ones."""
        if self.state is not StepState.IDLE:
            return self.step_grads.current()
        return [grad for entry in self.entries if (grad := entry.bucket.held(entry.slot)) is not None]

    def zero_grad(self, set_to_none: bool, only: set[int] | None = None) -> None:
        """``optimizer.zero_grad()``: empty (or zero) the held gradients of this optimizer's parameters (of those
        whose ``id`` is in ``only``, for a module's ``zero_grad``)."""
        self.discard()
        self.reductions_held = 0
        by_bucket: dict[int, tuple[GradBucket, list[int]]] = {}
        for entry in self.entries:
            if only is None or id(entry.param) in only:
                by_bucket.setdefault(id(entry.bucket), (entry.bucket, []))[1].append(entry.slot)
        for bucket, slots in by_bucket.values():
            bucket.clear(slots, set_to_none)

    # ------------------------------------------------------------------ the step window
    def _enter(self) -> None:
        if self._paging:
            return
        finite = self.prepare()
        self._check_unmanaged()
        self.state = StepState.STEPPING
        with torch.no_grad(), engine_access():
            for entry, grad in zip(self.entries, self.step_grads.made, strict=True):
                buffer = entry.store.buffer
                entry.param.grad = None
                entry.param.data = buffer.shaped(entry.store.step_view(entry.slot), entry.slot)
                # A tensor another rank owns whole gets no grad: no state here (see [Note: owner layout]).
                stepped = finite and grad is not None and not buffer.owned_elsewhere(entry.slot)  # (paged: None)
                entry.param.grad = buffer.shaped(grad, entry.slot) if stepped else None
            if finite and self.step_grads.paged:
                self._step_paged()

    def _step_paged(self) -> None:
        """Step the parameters of paged stores here, one store at a time (see [Note: paged optimizer steps]); the
        call of ``optimizer.step()`` that follows sees them without gradients and leaves them alone."""
        others = {id(p): p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None}
        params = {id(p): p for g in self.optimizer.param_groups for p in g["params"]}
        for key in others:
            params[key].grad = None  # hidden from the paged steps, given back for the call itself
        raw = getattr(type(self.optimizer).step, "__wrapped__", None)
        try:
            run_paged(
                self.optimizer,
                self.step_grads.paged.work(),
                (lambda: raw(self.optimizer)) if raw is not None else self._reentrant_step,
                self.world,
                self.device,
            )
        finally:
            for key, grad in others.items():
                params[key].grad = grad

    def _reentrant_step(self) -> None:
        """``optimizer.step()`` with the step hooks passing through (an optimizer whose step torch did not wrap)."""
        self._paging = True
        try:
            self.optimizer.step()
        finally:
            self._paging = False

    def _exit(self) -> None:
        if self.state is not StepState.STEPPING or self._paging:
            return
        with torch.no_grad(), engine_access():
            for entry in self.entries:
                entry.param.grad = None
            for buffer in self._buffers:
                buffer.restore_param_views()
        if self._finite:
            for store in self._stores:
                store.finish()
        for buffer in self._buffers:
            buffer.settle()  # offload_params="nvme": shards read for the step go back to disk
        self.step_grads.release()  # the wide step gradients go before the gather of new shards needs its memory
        if self._finite:
            wait_all([buffer.publish(self.comm) for buffer in self._buffers])
        self._end_step(stepped=self._finite)

    def abort(self) -> None:
        """A step that raised inside ``optimizer.step()``: parameters back to their views, nothing finished; the
        step gradients stay, so a retried ``optimizer.step()`` steps on them."""
        if self.state is StepState.STEPPING:
            with torch.no_grad(), engine_access():
                for entry in self.entries:
                    entry.param.grad = None
                for buffer in self._buffers:
                    buffer.restore_param_views()
            self.step_grads.paged.rewind()
            self.state = StepState.PREPARED

    def discard(self) -> None:
        """The prepared step will not come (a new backward, ``zero_grad``, a skipped step): drop its gradients."""
        if self.state is StepState.PREPARED:
            self.step_grads.release()
            self.state = StepState.IDLE

    def skip(self) -> None:
        """The caller decided not to step (e.g. ``training_step`` returned ``None``)."""
        self.discard()
        self.on_step_end()

    def _end_step(self, stepped: bool) -> None:
        self.steps_ended += 1
        self.step_grads.release()
        self.state = StepState.IDLE
        if self.step_grads.scale is not None and self.scaling.scaler is not None and not self._weight_skipped:
            self.scaling.scaler.update(found_inf=not stepped)
        self.held_at_step_end = {id(entry.bucket): entry.bucket.nbytes for entry in self.entries}
        if self.free_after_step:
            self.zero_grad(set_to_none=True, only=self._freed_after_step)
        self.on_step_end()

    def _check_unmanaged(self) -> None:
        """A trainable parameter that the engine does not shard must not be stepped on its local gradient."""
        for group_index, group in enumerate(self.optimizer.param_groups):
            for param in group["params"]:
                if id(param) not in self._managed and param.requires_grad and param.grad is not None:
                    raise RuntimeError(
                        f"{type(self.optimizer).__name__} param group {group_index} holds a parameter of shape "
                        f"{tuple(param.shape)} that became trainable (or joined the optimizer) after this training "
                        "iteration started, so its gradient was not reduced across ranks. ZeroStrategy takes such "
                        "changes at the start of each iteration: unfreeze or add_param_group before training_step "
                        "(e.g. in on_train_epoch_start or on_train_batch_start)."
                    )

    @property
    def step_grad_nbytes(self) -> int:
        """Bytes of step gradients held now (wide copies of the masters' gradients exist only during a step)."""
        return self.step_grads.nbytes

    @property
    def ledger(self) -> PeakLedger:
        """Counts the step gradients (see [Note: step peak ledger]); the model attaches its own."""
        return self.step_grads.ledger

    @ledger.setter
    def ledger(self, ledger: PeakLedger) -> None:
        self.step_grads.ledger = ledger
