"""Stage 3: when each gather unit is gathered and freed, in forward, in backward and between steps.

[Note: stage-3 backward plan]
Every rank must issue the same gathers in the same order, but in backward a rank gathers a unit only
when its own graph reaches it: a rank whose loss does not use a unit's output (or no parameter at all)
would skip gathers that the others wait in. So backward follows a plan that every rank derives alike:
the units whose forward outputs required grad since the last backward, in reverse order of their
forwards' ends (so an outer unit comes before the units nested in it). When a rank needs a unit in
backward it issues the plan's entries up to that unit's next one; the end of backward issues whatever
is left. An entry whose unit is still gathered issues nothing, and a unit with entries left is not freed,
so that decision is the same on every rank. Gathers run over a group of their own (core/groups.py),
so their order never has to interleave with the reductions' identically on every rank. A unit needed
in backward with no entry left (a backward of a graph whose units another backward already consumed,
e.g. forward A, forward B, backward A, backward B) raises instead of gathering out of order.

[Note: stage-3 prefetch]
With ``overlap_comm=True`` the order in which units were gathered for forward in the last pass
predicts the next unit: its all-gather starts as soon as the current one is gathered; in backward
the plan's next entry is issued as soon as the current one is. So at most two units are gathered at
a time besides the root. A wrong guess costs memory for a while, never correctness.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from lightning_zero.core.comm import Communicator
from lightning_zero.core.stage3 import GatherUnit


class Stage3Scheduler:
    """Gathers and frees the units of one module. See [Note: stage-3 life of a unit].

    Args:
        units: every unit, the root last.
        comm: the gather group (see core/groups.py).
        prefetch: start the next unit's gather early (``overlap_comm``).
    """

    def __init__(self, units: list[GatherUnit], comm: Communicator, prefetch: bool) -> None:
        self.units = units
        self.root = units[-1]
        self.comm = comm
        self.prefetch = prefetch
        self._recorded: list[GatherUnit] = []  # units whose outputs need backward, in order of forward end
        self._plan: list[GatherUnit] = []  # the current backward's entries (reversed _recorded)
        self._cursor = 0  # next entry of _plan to issue
        self._remaining: Counter[GatherUnit] = Counter()  # entries left per unit
        self._in_backward = False  # a plan exists: a backward started since the last forward's end
        self._running_task: int | None = None  # the autograd graph task now running through units, until it ends
        self._order: list[GatherUnit] = []  # forward gather order of the last complete pass (prefetch)
        self._seen: list[GatherUnit] = []  # this pass's forward gather order so far
        self._forward_cursor = 0
        self.register_hooks()

    @property
    def pass_running(self) -> bool:
        """A backward reached units and has not ended: before another backward, that means it raised."""
        return self._running_task is not None

    def abandon_backward(self) -> None:
        """A backward raised: forget its plan and free what it gathered (not the root, which the step still uses);
        the entries recorded by a forward since then stay for the next backward."""
        self._running_task = None
        if not self._in_backward:
            return
        self._in_backward = False
        self._plan, self._cursor, self._remaining = [], 0, Counter()
        for unit in self.units[:-1]:
            unit.reshard()

    def register_hooks(self) -> None:
        for unit in self.units:
            unit.register_hooks(self._pre_forward_hook(unit), self._post_forward_hook(unit))

    def remove_hooks(self) -> None:
        for unit in self.units:
            unit.remove_hooks()

    # ------------------------------------------------------------------ between steps
    def begin_iteration(self) -> None:
        """Forget a pass that did not finish (an exception, a forward without backward) and free every unit."""
        self._recorded, self._plan, self._cursor, self._remaining = [], [], 0, Counter()
        self._in_backward, self._running_task = False, None
        self._seen, self._forward_cursor = [], 0
        for unit in self.units:
            unit.reshard()

    def unshard_root(self) -> None:
        """Gather the root unit: Lightning's step methods use it without calling the root's forward."""
        self.root.unshard(self.comm)

    def reshard_all(self) -> None:
        """Free every unit; a step (or an evaluation batch) is over."""
        for unit in self.units:
            unit.reshard()
        if self._seen:
            self._order, self._seen = self._seen, []
        self._forward_cursor = 0

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit gathered inside the block (collective)."""
        for unit in self.units:
            unit.start_unshard(self.comm)
        for unit in self.units:
            unit.wait()
        try:
            yield
        finally:
            for unit in self.units:
                unit.reshard()

    # ------------------------------------------------------------------ forward
    def _pre_forward_hook(self, unit: GatherUnit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if _in_backward():  # activation checkpointing recomputes inside backward
                self._need(unit)
                return
            unit.unshard(self.comm)
            self._seen.append(unit)
            self._prefetch_forward(unit)

        return hook

    def _post_forward_hook(self, unit: GatherUnit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            recomputing = _in_backward()
            if torch.is_grad_enabled():
                tensors = [t for t in tree_leaves(output) if isinstance(t, Tensor) and t.requires_grad]
                if tensors:
                    register_multi_grad_hook(tensors, lambda grads: self._need(unit), mode="any")
                    if not recomputing and not unit.is_root:
                        self._recorded.append(unit)
            if not recomputing and not (unit.is_root and torch.is_grad_enabled()):
                unit.reshard()
            return output

        return hook

    def _prefetch_forward(self, unit: GatherUnit) -> None:
        if not self.prefetch:
            return
        position = next((i for i in range(self._forward_cursor, len(self._order)) if self._order[i] is unit), None)
        if position is None:
            return
        self._forward_cursor = position + 1
        if position + 1 < len(self._order):
            self._order[position + 1].start_unshard(self.comm)

    # ------------------------------------------------------------------ backward
    def _start_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if task != -1 and task != self._running_task:  # a backward (or autograd.grad) pass begins to use units
            self._running_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._pass_ended)
        if self._in_backward:
            return
        self._in_backward = True
        self._plan, self._recorded, self._cursor = list(reversed(self._recorded)), [], 0
        self._remaining = Counter(self._plan)

    def _need(self, unit: GatherUnit) -> None:
        """Backward reached ``unit``: issue the plan up to its entry and wait. See [Note: stage-3 backward plan].

        Reaching a unit does not make a backward one that reduces: ``torch.autograd.grad`` of an input (a gradient
        penalty) reaches units too. The end of backward is queued by gradient hooks, or run by ``finish_backward``."""
        self._start_backward()
        if unit.is_root:
            unit.unshard(self.comm)
            return
        if self._remaining[unit]:
            while self._issue_next() is not unit:
                pass
            if self.prefetch and self._cursor < len(self._plan):
                self._issue_next()
        elif not unit.gathered_or_pending:
            raise RuntimeError(
                f"ZeroStrategy(stage=3): unit {unit.name!r} is needed by this backward pass, but no forward since the "
                "last backward left an entry for it: every rank must gather the same units in the same order, so a "
                "backward may only use units whose forward ran after the previous backward (e.g. not forward A, "
                "forward B, backward A, backward B). Run each backward right after its forward, or use stage 2."
            )
        unit.wait()

    def _issue_next(self) -> GatherUnit:
        unit = self._plan[self._cursor]
        self._cursor += 1
        self._remaining[unit] -= 1
        unit.start_unshard(self.comm)  # issues nothing when still gathered, on every rank alike
        return unit

    def _pass_ended(self) -> None:
        """The graph task that reached units ended normally (the plan stays for a later backward of the step)."""
        self._running_task = None

    def may_free(self, unit: GatherUnit) -> bool:
        """Whether ``unit`` may be freed in backward now that its gradients are complete."""
        return not unit.holds_frozen and not unit.is_root and not self._remaining[unit]

    def finish_backward(self) -> None:
        """Issue the plan's remaining entries (units this rank's graph did not reach), each freed once done."""
        self._start_backward()
        while self._cursor < len(self._plan):
            unit = self._issue_next()
            unit.wait()
            if not self._remaining[unit]:
                unit.reshard()

    def end_backward(self) -> None:
        """After the reductions: free every unit; the next forward records a new plan."""
        self._in_backward = False
        self._running_task = None
        self._plan, self._cursor, self._remaining = [], 0, Counter()
        self.reshard_all()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1
