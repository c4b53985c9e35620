"""Reentrant activation checkpointing: telling a forward that will run again inside backward (stage 3), the module
whose parameters a checkpoint's backward reaches (stage 3), and a gradient hook inside that backward (every stage).

[Note: reentrant activation checkpointing at stage 3]
``torch.utils.checkpoint(fn, *args, use_reentrant=True)`` (Hugging Face's ``gradient_checkpointing_enable()``
before transformers 5, or when asked) runs ``fn`` without gradients in forward, so its units' outputs need none and
would leave no plan entry (see [Note: stage-3 backward plan]). Inside backward its node runs ``fn`` again with
gradients (the recompute gathers the units again) and then a backward of its own over that recomputed graph: a nested
graph task, in which the units' parameters get their gradients. Three things make that work:

- A unit's forward that runs inside the checkpoint's forward, with an input that needs a gradient (else the
  checkpoint's output needs none and no backward comes), records a plan entry as a unit with gradients does
  (:func:`in_reentrant_checkpoint`). The checkpoint's forward is found on the Python stack, where it sits below the
  unit's hooks.
- The outer graph reaches a checkpoint's parameters through its node only: the walk that tells which parameters a
  backward passes over (see [Note: units a backward passes over]) counts every parameter of the module it runs
  (:func:`checkpointed_module`) as reached, and every parameter where that module cannot be found.
- The end of backward is queued on the outer graph task: a nested task ends after each checkpoint's backward, long
  before the outer one. So: a gradient hook that runs in a nested task (found on the stack, below the
  checkpoint's backward) does not queue it; the outer task's next hook does, or ``finish_backward`` after it.

A parameter used twice, once inside a reentrant checkpoint (a layer reused in two checkpoints, or inside one and
outside it), gets a gradient in each graph task: no bucket can tell when it is complete. With ``overlap_comm=True``
the second one finds its bucket reduced and raises, naming ``use_reentrant=False`` and ``overlap_comm=False`` (which
reduces at the end of backward and trains as without the checkpoint). DDP (without ``static_graph``) and DeepSpeed
refuse such a use as well.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointFunction

_CHECKPOINT_FORWARD = CheckpointFunction.forward.__code__
_CHECKPOINT_BACKWARD = CheckpointFunction.backward.__code__


def in_reentrant_checkpoint() -> bool:
    """This forward runs inside a reentrant checkpoint's forward that backward will reach: one of its inputs needs a
    gradient."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CHECKPOINT_FORWARD:
            return any(isinstance(a, Tensor) and a.requires_grad for a in frame.f_locals.get("args", ()))
        frame = frame.f_back
    return False


def in_reentrant_backward() -> bool:
    """This gradient hook runs in the nested graph task of a reentrant checkpoint's backward."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _CHECKPOINT_BACKWARD:
            return True
        frame = frame.f_back
    return False


def checkpointed_module(node: Any) -> nn.Module | None:
    """The module a reentrant checkpoint's backward node runs again: the function it was given, a bound method of a
    module, or a ``functools.partial`` of either; ``None`` where it is none of these (a closure)."""
    function = node.run_function
    while isinstance(function, functools.partial):
        function = function.func
    if isinstance(function, nn.Module):
        return function
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None
