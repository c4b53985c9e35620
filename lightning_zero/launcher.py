"""The spawn/fork launcher of ZeroStrategy: Lightning's, handing the main process the gathered weights.
See [Note: destroying the groups when a rank ends] in process_exit.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from torch import Tensor, nn
from typing_extensions import override

from lightning_zero import collectives
from lightning_zero.core.comm import destroy_groups
from lightning_zero.process_exit import note_exception


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
            collectives.post_failure(self._strategy.session.comm, error)
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


@contextmanager
def _state_dict_returning(module: nn.Module, state: dict[str, Tensor]) -> Iterator[None]:
    """Inside the block ``module.state_dict()`` returns ``state`` (the base launcher's only way to get weights)."""
    module.state_dict = lambda *args, **kwargs: state  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.state_dict
