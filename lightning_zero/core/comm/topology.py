"""Which ranks talk: the process groups an engine uses, created once and named by their job.

[Note: hybrid sharding]
With ``shard_size=k`` (FSDP's HYBRID_SHARD, DeepSpeed's MiCS) the N ranks split into N/k *shard groups* of k
consecutive ranks (one node's, as launchers number ranks node by node) and k *replicate groups* of the ranks that
hold the same shard (ranks ``i, i+k, i+2k, ...``). Every state is sharded over the shard group, as over all ranks
without ``shard_size``, and replicated across the replicate group. A bucket's gradients are divided by N,
reduce-scattered inside the shard group, and each shard is then all-reduced across the replicate group, so the
only collective that crosses nodes is that all-reduce of Ψ/k elements per rank (plus the small agreements). Clip
norms and parameter gathers run in the shard group (each element counted once), agreements (options, used
parameters, fp16 overflow, hyper-parameters, token counts) in the world group, so every rank still takes part in
them. Checkpoints are written by the first shard group (``Topology.writes``) and read by any layout.

The ranks agree on ``shard_size`` (and the node layout) before any group is created, and every rank creates every
group in the same order (``new_group`` is itself a collective): the shard groups in rank order, then the replicate
groups, then stage 3's gather groups.

Stage 3 gathers unit parameters over a group of its own (the shard group's ranks again), so that the order of
gathers (fixed by the order units run in) and the order of gradient reductions (fixed by bucket index) never have
to interleave identically on every rank: a rank whose backward needs fewer units than another's still issues the
same gathers and the same reductions, each in its own order (see [Note: stage-3 backward plan]).

With ``secondary_shard_size=s`` (stage 3, ZeRO++ hpZ) the gather group's ranks split further into *secondary
groups* of s consecutive ranks, each inside one node, created next (every rank creates every one, in rank order):
backward gathers a unit inside its secondary group from the slices its ranks kept after forward (see [Note:
secondary shards]), again in a group of its own, so those gathers never leave the node.

``quantize_gradients`` over several nodes reduces gradients in ``node`` and ``cross`` groups (see [Note: quantized
gradient reduction]): with ``shard_size`` they are the shard and replicate groups; without it they are created after
every other group, the nodes' groups in node order, then the groups of each local index.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from lightning_zero.core.comm.communicator import Communicator
from lightning_zero.core.comm.stats import CommStats
from lightning_zero.core.options import check_secondary_shard_size, check_shard_size


@dataclass(frozen=True)
class Topology:
    """The communicators of one engine.

    Attributes:
        world: every rank: agreements, the first broadcast of the model, token counts.
        shard: the ranks that split the state (``world`` without ``shard_size``): reductions, clip norms, stage-1/2
            parameter gathers, checkpoint layouts.
        gather: the shard group's ranks in a group of their own for stage-3 unit gathers (``shard`` below stage 3).
        replicate: the ranks holding the same shard in other shard groups (``None`` without ``shard_size``).
        secondary: stage 3 with ``secondary_shard_size``: this rank's secondary group, for backward's gathers.
        node: with ``quantize_gradients`` over more than one node, the group a gradient bucket is reduce-scattered
            in first, exactly: this rank's node (the shard group with ``shard_size``); ``None``: gradients travel
            exact (see [Note: quantized gradient reduction] in core/step/quantized_reduction.py).
        cross: with ``node``, the group the quantized partial sums cross nodes in: the ranks of the same local
            index on every node (the replicate group with ``shard_size``).
    """

    world: Communicator
    shard: Communicator
    gather: Communicator
    replicate: Communicator | None = None
    secondary: Communicator | None = None
    node: Communicator | None = None
    cross: Communicator | None = None

    @classmethod
    def build(
        cls,
        world: Communicator,
        stage: int,
        shard_size: int | None = None,
        secondary_shard_size: int | None = None,
        quantize_gradients: bool = False,
    ) -> Topology:
        """The groups for ``stage``, ``shard_size``, ``secondary_shard_size`` and ``quantize_gradients`` (collective:
        it creates groups). Call it only once the ranks agree on them (see [Note: hybrid sharding])."""
        check_shard_size(shard_size, world.world_size)
        group_size = world.world_size if shard_size is None else shard_size
        check_secondary_shard_size(secondary_shard_size, stage, group_size)
        if secondary_shard_size is not None:
            _check_node_layout(world, secondary_shard_size, "secondary_shard_size", inside_only=True)
        if shard_size is None or shard_size == world.world_size:
            topology = cls(world, world, world if stage < 3 else world.companion())
        else:
            _check_node_layout(world, shard_size)
            n, k = world.world_size, shard_size
            shards = [world.ranks[g * k : (g + 1) * k] for g in range(n // k)]
            shard = world.split(shards, "shard")
            replicate = world.split([world.ranks[i::k] for i in range(k)], "replicate")
            # Every rank creates every group (new_group is a collective of all ranks), so stage 3's gather groups are
            # created as a second split, not as each shard group's companion.
            topology = cls(world, shard, shard if stage < 3 else world.split(shards, "gather"), replicate)
        if secondary_shard_size is not None:
            s = secondary_shard_size
            secondaries = [world.ranks[g * s : (g + 1) * s] for g in range(world.world_size // s)]
            topology = dataclasses.replace(topology, secondary=world.split(secondaries, "secondary"))
        return topology._with_node_groups() if quantize_gradients else topology

    def _with_node_groups(self) -> Topology:
        """``quantize_gradients``: the groups of its two hops, created last (collective); on one node none, as
        nothing crosses nodes there."""
        world, per_node = self.world, self.world.ranks_per_node
        nodes = -(-world.world_size // per_node)
        if nodes == 1:
            return self
        if self.replicate is not None:
            return dataclasses.replace(self, node=self.shard, cross=self.replicate)
        if world.world_size % per_node:  # the same on every rank: they agreed on ranks_per_node
            raise ValueError(
                f"quantize_gradients=True needs every node to run the same number of ranks, but world_size="
                f"{world.world_size} is not a multiple of {per_node} ranks per node (LOCAL_WORLD_SIZE). Launch as "
                "many processes on every node, or pass quantize_gradients=False."
            )
        _check_node_layout(world, per_node, "node_size")  # "node groups of consecutive ranks assume ..."
        node = world.split([world.ranks[g * per_node : (g + 1) * per_node] for g in range(nodes)], "node")
        cross = world.split([world.ranks[i::per_node] for i in range(per_node)], "cross")
        return dataclasses.replace(self, node=node, cross=cross)

    @property
    def writes(self) -> bool:
        """Whether this rank writes checkpoint files: the ranks of the first shard group (one replica)."""
        return self.replicate is None or self.replicate.rank == 0

    def take_stats(self) -> CommStats:
        """What every group of the topology sent since the last call (and start counting again)."""
        stats = self.world.stats.reset()
        groups = (self.shard, self.gather, self.replicate, self.secondary, self.node, self.cross)
        for comm in {id(c): c for c in groups if c is not None}.values():
            if comm is not self.world:
                stats = stats.merged(comm.stats.reset())
        return stats


def _check_node_layout(world: Communicator, size: int, option: str = "shard_size", inside_only: bool = False) -> None:
    """Raise the same ``ValueError`` on every rank where the launch's nodes and the groups of ``size`` consecutive
    ranks (``option``'s) do not line up: a group must lie inside one node or (unless ``inside_only``) span whole
    nodes, and ranks must be numbered node by node."""
    per_node = world.ranks_per_node
    local_rank = os.environ.get("LOCAL_RANK")
    groups = option.removesuffix("_size").replace("_", " ") + " groups"  # "shard groups", "secondary shard groups"
    mine = None
    if per_node % size and (inside_only or size % per_node):
        multiple = "" if inside_only else f" or a multiple of {per_node}"
        mine = (
            f"{option}={size} does not fit nodes of {per_node} ranks: a {groups[:-1]} would straddle two nodes. "
            f"Use a divisor{multiple} of {per_node}, typically {per_node} (one node)."
        )
    elif local_rank is not None and int(local_rank) != world.global_rank % per_node:
        mine = (
            f"rank {world.global_rank} has LOCAL_RANK={local_rank}, but {groups} of consecutive ranks assume "
            f"ranks numbered node by node ({per_node} per node: local rank {world.global_rank % per_node}). Launch "
            "with torchrun, SLURM or Lightning's launcher, which number ranks that way."
        )
    problems = [problem for problem in world.all_gather_object(mine) if problem is not None]
    if problems:
        raise ValueError(problems[0])
