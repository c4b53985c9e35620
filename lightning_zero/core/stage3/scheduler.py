"""Stage 3: when each gather unit is gathered and freed, in forward, in backward and between steps.

[Note: stage-3 backward plan]
Every rank must issue the same gathers in the same order, but in backward a rank gathers a unit only
when its own graph reaches it: a rank whose loss does not use a unit's output (or no parameter at all)
would skip gathers that the others wait in. So a backward follows a plan that every rank derives alike:
the units whose forward outputs required grad since the last plan, in reverse order of their forwards'
ends (so an outer unit comes before the units nested in it). The plan opens when the caller announces a
backward (``ZeroEngine.scale_loss``, which the Lightning glue calls before every backward): an event every
rank reaches, unlike the first unit a backward needs. When a rank needs a unit it issues the plan's entries
up to that unit's next one; the end of backward issues whatever is left. An entry whose unit is still
gathered issues nothing, and a unit with entries left is not freed, so that decision is the same on every
rank. Gathers run over a group of their own (core/comm/topology.py), so their order never has to interleave with
the reductions' identically on every rank. With a plan open, a unit needed with no entry left (a backward
of a graph whose units another backward already consumed: forward A, forward B, backward A, backward B)
raises instead of gathering out of order. A backward no plan announced (``torch.autograd.grad`` of an input,
as a gradient penalty or a saliency map computes, or a loop that does not call ``scale_loss``) gathers each
unit when it needs it, as it comes: every rank must then reach the same units.

[Note: a retained graph]
A backward with ``retain_graph=True`` (or ``create_graph=True``) may be followed by another backward over the same
graph (two losses of one forward: ``backward(l1, retain_graph=True); backward(l2)``). Its units were freed at its end,
so that next backward must gather them again, in the same order on every rank: the backward's plan entries become
the recorded units again (and the hooks that tell where a backward is stay), so the next announced backward opens the
same plan. They are kept until the next forward: a graph retained but never used again costs nothing, and a
retained graph used again after a new forward is refused as any backward of units without an entry. A backward
over a retained graph must be announced, with ``retain_graph`` (``ZeroEngine.scale_loss(loss, retain_graph=True)``;
Lightning's ``manual_backward`` and Fabric's ``backward`` pass it on): the hooks that tell a backward where it is are
removed at the end of the backward they fired in unless it retained its graph (left in place, they would keep every
graph's nodes alive, see :class:`GradHooks`), so an unannounced second backward would find no hook to gather for it.

[Note: units recomputed without gradients]
A unit whose outputs need no gradient (frozen, its inputs too: a frozen base layer of the first block of a LoRA
fine-tune) leaves no plan entry: backward never needs it. Inside an activation checkpoint it does: the checkpoint
runs the block's forward again inside backward, and that needs the unit gathered, in the same order on every rank.
So a forward of such a unit under saved-tensor hooks (those of a non-reentrant checkpoint; not torch's
``save_on_cpu``, which never recomputes, unless a checkpoint's hooks lie under it) records a plan entry without
gradient hooks; the recompute reaches it through its pre-forward hook, and its post-forward hook frees it
(no saved tensor of an operation without gradients refers to its parameters). A reentrant checkpoint runs its
forward without gradients: its units record their entries as units with gradients do (see [Note: reentrant
activation checkpointing at stage 3] in reentrant.py). A recompute by some other function that ran its forward
without gradients needs a unit without an entry: it raises, naming torch's checkpoint.

[Note: stage-3 prefetch]
With ``overlap_comm=True`` the order in which units were gathered for forward in the last pass
predicts the next unit: its all-gather starts as soon as the current one is gathered; in backward
the plan's next entry is issued as soon as backward reaches a unit, whether the unit's own entry was issued
then or by the prefetch before (once only the former did: every other unit was gathered unhidden). So at most
two units are gathered at a time besides the root (a unit is freed before the next one is reached, see
:meth:`GradHooks.on_first_gradient`), and the memory of the one freed goes to the next gather (see [Note:
reusing gathered storage]). A wrong guess costs memory for a while, never correctness.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from lightning_zero.core.comm import Communicator
from lightning_zero.core.layout.gather_memory import GatherMemory
from lightning_zero.core.stage3.backward_plan import BackwardPlan
from lightning_zero.core.stage3.divergence import GatherSequence
from lightning_zero.core.stage3.forward_order import ForwardOrder
from lightning_zero.core.stage3.grad_hooks import GradHooks
from lightning_zero.core.stage3.reentrant import in_reentrant_checkpoint
from lightning_zero.core.stage3.secondary import SecondaryShards
from lightning_zero.core.stage3.units import GatherUnit, held_gathered
from lightning_zero.core.store.stores import ShardStore


class Stage3Scheduler:
    """Gathers and frees the units of one module. See [Note: stage-3 life of a unit].

    Args:
        units: every unit, the root last.
        comm: the gather group (see core/comm/topology.py).
        prefetch: start the next unit's gather early (``overlap_comm``).
        on_passed_over: called with the units a backward issued the gathers of on its way to a later plan entry
            (see [Note: units a backward passes over]).
        secondary: the secondary group (``secondary_shard_size``): units keep their slices of it from forward to
            backward, whose gathers read them (see [Note: secondary shards]).
        quantize: forward and backward gathers send int8 (``quantize_weights``); :meth:`gathered` stays exact (see
            [Note: quantized gathers never reach the shard]).
    """

    def __init__(
        self,
        units: list[GatherUnit],
        comm: Communicator,
        prefetch: bool,
        on_passed_over: Callable[[list[GatherUnit]], None] = lambda units: None,
        secondary: Communicator | None = None,
        quantize: bool = False,
    ) -> None:
        self.units = units
        self.quantize = quantize
        for unit in units[:-1] if secondary is not None else ():  # the root stays gathered from forward to backward
            unit.secondary = SecondaryShards(secondary)
        self.root = units[-1]
        self.comm = comm
        self.prefetch = prefetch
        self.on_passed_over = on_passed_over
        self._index = {unit: index for index, unit in enumerate(units)}
        device = next((b.data.device for u in units for b in u.buffers), torch.device("cpu"))
        self.sequence = GatherSequence(comm, [unit.name for unit in units], device)  # see its note
        self.plan = BackwardPlan()  # recorded units, the open backward's entries, what keeps each unit gathered
        self._root_held = False  # the caller uses root parameters across backward passes (see hold_root)
        self._running_task: int | None = None  # the autograd graph task now running through units, until it ends
        self.forward_order = ForwardOrder()  # the prefetch's guess
        self.grad_hooks = GradHooks()  # on units' outputs and inputs
        self.memory = GatherMemory(device)  # see [Note: reusing gathered storage]
        for unit in units:
            unit.use_memory(self.memory)
        self.register_hooks()

    @property
    def pass_running(self) -> bool:
        """A backward reached units and has not ended: before another backward, that means it raised."""
        return self._running_task is not None

    def abandon_backward(self) -> None:
        """A backward raised: forget its plan and free what it gathered (not the root, which the step still uses);
        the entries recorded by a forward since then stay for the next backward."""
        self._running_task = None
        if not self.plan.is_open:
            return
        self.plan.close()
        for unit in self.units[:-1]:
            unit.reshard()
            unit.drop_secondary()
        self.memory.release()

    def register_hooks(self) -> None:
        for unit in self.units:
            unit.register_hooks(self._pre_forward_hook(unit), self._post_forward_hook(unit))

    def remove_hooks(self) -> None:
        for unit in self.units:
            unit.remove_hooks()

    # ------------------------------------------------------------------ between steps
    def _start(self, unit: GatherUnit, check: bool = True, backward: bool = False, exact: bool = False) -> None:
        """Start gathering ``unit`` (a no-op when gathered or started, on every rank alike). With ``check``, once every
        rank agreed that it gathers this unit now (see [Note: divergent control flow at stage 3]); the gathers of a
        backward plan need no check: every rank derives the same plan and issues its entries in order. A
        ``backward`` gather reads the unit's secondary slices where it kept some (see [Note: secondary shards]).
        ``exact``: never quantized, and a unit gathered quantized is gathered again (see [Note: quantized gathers
        never reach the shard])."""
        if not unit.buffers:  # a unit without parameters gathers nothing, anywhere
            return
        if exact and unit.quantized:
            unit.start_exact(self.comm)
        elif not unit.gathered_or_pending:
            if check:
                self.sequence.check(self._index[unit])
            if backward:
                unit.start_backward_unshard(self.comm, quantized=self.quantize)
            else:
                unit.start_unshard(self.comm, quantized=self.quantize and not exact)
            self.memory.release()  # what this gather did not take

    def _unshard(self, unit: GatherUnit, backward: bool = False, check: bool = True) -> None:
        self._start(unit, check=check, backward=backward)
        unit.wait()

    def begin_iteration(self) -> None:
        """Free every unit and forget any plan: a pass that raised left it (see :meth:`abandon_backward`)."""
        self.sequence.begin_iteration()
        self.abandon_backward()
        self.plan.forget()
        self.grad_hooks.remove(spent_only=False)  # forwards of earlier iterations get no backward any more
        self.forward_order.forget_pass()
        for unit in self.units:
            unit.reshard()
            unit.drop_secondary()
        self.memory.release()

    def join_evaluation(self) -> None:
        """This rank's evaluation loop ended: gather with the others until every rank's has (collective, see note)."""
        while (index := self.sequence.joined()) is not None:
            self._unshard(self.units[index], check=False)
            self.units[index].reshard()
        self.memory.release()

    def unshard_root(self) -> None:
        """Gather the root unit: Lightning's step methods use it without calling the root's forward."""
        self._unshard(self.root)

    def reshard_all(self) -> None:
        """Free every unit, the root too; a step (or an evaluation batch) is over. Forwards no backward followed
        leave no entries behind."""
        self.plan.drop_unplanned()
        for unit in self.units:
            unit.reshard()
            unit.drop_secondary()
        self.forward_order.end_pass()
        self.memory.release()

    @contextmanager
    def hold_root(self) -> Iterator[None]:
        """The root stays gathered inside the block, across backward passes: a Lightning ``training_step`` in
        manual optimization uses root parameters without calling the root's forward, before and after each
        ``manual_backward``."""
        self._root_held = True
        self.unshard_root()
        try:
            yield
        finally:
            self._root_held = False
            if not self.plan.is_open:
                self.root.reshard()

    def gathered(
        self, write_back: bool = False, stores: Callable[[], Iterable[ShardStore]] = tuple
    ) -> AbstractContextManager[None]:
        """Every unit gathered inside the block (collective), and held there: see :func:`held_gathered`."""
        return held_gathered(self.units, lambda unit: self._start(unit, exact=True), write_back, stores)

    # ------------------------------------------------------------------ forward
    def _pre_forward_hook(self, unit: GatherUnit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if _in_backward():  # activation checkpointing recomputes inside backward
                self._need(unit, recompute=True)
                return
            self._unshard(unit)
            following, after = self.forward_order.gathered(unit)
            if self.prefetch and following is not None:
                self._start(following)
                if after is not None:
                    after.read_ahead()  # shards resting on disk: read while this unit computes

        return hook

    def _post_forward_hook(self, unit: GatherUnit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            recomputing = _in_backward()
            if torch.is_grad_enabled():
                tensors = [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]
                if tensors:
                    if not recomputing:
                        self.plan.drop_retained()
                    self.grad_hooks.on_first_gradient(tensors, lambda: self._need(unit))
                    if not recomputing and not unit.is_root:
                        self.plan.record(unit)
                        self._hook_inputs(unit, args)
                        unit.keep_secondary()  # a plan entry: its backward gathers from the slices
                elif not unit.is_root:
                    self._outputs_need_no_gradient(unit, recomputing)
            elif not (recomputing or unit.is_root) and in_reentrant_checkpoint():  # backward runs it again
                self.plan.record(unit)
                unit.keep_secondary()
            if not recomputing and not (unit.is_root and torch.is_grad_enabled()):
                unit.reshard(keep=self.forward_order.expects_more(1 + self.prefetch))
            return output

        return hook

    def _outputs_need_no_gradient(self, unit: GatherUnit, recomputing: bool) -> None:
        """A forward with gradients enabled whose outputs need none: see [Note: units recomputed without gradients]."""
        if recomputing:  # nothing else frees it
            if not self.plan.keeps(unit):
                unit.reshard(keep=self.plan.pending)
        elif _may_be_recomputed():
            self.plan.record(unit)
            unit.keep_secondary()

    def _hook_inputs(self, unit: GatherUnit, args: Any) -> None:
        """When the gradients of a unit's inputs are computed, its backward is over: it may be freed then. Its
        parameters' gradients alone do not tell (autograd may still hold a view of a weight used detached)."""
        # Leaves are left out: torch.autograd.grad cannot tell whether it reaches them (a saliency map).
        inputs = [t for t in tree_leaves(args) if isinstance(t, Tensor) and t.requires_grad and t.grad_fn is not None]
        if inputs:
            self.grad_hooks.on_gradients(inputs, lambda: self._inputs_done(unit), mode="all")
            self.plan.inputs_hooked(unit)

    def _inputs_done(self, unit: GatherUnit) -> None:
        if self.plan.inputs_done(unit) and not self.plan.keeps(unit):
            unit.reshard(keep=self.plan.pending)

    # ------------------------------------------------------------------ backward
    def open_plan(self) -> None:
        """A backward is about to run (on every rank): the units recorded since the last plan, in reverse order."""
        # every rank records the same units: [Note: divergent control flow at stage 3]
        self.sequence.check_plan([self._index[u] for u in self.plan.recorded])
        self.plan.open()

    def _track_pass(self) -> None:
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._running_task:  # a backward (or autograd.grad) pass begins to use units
            self._running_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._pass_ended)

    def _need(self, unit: GatherUnit, recompute: bool = False) -> None:
        """Backward reached ``unit``: issue the plan up to its entry and wait. See [Note: stage-3 backward plan].

        Reaching a unit does not make a backward one that reduces: ``torch.autograd.grad`` of an input (a gradient
        penalty) reaches units too. The end of backward is queued by gradient hooks, or run by ``finish_backward``.
        ``recompute``: activation checkpointing runs the unit's forward again, with gradients enabled whatever the
        backward; the gradients of its outputs reach the unit next and tell whether the backward creates a graph."""
        self._track_pass()
        if torch.is_grad_enabled() and not recompute:  # autograd.grad(create_graph=True): its graph uses it again
            self.plan.pin(unit)
        if unit.is_root:
            self._unshard(unit)
            return
        if unit is self.plan.ahead:
            self.plan.ahead = None
        elif self.plan.has_entry(unit):
            self._issue_up_to(unit)
        elif not self.plan.is_open:
            self._unshard(unit, backward=True)  # no backward was announced: gathered when needed (see the note)
        elif not unit.gathered_or_pending:
            raise _no_entry_error(unit, recompute)
        if self.prefetch and self.plan.pending and self.plan.ahead is None:  # one entry ahead of the unit reached
            self.plan.ahead = self._issue_next()
            if self.plan.pending and not self.plan.peek().holds_secondary:
                self.plan.peek().read_ahead()
        unit.wait()

    def _issue_up_to(self, unit: GatherUnit) -> None:
        """Issue the plan's entries up to ``unit``'s. The unit prefetched before (if any) and those entries were
        not reached: this rank's graph went past them (see [Note: units a backward passes over])."""
        passed, self.plan.ahead = [self.plan.ahead] if self.plan.ahead is not None else [], None
        while (issued := self._issue_next()) is not unit:
            passed.append(issued)
        if passed:
            self.on_passed_over(passed)

    def _issue_next(self) -> GatherUnit:
        unit = self.plan.take()
        self._start(unit, check=False, backward=True)  # issues nothing when still gathered, on every rank alike
        return unit

    def _pass_ended(self) -> None:
        """The graph task that reached units ended normally (the plan stays for a later backward of the step)."""
        self._running_task = None

    def gradients_complete(self, unit: GatherUnit) -> None:
        """Every trainable parameter of ``unit`` got its gradient in this pass: free it, if nothing else tells when
        its backward is over (its inputs need no gradient) and it holds nothing frozen (whose backward may come
        later) and no plan entry is left for it."""
        if not (self.plan.keeps(unit) or unit.holds_frozen or unit.is_root):
            unit.reshard(keep=self.plan.pending)

    def finish_backward(self) -> None:
        """Issue the plan's remaining entries (units this rank's graph did not reach)."""
        self._flush_plan()

    def _flush_plan(self) -> None:
        while self.plan.pending:
            unit = self._issue_next()
            unit.wait()
            if not (self.plan.has_entry_or_pin(unit) or unit.is_root):
                unit.reshard(keep=self.plan.pending)

    def end_backward(self, retain: bool = False) -> None:
        """After the reductions: free every unit (the root unless held, see :meth:`hold_root`); the next forward
        records a new plan. ``retain``: the backward kept its graph, whose next backward needs its plan again (see
        [Note: a retained graph])."""
        self._running_task = None
        self.plan.close(retain)
        if not retain:
            self.grad_hooks.remove(spent_only=True)
        for unit in self.units if not self._root_held else self.units[:-1]:
            unit.reshard()
        for unit in self.units:
            unit.drop_secondary()
        self.forward_order.end_pass()
        self.memory.release()


