"""The autograd hooks by which stage 3 learns where a backward is: when it reaches a unit, when a unit's inputs got
their gradients. They are owned here so that none outlives its step (see :meth:`GradHooks.on_gradients`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import register_multi_grad_hook


class GradHooks:
    """Gradient hooks that call back once; removed after the backward they fired in, or at the next iteration."""

    def __init__(self) -> None:
        self._live: dict[int, Any] = {}  # handles of every hook registered and not removed
        self._spent: list[Any] = []  # those that fired

    def __len__(self) -> int:
        return len(self._live)

    def on_gradients(self, tensors: list[Tensor], fn: Callable[[], None], mode: str) -> None:
        """Call ``fn`` when the gradients of ``tensors`` arrive (``mode`` as ``register_multi_grad_hook``'s). A hook
        that fired is removed after the backward (not inside it: autograd is iterating over it), one that never
        fired at the next iteration: torch's "all" hook holds the autograd nodes it is registered on, a cycle
        through C++ nodes that Python's collector does not free, which kept each step's graph nodes and hooks
        alive (resident memory grew every step, faster the more units)."""
        handles: list[Any] = []

        def fire(grads: Any) -> None:
            fn()
            self._spent.extend(handles)

        handles.append(register_multi_grad_hook(tensors, fire, mode=mode))
        self._live[id(handles[0])] = handles[0]

    def on_first_gradient(self, tensors: list[Tensor], fn: Callable[[], None]) -> None:
        """Call ``fn`` once per backward pass, when the first of ``tensors``' gradients arrives, but after the other
        hooks on those gradients: the next unit's inputs are this unit's outputs, and the hook that frees it fires on
        the same gradients. Autograd runs a node's pre-hooks after the hooks of the tensors it made, so as one,
        ``fn`` gathers this unit only once the next one is freed (as a tensor hook, it ran first: both units were
        gathered at once, with the full-size gradient of the freed one)."""
        if any(t.grad_fn is None for t in tensors):
            self.on_gradients(tensors, fn, mode="any")  # a leaf has no node to hook
            return
        nodes = list({id(t.grad_fn): t.grad_fn for t in tensors}.values())
        handles: list[Any] = []
        fired: set[int] = set()  # graph tasks in which fn ran

        def fire(grad_outputs: Any) -> None:
            task = torch._C._current_graph_task_id()
            if task not in fired:
                fired.add(task)
                fn()
                self._spent.extend(handles)

        handles.extend(node.register_prehook(fire) for node in nodes)
        for handle in handles:
            self._live[id(handle)] = handle

    def remove(self, spent_only: bool) -> None:
        """Remove the hooks that fired (after a backward), or all of them (a new iteration: forwards of earlier ones
        get no backward any more)."""
        for handle in self._spent if spent_only else list(self._live.values()):
            handle.remove()
            self._live.pop(id(handle), None)
        self._spent = []
