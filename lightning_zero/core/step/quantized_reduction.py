"""``quantize_gradients``: a bucket's reduction exact inside each node, quantized across nodes (ZeRO++'s qgZ).

[Note: quantized gradient reduction]
Across nodes the link is the slow one, so only what crosses it is quantized, once (see [Note: block-wise int8]
in core/comm/quantize.py). A bucket, divided by the world size as always, is first reduce-scattered inside the node
in the gradient's reduce dtype (exact, as without the option); each rank then holds a *node partial*: its node's sum
of some slices. Those partials cross nodes as int8 values with fp32 block scales, rounded stochastically (an
expected value equal to the partial, so the sum stays unbiased), and every rank dequantizes what it received and
sums it in fp32, in node order, into its shard of the global sum.

- Flat (no ``shard_size``, N = M nodes x L ranks): rank ``n L + l`` owns the ``(n L + l)``-th slice of the bucket. The
  bucket's slices are permuted before the node's reduce-scatter so that local rank ``l`` receives the node partials
  of slices ``{n L + l}`` for every node ``n``; an all-to-all over the *cross group* (the ranks of local index ``l``
  on every node) sends each partial to the rank that owns its slice. The rank's own node's partial does not travel
  and stays exact. For a bucket of N shards of S elements a rank sends ``(M - 1) * quantized_nbytes(S, 64)`` bytes
  across nodes (op ``"quantized_all_to_all"``), where the plain reduce-scatter sends ``(N - L) * S * itemsize``
  (``(M - 1) L S itemsize``: L times more elements, each ``itemsize`` bytes instead of about one).
- Hybrid (``shard_size``): the reduce-scatter runs in the shard group as without the option; the replicate
  all-reduce becomes an all-gather of the quantized shards over the replicate group (op ``"quantized_all_gather"``,
  ``(R - 1) * quantized_nbytes(S, 64)`` bytes sent for R replicas, against the all-reduce's ``2 (R - 1) / R`` shards)
  and a local fp32 sum in replica order. Every replica dequantizes the same bytes, its own shard's included, so the
  replicas stay identical.

Gradients travel in blocks of ``GRADIENT_BLOCK`` = 64 elements (1.0625 bytes an element), restarting at each tensor
of the bucket (each slice's ``BlockPlan``, made once per bucket; rows travel with their scales padded to the slice
with the most): the noise of stochastic rounding is a block's absmax / 127 per element, so a block spanning a
matrix's large gradients and a LayerNorm weight's small ones buried the latter (one step of the example GPT: its
``ln_2.weight`` gradients 14% off, every other tensor 0.4-0.9%; 0.5% with the plans).

On one node nothing crosses nodes and the option changes nothing (``Topology`` makes no node groups). The noise of
the stochastic rounding comes from a generator seeded by (the count of quantized reductions this rank ran, its
global rank): the same on every run, different per rank and per bucket. An inf or NaN in a partial gives its block a
non-finite scale and a non-finite dequantized sum, so an fp16 overflow still skips the step on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_zero.core.comm import Communicator, Work
from lightning_zero.core.comm.quantize import BlockPlan, dequantize_blocks, quantize_blocks
from lightning_zero.core.comm.topology import Topology

# Elements per scale of a gradient's blocks: a quarter of the weights' (see [Note: quantized gradient reduction]).
GRADIENT_BLOCK = 64


class NodeReduced:
    """The node's reduce-scatter in flight, and the node partials it writes (``nodes x shard`` elements)."""

    def __init__(self, work: Work, partial: Tensor) -> None:
        self.work, self.partial = work, partial

    def wait(self) -> bool:
        return self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


class Then:
    """A collective in flight; ``then`` runs once it completed (the dequantized sum)."""

    def __init__(self, work: Work, then: Callable[[], object]) -> None:
        self.work, self.then = work, then

    def wait(self) -> bool:
        self.work.wait()
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


