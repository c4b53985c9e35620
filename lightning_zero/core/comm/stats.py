"""What the collectives of one group moved: bytes in the ZeRO paper's units, by collective, by group and by node.

[Note: counting communication]
``CommStats.nbytes`` counts the size of the *full* (unsharded) buffer of each collective: an
all-gather or reduce-scatter of a Ψ-element fp32 buffer counts 4Ψ bytes, an all-reduce counts 8Ψ
(it is a reduce-scatter plus an all-gather). In these units DDP moves 2Ψ elements a step, ZeRO
stages 1 and 2 also 2Ψ, and stage 3 3Ψ, as in the ZeRO paper (section 7).

Each count is also split by where its bytes travel: ``intra_node_bytes`` sent to ranks of this rank's node,
``inter_node_bytes`` to ranks of other nodes (a node: ``ranks_per_node`` consecutive global ranks, as every launcher
numbers them). In a bandwidth-optimal collective over p ranks (ring or pairwise reduce-scatter, all-gather,
all-reduce, pipelined broadcast) each rank sends (p - 1)/p of the counted bytes, spread evenly over its p - 1
peers; the remaining 1/p is its own part, which does not travel. So a collective counted as B bytes sends
``B * s / p`` inside the node and ``B * o / p`` across, for ``s`` peers on this rank's node and ``o`` on others.
A group of one rank (a world of one, ``shard_size=1``'s shard group) sends nothing, and nothing of it is counted.
Flat sharding over 2 nodes x 2 ranks sends half of every count across; hybrid sharding's shard group (one node)
sends nothing across, its replicate group (one rank per node) half of the all-reduce's count, which is half of
the shard's size times 2: the shard itself (see [Note: hybrid sharding]).

With ``quantize_gradients`` (see [Note: quantized gradient reduction]) what crosses nodes is counted as it travels:
int8 values and fp32 block scales, ``quantized_nbytes(n)`` bytes for n elements, under ``"quantized_all_to_all"``
(group ``"cross"``, flat sharding; the exact reduce-scatter before it runs in group ``"node"``) or
``"quantized_all_gather"`` (group ``"replicate"``, with ``shard_size``).
A quantized all-gather (``quantize_weights``, see [Note: quantized all-gather]) counts what travels instead of the
full buffer's size: its int8 values (one byte per element of every part) plus the fp32 scales of every part, under
``by_op["all_gather"]``, so the split by node above applies to those bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CommStats:
    """Bytes moved by collectives, in the units of [Note: counting communication]."""

    nbytes: int = 0
    calls: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0
    by_group: dict[str, int] = field(default_factory=dict)  # by the group's job: "world", "shard", "replicate", ...
    group: str = "world"  # the job of the group these counts are of (merged counts: of the first)
    # Of this group's p ranks, the peers on this rank's node, on other nodes, and p (see [Note: counting communication])
    peers: tuple[int, int, int] = (0, 0, 1)

    def add(self, op: str, nbytes: int) -> None:
        self.calls += 1
        if self.peers[2] == 1:  # a group of one rank: nothing travels (a 1-rank world, shard_size=1's shard group)
            return
        self.nbytes += nbytes
        self.by_op[op] = self.by_op.get(op, 0) + nbytes
        self.by_group[self.group] = self.by_group.get(self.group, 0) + nbytes
        same_node, other_nodes, size = self.peers
        self.intra_node_bytes += nbytes * same_node // size
        self.inter_node_bytes += nbytes * other_nodes // size

    def merged(self, other: CommStats) -> CommStats:
        """The counts of both (e.g. the shard group's and the stage-3 gather group's)."""
        by_op, by_group = dict(self.by_op), dict(self.by_group)
        for op, nbytes in other.by_op.items():
            by_op[op] = by_op.get(op, 0) + nbytes
        for group, nbytes in other.by_group.items():
            by_group[group] = by_group.get(group, 0) + nbytes
        return CommStats(
            self.nbytes + other.nbytes,
            self.calls + other.calls,
            by_op,
            self.intra_node_bytes + other.intra_node_bytes,
            self.inter_node_bytes + other.inter_node_bytes,
            by_group,
            self.group,
        )

    def reset(self) -> CommStats:
        """Return the counts so far and start again from zero."""
        snapshot = CommStats(
            self.nbytes,
            self.calls,
            dict(self.by_op),
            self.intra_node_bytes,
            self.inter_node_bytes,
            dict(self.by_group),
            self.group,
            self.peers,
        )
        self.nbytes, self.calls, self.by_op, self.intra_node_bytes, self.inter_node_bytes = 0, 0, {}, 0, 0
        self.by_group = {}
        return snapshot
