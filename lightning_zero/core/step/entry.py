"""StepEntry: one parameter an optimizer trains, with its slot, its store and its gradient bucket."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_zero.core.step.buckets import GradBucket
from lightning_zero.core.store.stores import ShardStore


@dataclass(frozen=True)
class StepEntry:
    """A parameter the optimizer trains, and where its shard lives."""

    param: nn.Parameter
    slot: int
    store: ShardStore
    bucket: GradBucket