def _no_entry_error(unit: GatherUnit, recompute: bool) -> RuntimeError:
    """A backward needs ``unit``, which no forward since the last backward left an entry for."""
    if recompute:
        return RuntimeError(
            f"ZeroStrategy(stage=3): unit {unit.name!r} is recomputed inside backward, but its forward ran without "
            "gradients and left no entry in the backward plan: a function other than torch.utils.checkpoint runs "
            "a module that holds units again inside backward, so the ranks cannot tell in forward that they will "
            "gather it. Use torch.utils.checkpoint (reentrant or not) or ZeroStrategy(activation_checkpointing=...)."
        )
    return RuntimeError(
        f"ZeroStrategy(stage=3): unit {unit.name!r} is needed by this backward pass, but no forward since the "
        "last backward left an entry for it: every rank must gather the same units in the same order, so a "
        "backward may only use units whose forward ran after the previous backward (e.g. not forward A, "
        "forward B, backward A, backward B). Run each backward right after its forward, or use stage 2. "
        "A second backward over a graph kept with retain_graph=True needs the first announced with it "
        "(engine.scale_loss(loss, retain_graph=True); Lightning's manual_backward and Fabric's backward do "
        "that)."
    )


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


_TOP_SAVED_TENSORS_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_SAVED_TENSORS_MOVED_BY = torch.autograd.graph.save_on_cpu.__module__  # its hooks copy to the host, never recompute


def _may_be_recomputed() -> bool:
    """Saved-tensor hooks are active that may recompute: a non-reentrant checkpoint's, or any but torch's own that
    only move what is saved (``save_on_cpu``, whose plan entry would cost one gather at the end of backward), at any
    depth of the stack of hooks (a checkpointed block may use ``save_on_cpu`` inside). See [Note: units recomputed
    without gradients]."""
    if _TOP_SAVED_TENSORS_HOOKS is None:
        return False
    popped = []  # torch shows the top of the stack only: look under it, then put it back
    try:
        while (hooks := _TOP_SAVED_TENSORS_HOOKS(False)) is not None:
            if getattr(hooks[0], "__module__", None) != _SAVED_TENSORS_MOVED_BY:
                return True
            popped.append(hooks)
            torch._C._autograd._pop_saved_tensors_default_hooks()
        return False
    finally:
        for hooks in reversed(popped):
            torch._C._autograd._push_saved_tensors_default_hooks(*hooks)
