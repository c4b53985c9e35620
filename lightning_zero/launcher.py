"""The spawn/fork launcher of ZeroStrategy: Lightning's, handing the main process the gathered weights; and the end
of a rank's process groups whatever started it.

[Note: destroying the groups when a rank ends]
A rank that ends with its gloo groups alive may abort in interpreter teardown (see [Note: groups alive at exit] in
core/comm/communicator.py), so after a run that ended well they are destroyed while the interpreter is whole: by the
spawn/fork worker when ``fit`` returned, and, for ranks that run the script themselves (Lightning's ``"popen"``
launcher, torchrun, a cluster's launcher), by an exit hook the strategy registers when it sets up the process group. The
groups stay until exit: a second ``fit``, ``trainer.test`` or the user's own collectives may follow. Once this
process saw an exception (the strategy's ``on_exception``, the worker's, or one that ends the script) the hook
leaves them: destroying a group with a collective in flight waits for the other ranks, which may never come.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from torch import Tensor, nn
from typing_extensions import override

from lightning_zero.core.comm import destroy_groups


class ZeroMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's ``"spawn"``/``"fork"`` launcher. After ``fit``, rank 0 sends the main process the module's weights;
    Lightning reads them from ``module.state_dict()``, which at stage 3 holds only freed shards and in 16-bit runs
    only the rounded parameters. Here every rank gathers them (with the fp32 masters) one buffer at a time instead.
    """

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(*args, **kwargs)
        except BaseException as error:
            # A spawned rank's exception never reaches Lightning's interrupt handling (the main process gets it):
            # the other ranks learn of it here, while this process still lives (see [Note: a rank that raises and
            # stays alive]).
            note_exception()
            comm = getattr(self._strategy, "_comm", None)
            if comm is not None:
                comm.post_failure(error)
            raise
        # Every rank is past its last collective (see [Note: destroying the groups when a rank ends]).
        destroy_groups()

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        engine = getattr(self._strategy, "_engine", None)
        if engine is None:
            return super()._collect_rank_zero_results(trainer, results)
        full = engine.full_state_dict(keep=self._strategy.local_rank == 0)  # collective
        with _state_dict_returning(trainer.lightning_module, full):
            return super()._collect_rank_zero_results(trainer, results)


class _Exit:
    """This process's exit hook: registered once; ``raised`` once an exception was seen."""

    registered = False
    raised = False


def destroy_groups_at_exit() -> None:
    """Destroy the process groups when this process exits, unless it saw an exception (see [Note: destroying the
    groups when a rank ends]). Registered once per process."""
    if not _Exit.registered:
        _Exit.registered = True
        atexit.register(_destroy_groups_unless_raised)


def note_exception() -> None:
    """This process saw an exception in a run: its groups stay at exit."""
    _Exit.raised = True


def _destroy_groups_unless_raised() -> None:
    uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # an exception ended the script
    if not (_Exit.raised or uncaught is not None):
        destroy_groups()


@contextmanager
def _state_dict_returning(module: nn.Module, state: dict[str, Tensor]) -> Iterator[None]:
    """Inside the block ``module.state_dict()`` returns ``state`` (the base launcher's only way to get weights)."""
    module.state_dict = lambda *args, **kwargs: state  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.state_dict
