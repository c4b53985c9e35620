"""Which ranks talk: the communicator (every collective the core issues), its topology of process groups, the
ranks' agreements (options, hyper-parameters, changed parameters) and lost-rank errors.

The only place in the core that calls ``torch.distributed``. Nothing here imports another part of the core.
"""

from lightning_zero.core.comm.communicator import Communicator, Work, wait_all
from lightning_zero.core.comm.groups import destroy_groups
from lightning_zero.core.comm.stats import CommStats

__all__ = ["CommStats", "Communicator", "Work", "destroy_groups", "wait_all"]
