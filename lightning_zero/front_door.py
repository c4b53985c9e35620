"""What the Trainer's ``ZeroStrategy`` and Fabric's ``ZeroFabricStrategy`` have alike, as a mixin over either one's
``ParallelStrategy``: the options, the ranks and devices, the start of the process group, the strategy's own
collectives and the reports. Imports no ``lightning.pytorch``.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from lightning_zero import collectives
from lightning_zero.config import PRESETS, START_METHODS, ZeroConfig, zero_config
from lightning_zero.core.comm import CommStats, Communicator
from lightning_zero.core.memory import MemoryReport
from lightning_zero.process_exit import destroy_groups_at_exit, note_exception
from lightning_zero.session import ZeroSession

T = TypeVar("T")
CONFIG_ARGUMENTS = tuple(inspect.signature(zero_config).parameters)


class ZeroFrontDoor:
    """A strategy over one :class:`~lightning_zero.session.ZeroSession`. The strategy class provides
    ``parallel_devices``, ``local_rank``, ``node_rank``, ``global_rank`` and ``cluster_environment``."""

    config: ZeroConfig
    session: ZeroSession
    parallel_devices: list[torch.device] | None
    cluster_environment: Any

    def _take_options(self, arguments: Mapping[str, Any], start_method: str) -> None:
        """Check and keep the options (``arguments``: the strategy's ``__init__`` arguments) and make the session."""
        self.config = zero_config(**{name: arguments[name] for name in CONFIG_ARGUMENTS})
        if start_method not in START_METHODS:
            raise ValueError(f"start_method={start_method!r} is not supported; choose one of {list(START_METHODS)}.")
        self._start_method = start_method
        self._num_nodes = 1
        self.session = ZeroSession(self.config)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """The registry strings ``"zero_1"``-``"zero_3"``, ``"zero_2_offload"``, ``"zero_3_offload"``."""
        for name, (init_params, description) in PRESETS.items():
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=description, **init_params)

    # ------------------------------------------------------------------ ranks and devices
    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]  # type: ignore[attr-defined]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}  # type: ignore[attr-defined]

    @property
    def process_group_backend(self) -> str:
        return self.config.process_group_backend or _get_default_process_group_backend_for_device(self.root_device)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)  # type: ignore[attr-defined]
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    _set_world_ranks = set_world_ranks  # Fabric's name for it

    def _start_process_group(self) -> None:
        """Join (or create) the process group, with the configured backend and timeout, and the session's
        communicator over it; its groups are destroyed at exit (see [Note: destroying the groups when a rank ends]
        in process_exit.py)."""
        self.set_world_ranks()
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self.process_group_backend, timeout=self.config.timeout, device_id=device_id
        )
        self.session.comm = Communicator(ranks_per_node=self.num_processes)
        destroy_groups_at_exit()

    # ------------------------------------------------------------------ the strategy's collectives
    # Through the communicator, so that a waiting rank stops when another raised: see [Note: the strategy's
    # collectives] in collectives.py.
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        collectives.barrier(self.session.comm, self.root_device)

    def broadcast(self, obj: T, src: int = 0) -> T:
        return collectives.broadcast(self.session.comm, obj, src)

    def on_exception(self, exception: BaseException) -> None:
        """This rank raised: the other ranks stop waiting for it within a fraction of a second, with an error naming
        it and its exception (see [Note: a rank that raises and stays alive]). Its groups stay at exit (see [Note:
        destroying the groups when a rank ends])."""
        note_exception()
        collectives.post_failure(self.session.comm, exception)

    def on_train_start(self) -> None:
        """A fit starts (the Trainer's hook): an earlier fit's finished notice no longer holds."""
        collectives.clear_finished(self.session.comm)

    def on_train_end(self) -> None:
        """The Trainer's fit loop ended normally: a rank still waiting in a collective learns that this one finished,
        and where, instead of losing it (see [Note: a rank that finished])."""
        trainer = getattr(getattr(self, "lightning_module", None), "trainer", None)
        step = f" after global step {trainer.global_step}" if trainer is not None else ""
        collectives.post_finished(self.session.comm, f"its fit ended normally{step}")

    # ------------------------------------------------------------------ reports and full parameters
    @contextmanager
    def gathered_params(self, write_back: bool = False) -> Generator[None, None, None]:
        """Hold the module's full parameters inside the block (stage 3; at stages 1 and 2 they are full anyway).

        A stage-3 module keeps only shards between steps and after training; use this to export or inspect it.
        With ``write_back=True`` changes made inside (e.g. ``load_state_dict``) are kept. Every rank must enter it.
        In 16-bit runs the parameters are the 16-bit ones: the fp32 masters take the 16-bit values written.

        Example::

            with strategy.gathered_params():
                torch.save(model.state_dict(), "model.pt")
        """
        with self.session.gathered(write_back=write_back):  # a no-op while nothing is sharded
            yield

    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state that this rank holds now, and in ``step_peak`` the
        last training step's peak by kind (model states, gathered units, gradient buckets, step temporaries; on CUDA
        the allocator's peak and the activations beyond the rest; see docs/design.md, "The peak of a step").

        Raises:
            RuntimeError: before a setup has sharded the model.
        """
        return self.session.memory_report()

    def comm_report(self) -> CommStats:
        """Bytes this rank moved in collectives during the last optimizer step (see docs/design.md)."""
        return self.session.comm_report()

    @property
    def global_loss_weight(self) -> float | None:
        """``weighted_loss=True``: the global weight (tokens of every rank and micro-batch) of the last step."""
        return self.session.global_loss_weight

    @property
    def global_mean_loss(self) -> float | None:
        """``weighted_loss=True``: the last step's loss summed over every rank and micro-batch, over its global
        weight: the mean per token, what to log."""
        return self.session.global_mean_loss