class QuantizedReduction:
    """The two hops of a quantized gradient reduction. See [Note: quantized gradient reduction].

    Args:
        node: the exact reduce-scatter's group (the node's ranks, or the shard group).
        cross: the group the quantized partials travel in (one rank per node, or the replicate group).
        hierarchical: flat sharding over every rank (permute, reduce-scatter, all-to-all); ``False``: hybrid
            (reduce-scatter, all-gather of the quantized shards).
    """

    def __init__(self, node: Communicator, cross: Communicator, hierarchical: bool) -> None:
        self.node, self.cross, self.hierarchical = node, cross, hierarchical
        self._count = 0  # quantized reductions run: with the global rank, the seed of the rounding noise
        self._generator: torch.Generator | None = None

    @classmethod
    def of(cls, topology: Topology) -> QuantizedReduction | None:
        """The topology's quantized reduction; ``None`` where gradients travel exact (option off, or one node)."""
        if topology.node is None or topology.cross is None:
            return None
        return cls(topology.node, topology.cross, hierarchical=topology.replicate is None)

    def start(self, output: Tensor, input: Tensor) -> Work | NodeReduced:
        """Start the exact hop: the reduce-scatter inside the node. ``input`` (the whole bucket, divided) is spent."""
        if not self.hierarchical:
            return self.node.reduce_scatter(output, input, async_op=True)  # type: ignore[return-value]
        nodes, local, shard = self.cross.world_size, self.node.world_size, output.numel()
        if input.numel() != nodes * local * shard:
            raise ValueError(f"a bucket of {input.numel()} elements is not {nodes * local} shards of {shard}")
        # Slice n*L + l belongs to global rank n*L + l: local rank l must receive slices {n*L + l} of every node n.
        permuted = input.view(nodes, local, shard).transpose(0, 1).contiguous().view(-1)
        partial = torch.empty(nodes * shard, dtype=input.dtype, device=input.device)
        return NodeReduced(self.node.reduce_scatter(partial, permuted, async_op=True), partial)  # type: ignore[arg-type]

    def across(self, output: Tensor, reduced: Work | NodeReduced, plans: Sequence[BlockPlan] = ()) -> Work:
        """Start the quantized hop across nodes (after ``reduced`` completed); its wait writes this rank's shard of
        the global sum into ``output``. ``plans[k]``: how slice ``k`` of the bucket is cut into blocks (restarting at
        its tensors; default: blocks from each slice's start)."""
        generator = self._next_generator(output.device)
        n = output.numel()
        plans = plans or [BlockPlan.build(n, block=GRADIENT_BLOCK)] * (self.node.world_size * self.cross.world_size)
        scales = max(plan.scale_count for plan in plans)  # rows travel padded to the slice with the most
        if isinstance(reduced, NodeReduced):
            rows = reduced.partial.view(self.cross.world_size, n)
            local = self.node.rank  # row r holds slice r * L + local (see the permutation in start)
            row_plans = [plans[r * self.node.world_size + local] for r in range(self.cross.world_size)]
            packed = _pack(rows, generator, row_plans, scales)
            received = torch.empty_like(packed)
            work = self.cross.all_to_all(received.view(-1), packed.view(-1), "quantized_all_to_all", async_op=True)
            own = self.cross.rank  # this node's partial never travels: it stays exact
            mine = row_plans[own]  # every row received is a partial of this rank's slice
            return Then(work, lambda: _sum_rows(received, output, mine, (own, rows[own])))  # type: ignore[arg-type]
        mine = plans[self.node.rank]  # every replica sends the same slice of the bucket
        packed = _pack(output.view(1, -1), generator, [mine], scales)
        gathered = torch.empty(self.cross.world_size * packed.numel(), dtype=torch.uint8, device=output.device)
        work = self.cross.all_gather(gathered, packed.view(-1), async_op=True, label="quantized_all_gather")
        rows_in = gathered.view(self.cross.world_size, -1)
        return Then(work, lambda: _sum_rows(rows_in, output, mine, None))  # type: ignore[arg-type]

    def _next_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
        self._generator.manual_seed((self._count << 24) + self.node.global_rank)
        self._count += 1
        return self._generator


def _pack(rows: Tensor, generator: torch.Generator, plans: Sequence[BlockPlan], scales: int) -> Tensor:
    """Each row of ``rows`` (m x n) quantized by itself with its plan, as the bytes of its int8 values then its fp32
    scales, padded to ``scales``."""
    m, n = rows.shape
    packed = torch.zeros(m, n + 4 * scales, dtype=torch.uint8, device=rows.device)
    for index, plan in enumerate(plans):
        values, row_scales = quantize_blocks(rows[index], generator=generator, plan=plan)
        packed[index, :n] = values.view(torch.uint8)
        packed[index, n : n + 4 * plan.scale_count] = row_scales.view(torch.uint8)
    return packed


def _sum_rows(packed: Tensor, output: Tensor, plan: BlockPlan, exact: tuple[int, Tensor] | None) -> None:
    """The fp32 sum, in row order, of the rows that ``packed`` (from :func:`_pack`, every row cut by ``plan``)
    stands for, into ``output``; with ``exact = (i, values)`` row ``i`` is ``values`` itself."""
    n = output.numel()
    values = packed[:, :n].view(torch.int8)
    scales = packed[:, n : n + 4 * plan.scale_count].contiguous().view(torch.float32)
    total = torch.zeros(n, dtype=torch.float32, device=output.device)
    row = torch.empty(n, dtype=torch.float32, device=output.device)
    for index in range(packed.shape[0]):
        if exact is not None and index == exact[0]:
            total.add_(exact[1])
        else:
            total.add_(dequantize_blocks(values[index], scales[index], row, plan=plan))
    output.copy_(total)
