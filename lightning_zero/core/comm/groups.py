"""This process's place in a process group: its ranks, where a rank that raised says so, the groups made from it and
their end. :class:`~lightning_zero.core.comm.communicator.Communicator` runs the collectives over it.

[Note: groups alive at exit]
A gloo group runs each collective on a thread of its own, which drops its reference to the work a moment after the
work completed (``wait()`` may have returned already). When that reference is the last one, the thread frees the
work's tensors, and one whose Python object was let go of while the work ran (a gathered unit's full buffer,
resharded) needs the interpreter's lock for that. If the interpreter began to finalize meanwhile, it ends the thread
waiting for the lock, inside the work's destructor, and the process aborts ("terminate called without an active
exception"; a core dump showed ``~AsyncAllgatherWork`` on a ``ProcessGroupGloo::runLoop`` thread, waiting for the
lock, while the main thread was in ``Py_FinalizeEx``).
Collectives right before a script ends make it likely: ``gathered_params()`` after a popen-launched stage-3 ``fit``
aborted a rank in 5 of 60 runs, under torchrun in 5 of 10 (Lightning's DDP too: benchmarks/clean_exits.py). Only
destroying a group ends its threads, and only once the last Python reference to it goes:
``torch.distributed.destroy_process_group()`` drops torch's references, and a communicator over a group of its
own (stage 3's companion) holds one more. :func:`destroy_groups` drops both, so the threads end while the
interpreter is whole. It is for a run that ended well: a rank past its last collective destroys at once; with a
collective still in flight it would wait for the other ranks.
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lightning_zero.core.comm.lost_rank import FailureNotices, guarded, notices_prefix
from lightning_zero.core.comm.stats import CommStats

_ROOTS = itertools.count()  # communicators made without a parent's notices, in this process (see notices_prefix)
_OWN_GROUPS: weakref.WeakSet[GroupMember] = weakref.WeakSet()  # communicators over a group of their own
Member = TypeVar("Member", bound="GroupMember")


class GroupMember:
    """This process in one process group: its ranks, what its backend takes, the bytes counted over it
    (:attr:`stats`), its failure notices and the groups made from it.

    Args:
        group: the process group (``None``: every rank).
        notices: where a rank that raised says so (default: the job's store, for gloo).
        ranks_per_node: how many consecutive global ranks share a node (default: ``LOCAL_WORLD_SIZE`` as torchrun
            and Lightning set it, else every rank on one node); only the byte counts by node read it.
        role: the group's job, under which :attr:`CommStats.by_group` counts its bytes.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        notices: FailureNotices | None = None,
        ranks_per_node: int | None = None,
        role: str = "world",
    ) -> None:
        self.group = group
        self.role = role
        self.rank = dist.get_rank(group)
        self.global_rank = dist.get_rank()  # names this process in errors
        self.world_size = dist.get_world_size(group)
        self.ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))  # global ranks, by group rank
        self.ranks_per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        node = self.global_rank // self.ranks_per_node
        peers = [rank for rank in self.ranks if rank != self.global_rank]
        same_node = sum(1 for rank in peers if rank // self.ranks_per_node == node)
        self.stats = CommStats(group=role, peers=(same_node, len(peers) - same_node, self.world_size))
        backend = dist.get_backend(group)
        # gloo implements the single-tensor reduce-scatter as a copy plus a full all-reduce (measured 1.8x
        # slower on a 25 MiB bucket, docs/benchmarks.md); its list form is a real reduce-scatter.
        self._list_reduce_scatter = backend == "gloo"
        # NCCL takes tensors on this device only (objects and host tensors are staged through it).
        self._nccl_device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
        # Where a rank that raised says so; gloo waits read it (see [Note: a rank that raises and stays alive]).
        self.notices = notices if notices is not None or backend != "gloo" else _notices(group)
        self._companion: GroupMember | None = None
        self._released = False
        if group is not None:
            _OWN_GROUPS.add(self)

    def companion(self: Member) -> Member:
        """A communicator over the same ranks in a group of its own, created once (collective the first time).

        Collectives are matched in issue order per group, so two independent streams of collectives (stage-3
        gathers and gradient reductions) each need their own group. See core/comm/topology.py."""
        if self._companion is None:
            self._companion = self._subgroup(list(self.ranks), "gather")
        assert isinstance(self._companion, type(self))
        return self._companion

    def split(self: Member, groups: Sequence[Sequence[int]], role: str) -> Member:
        """A communicator over the one of ``groups`` (lists of global ranks that cover this group's ranks) that holds
        this rank, counting under ``role``. Collective: every rank creates every group, in the order given
        (``new_group`` is a collective)."""
        mine = None
        for ranks in groups:
            made = self._subgroup(list(ranks), role)
            mine = made if self.global_rank in ranks else mine
        if mine is None:
            raise ValueError(f"rank {self.global_rank} is in none of the groups {[list(g) for g in groups]}")
        return mine

    def _subgroup(self: Member, ranks: list[int], role: str) -> Member | None:
        """A new group over ``ranks`` (collective over this group's ranks), its communicator where this rank is in."""
        # With the parent's timeout: new_group's default (30 minutes) would let a hung rank stall the collectives.
        group = dist.new_group(ranks, timeout=_timeout_of(self.group))
        if self.global_rank not in ranks:
            return None
        return type(self)(group, notices=self.notices, ranks_per_node=self.ranks_per_node, role=role)

    def post_failure(self, error: BaseException) -> None:
        """This rank raised ``error`` and lives on: the others' waits end with it named (see [Note: a rank that
        raises and stays alive]). A no-op without notices (NCCL) and for errors that are about another rank."""
        if self.notices is not None:
            self.notices.post(self.global_rank, error)

    def post_finished(self, where: str) -> None:
        """This rank's fit ended normally (``where``): a rank still waiting for it says so (see [Note: a rank that
        finished]). A no-op without notices."""
        if self.notices is not None:
            self.notices.post_finished(self.global_rank, where)

    def clear_finished(self) -> None:
        """A new fit starts on this rank: its earlier finished notice no longer holds."""
        if self.notices is not None:
            self.notices.clear_finished(self.global_rank)

    def _guarded(self, what: str, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``collective(*args, **kwargs)``, a lost or hung rank named as such (see [Note: lost and hung ranks])."""
        if self._released:
            raise RuntimeError(
                f"rank {self.global_rank} cannot run {what}: the process groups were destroyed when the run ended "
                "(see [Note: groups alive at exit]). Collectives after that need a new process group and strategy."
            )
        return guarded(what, self.global_rank, lambda: collective(*args, **kwargs), self.notices)


def _timeout_of(group: dist.ProcessGroup | None) -> timedelta | None:
    """The collective timeout ``group`` was created with (``None`` where the backend does not say)."""
    process_group = group or dist.group.WORLD
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    try:
        return process_group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _notices(group: dist.ProcessGroup | None) -> FailureNotices | None:
    """The failure notices of a new communicator root, in the job's store (``None`` where there is none)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return FailureNotices(store, notices_prefix(next(_ROOTS), ranks), dist.get_world_size())


def destroy_groups() -> None:
    """Destroy every process group of this process, their gloo threads ended now (see [Note: groups alive at
    exit]); communicators over a group of their own refuse collectives from then on. Only after a run that ended
    well, on every rank."""
    for comm in list(_OWN_GROUPS):
        comm.group, comm._companion, comm._released = None, None, True
    _OWN_GROUPS.clear()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
