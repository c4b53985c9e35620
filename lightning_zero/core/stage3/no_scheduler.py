"""Stages 1 and 2 have nothing to gather: a scheduler that does nothing, so the engine never asks the stage."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from lightning_zero.core.stage3.units import GatherUnit
from lightning_zero.core.store.stores import ShardStore


class NoScheduler:
    """Stages 1 and 2: every parameter is held in full, so there is nothing to gather or free. The engine talks to
    it as to a :class:`~lightning_zero.core.stage3.scheduler.Stage3Scheduler`, without asking which stage it runs."""

    units: tuple[GatherUnit, ...] = ()
    pass_running = False

    def abandon_backward(self) -> None:
        pass

    def begin_iteration(self) -> None:
        pass

    def register_hooks(self) -> None:
        pass

    def remove_hooks(self) -> None:
        pass

    def unshard_root(self) -> None:
        pass

    def join_evaluation(self) -> None:
        pass

    def reshard_all(self) -> None:
        pass

    def open_plan(self) -> None:
        pass

    def finish_backward(self) -> None:
        pass

    def end_backward(self, retain: bool = False) -> None:
        pass

    def gradients_complete(self, unit: GatherUnit) -> None:
        pass

    @contextmanager
    def hold_root(self) -> Iterator[None]:
        yield

    @contextmanager
    def gathered(self, write_back: bool = False, stores: Callable[[], Iterable[ShardStore]] = tuple) -> Iterator[None]:
        yield
