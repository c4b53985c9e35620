"""BackwardPass: drives one model's backward passes: the loss scale, the gradient hooks and their reductions, the
stage-3 backward plan, and the end of backward on every rank (see the engine's module docstring, step 3).

The reducer is built once the model's buffer groups exist, and buckets made after setup join it (see [Note:
changes after setup]); the scheduler is the stage's (a do-nothing one at stages 1 and 2).
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

from lightning_zero.core.comm import Communicator
from lightning_zero.core.comm.hyperparams import HyperparameterAgreement
from lightning_zero.core.shards import ShardedModel
from lightning_zero.core.stage3.reachability import reached_leaves
from lightning_zero.core.stage3.reentrant import in_reentrant_backward
from lightning_zero.core.stage3.units import GatherUnit
from lightning_zero.core.step.buckets import BucketState, GradBucket
from lightning_zero.core.step.optimizer_step import LossScaling
from lightning_zero.core.step.reducer import GradReducer


class BackwardPass:
    """The backward side of one engine.

    Args:
        model: the buffer groups, steps and scheduler.
        comm: every rank (the end-of-backward agreements).
        overlap_comm: reduce buckets while backward still runs.
        stage: 1 keeps full local gradients inside :meth:`no_sync`; 2 and 3 reduce in every backward.
        scaling: the fp16 loss scale and the loss weights.
    """

    def __init__(
        self, model: ShardedModel, comm: Communicator, overlap_comm: bool, stage: int, scaling: LossScaling
    ) -> None:
        self.model = model
        self.scaling = scaling
        # Every rank steps with the same hyper-parameters: see [Note: agreeing on hyper-parameters].
        self.hyperparameters = HyperparameterAgreement(
            comm,
            model.optimizers,
            lambda: {id(step.optimizer): (step.steps_ended, step.reductions_held) for step in model.steps},
        )
        self.reducer = GradReducer(
            model.buckets,
            comm,
            overlap_comm,
            reduce_every_backward=stage >= 2,
            on_backward_event=self._on_gradient,
            on_bucket_ready=self._on_bucket_ready if stage == 3 else None,
            rider=self.hyperparameters,
        )
        self._end_queued = False
        self._ended = False  # the end of backward ran from autograd; finish() consumes it
        self._roots: list[object] = []  # the grad_fn of the loss given to scale_loss, until backward ends
        self._retain = False  # the announced backward keeps its graph (see [Note: a retained graph])
        self._reached: Container[int] | None = None  # leaves its graph reaches, once asked (see _passed_over)
        self._task_seen, self._task_nested = -1, False  # the graph task of the last gradient hook; a nested one

    def add_buckets(self, buckets: Sequence[GradBucket]) -> None:
        self.reducer.add_buckets(buckets)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside skip the reduction where the stage allows it (gradient accumulation)."""
        with self.reducer.no_sync():
            yield

    @property
    def in_no_sync(self) -> bool:
        """Inside :meth:`no_sync` (a micro-batch of gradient accumulation that is not the last)."""
        return self.reducer.in_no_sync

    def remove_hooks(self) -> None:
        self.reducer.remove_hooks()
        self.model.scheduler.remove_hooks()

    def register_hooks(self) -> None:
        """Undo :meth:`remove_hooks`: the engine drives the module again (e.g. evaluation after ``fit``)."""
        self.reducer.register_hooks()
        self.model.scheduler.register_hooks()

    def reset(self) -> None:
        """Forget a backward pass that raised. See [Note: bucket state]."""
        self.reducer.reset()
        self.model.scheduler.abandon_backward()
        self._end_queued = self._ended = self._retain = False
        self._roots, self._reached = [], None

    def scale_loss(self, loss: Tensor, retain_graph: bool = False) -> Tensor:
        """The loss to call ``backward()`` on: times the fp16 loss scale. A backward that raised since the last one
        is forgotten here, so a retry inside the same iteration starts clean, and prepared steps are stale (the
        backward changes the held gradients). ``retain_graph``: the backward keeps its graph for another one (see
        [Note: a retained graph])."""
        scheduler = self.model.scheduler
        if (
            self._end_queued
            or scheduler.pass_running
            or any(b.state is not BucketState.IDLE for b in self.model.buckets)
        ):
            self.reset()
        for step in self.model.steps:
            step.discard()
        scheduler.open_plan()  # see [Note: stage-3 backward plan]
        self._retain = retain_graph
        self._roots, self._reached = [loss.grad_fn], None  # see [Note: units a backward passes over]
        scaler = self.scaling.scaler
        if scaler is None:
            return loss
        self.scaling.backward_scale = scaler.scale  # every optimizer stepped on these gradients unscales by it
        return loss * scaler.scale

    def retain_announced(self) -> None:
        """The backward announced by :meth:`scale_loss` keeps its graph (``retain_graph`` known only later)."""
        self._retain = True

    def finish(self) -> None:
        """After every ``backward()``: where this rank's loss reached no trainable parameter, no hook ran, so the end
        of backward runs here, in step with the other ranks."""
        if self._ended:
            self._ended = False
            return
        self._run_end()

    def _on_gradient(self) -> None:
        """A gradient hook ran: queue the end of backward on the graph task running, unless it is a reentrant
        checkpoint's, which ends before the backward does (then the outer task's next hook, or :meth:`finish`, runs
        the end: see [Note: reentrant activation checkpointing at stage 3])."""
        task = torch._C._current_graph_task_id()
        if task != self._task_seen:
            self._task_seen, self._task_nested = task, in_reentrant_backward()
        if not (self._end_queued or self._task_nested):
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._end_queued = True

    def _end_of_backward(self) -> None:
        self._end_queued = False
        self._run_end()
        self._ended = True

    def _run_end(self) -> None:
        # Reductions are launched before stage-3 gathers are waited for: another rank may be waiting in a
        # reduction before it issues the gather this rank waits in (see [Note: stage-3 backward plan]).
        scheduler = self.model.scheduler
        self.reducer.launch_remaining()
        scheduler.finish_backward()
        reducing = self.reducer.reducing
        self.reducer.finish()
        for step in self.model.steps if reducing else ():  # agreed at the next reducing backward
            step.reductions_held += 1
        scheduler.end_backward(retain=self._retain)
        self._roots, self._reached, self._retain = [], None, False

    def passed_over(self, units: list[GatherUnit]) -> None:
        """Stage 3: this rank's backward issued the gathers of ``units`` on its way to a later unit; their trained
        parameters that its graph does not reach get no gradient in this pass. See [Note: units a backward passes
        over]."""
        if self._reached is None:
            self._reached = reached_leaves(self._roots)
        groups = {id(group.buffer): group for group in self.model.trained}
        for unit in units:
            for buffer in unit.buffers:
                group = groups.get(id(buffer))
                if group is not None:
                    unreached = [s for s, p in enumerate(buffer.params) if id(p) not in self._reached]
                    self.reducer.skip(group.bucket, unreached)  # type: ignore[arg-type]

    def _on_bucket_ready(self, bucket_index: int) -> None:
        """Stage 3: once every bucket of a unit is complete, the scheduler may free the unit."""
        trained = self.model.trained
        unit = trained[bucket_index].unit
        if unit is not None and all(g.bucket.ready for g in trained if g.unit is unit):  # type: ignore[union-attr]
            self.model.scheduler.gradients_complete(unit)
