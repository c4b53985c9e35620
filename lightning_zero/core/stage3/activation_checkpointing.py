"""Activation checkpointing: selected modules keep no activations in forward and recompute them in backward."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_zero.core.stage3.units import WrapPolicy, policy_matcher, warn_unmatched_policy


def apply_activation_checkpointing(root: nn.Module, policy: WrapPolicy) -> list[nn.Module]:
    """Make the forward of each module chosen by ``policy`` (classes or a callable) a non-reentrant checkpoint.

    The modules, their parameters and ``state_dict`` keys stay as they are; only ``forward`` is wrapped.
    Stage 3 works as usual: recomputation runs inside backward, where the unit is gathered (see [Note:
    stage-3 life of a unit]). Returns the modules that were wrapped.
    """
    if policy is None:
        return []
    matches = policy_matcher(policy)
    chosen = [module for module in root.modules() if module is not root and matches(module)]
    if not chosen:
        warn_unmatched_policy(root, policy, "activation_checkpointing", "no activations are recomputed")
    for module in chosen:
        module.forward = _checkpointed(module.forward)
    return chosen


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
