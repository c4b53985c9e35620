"""Whether the trainable parameters or an optimizer's param groups changed since the engine last looked.

See [Note: changes after setup] below. The check runs before every training iteration: a fingerprint
of each optimizer's parameters, and of the ``requires_grad`` of those the engine holds no bucket for (a managed
parameter frozen and unfrozen, as Lightning's ``toggle_optimizer`` does, changes nothing the engine holds), then
one 2-byte all-reduce so that every rank takes a change together, or every rank raises.

[Note: changes after setup]
A parameter frozen when the engine was built holds no gradient bucket. When it becomes trainable and an
optimizer holds it (``requires_grad_(True)`` on a parameter of a param group, ``add_param_group``, Lightning's
``BaseFinetuning``), ``begin_iteration`` notices the change (a fingerprint of each optimizer's parameters and
their ``requires_grad``), agrees on it with the other ranks (one small all-reduce per iteration; ranks that
disagree raise) and shards those parameters: stages 1 and 2 pack them into new buckets, stage 3 splits the
frozen buffers of their units. Nothing else is touched: the other buffers, gradients and optimizer state stay.
Plain DDP never reduces a parameter that was frozen when it wrapped the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim import Optimizer

from lightning_zero.core.comm.communicator import Communicator


class ChangeWatch:
    """Notices, with the other ranks, that an optimizer holds parameters the engine has not sharded yet."""

    def __init__(self, optimizers: Sequence[Optimizer], comm: Communicator, device: torch.device) -> None:
        self.optimizers = list(optimizers)
        self.comm = comm
        self._flags = torch.zeros(2, dtype=torch.uint8, device=device)  # [some rank changed, some rank did not]
        self._seen: tuple[object, ...] = ()

    def remember(self, managed: set[int]) -> None:
        """The state the engine has just taken (``managed``: ids of the parameters it holds buckets for)."""
        self._seen = self._fingerprint(managed)

    def changed(self, managed: set[int]) -> bool:
        """Whether every rank sees a change since :meth:`remember` (collective); raises where ranks disagree."""
        changed = self._fingerprint(managed) != self._seen
        self._flags[0], self._flags[1] = int(changed), int(not changed)
        self.comm.all_reduce(self._flags, op="max", label="agree")
        if bool(self._flags[0]) and bool(self._flags[1]):
            everyone = self.comm.all_gather_object(changed)
            raise RuntimeError(
                "ranks disagree on which parameters are trainable or in an optimizer: ranks "
                f"{[r for r, c in enumerate(everyone) if c]} changed them since the last iteration, ranks "
                f"{[r for r, c in enumerate(everyone) if not c]} did not. Unfreeze parameters and add param groups "
                "on every rank alike (e.g. in a callback, which runs on every rank)."
            )
        return changed

    def _fingerprint(self, managed: set[int]) -> tuple[object, ...]:
        return tuple(
            (id(p), p.requires_grad if id(p) not in managed else None)
            for o in self.optimizers
            for g in o.param_groups
            for p in g["params"]
        ) + tuple(len(o.param_groups) for o in self.optimizers)
