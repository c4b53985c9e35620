"""``quantize_gradients``: a bucket's reduction exact inside each node, quantized across nodes (ZeRO++'s qgZ).

[Note: quantized gradient reduction]
Across nodes the link is the slow one, so only what crosses it is quantized, once (see [Note: block-wise int8]
in core/comm/quantize.py). A bucket, divided by the world size as always, is first reduce-scattered inside the node
in the gradient's reduce dtype (exact, as without the option); each rank then holds a *node partial*: its node's sum
of some slices. Those partials cross nodes as int8 values with fp32 block scales, with error feedback (see [Note:
error feedback]), and every rank dequantizes what it received and sums it in fp32, in node order, into its shard of
the global sum.

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
with the most): a block's rounding step is its absmax / 127, so a block spanning a matrix's large gradients and a
LayerNorm weight's small ones buried the latter (one step of the example GPT: its ``ln_2.weight`` gradients 14% off,
every other tensor 0.4-0.9%; 0.5% with the plans).

On one node nothing crosses nodes and the option changes nothing (``Topology`` makes no node groups). An inf or NaN
in a partial gives its block a non-finite scale and a non-finite dequantized sum, so an fp16 overflow still skips
the step on every rank.

[Note: error feedback]
What a rank sends is rounded to nearest, and what the rounding missed is not lost: each bucket keeps, per row it
sends, an fp32 *residual*, added to that row before the next reduction quantizes it (``x = partial + residual``,
send ``q(x)``, keep ``x - q(x)``; Seide et al. 2014, 1-bit SGD). Over T reductions the sum of what was sent is the
sum of the partials less the last residual, at most half a block step per element: the error does not grow with
the steps, where stochastic rounding (this module's first technique: unbiased, but a block step of noise in every
reduction) added independent noise each time that Adam, dividing by the gradients' own magnitude, turned into
lr-sized steps of near-zero gradients (the example GPT, 500 steps, mean loss of the last 100: +0.01% and +4.3% over
unquantized stage 3 on two data seeds with stochastic rounding; see docs/benchmarks.md for error feedback's).

- Memory: the residuals of the rows a rank sends, fp32: flat, the M - 1 partials that leave the node, ``(M - 1) / N``
  of the trained elements; hybrid, the rank's shard, ``1 / shard_size`` of them. Counted in ``memory_report()``'s
  ``gradients`` from the first reduction on, and in ``estimate_memory(quantize_gradients=True, num_nodes=M)``.
- A block whose residual holds inf or NaN (a partial that overflowed) has it set to 0, so one skipped fp16 step does
  not poison the next ones. With a dynamic loss scale the residuals are in scaled units: when the scale halves or
  doubles, what they carry counts twice or half its worth once (at most half a block step per element).
- Residuals are not saved in checkpoints (they belong to a topology, and what is saved is exact): a resumed run
  starts them at 0, which differs from the uninterrupted run by at most one rounding per element; a checkpoint
  loaded into a running engine keeps them (the same bound). ``release`` drops them.
- While its hop across nodes is in flight (until the end of backward) a bucket holds what it sends and receives,
  ``2 M (S + 4 * scales)`` bytes; the own node's partial waits in the shard's output, so the node partials are
  freed when the hop starts. The step peak counts them under ``buckets``.
- The rounding is deterministic: the same run repeats bit for bit.
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
    """The node's reduce-scatter in flight, and the node partials it writes (``nodes x shard`` elements).
    ``nbytes``: what it holds while in flight (the permuted bucket it sends, and the partials)."""

    def __init__(self, work: Work, partial: Tensor, nbytes: int) -> None:
        self.work, self.partial, self.nbytes = work, partial, nbytes

    def wait(self) -> bool:
        return self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


class Then:
    """A collective in flight; ``then`` runs once it completed (the dequantized sum). ``nbytes``: the buffers it
    holds until then (what it sends and receives, the partials)."""

    def __init__(self, work: Work, then: Callable[[], object], nbytes: int) -> None:
        self.work, self.then, self.nbytes = work, then, nbytes

    def wait(self) -> bool:
        self.work.wait()
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


class QuantizedSlices:
    """One bucket's state across its quantized reductions: how each of its slices is cut into blocks, the scales a
    row travels with (the most of any slice), and the residuals of error feedback (see [Note: error feedback]).

    Args:
        plans: per slice of the bucket (one per rank of the reduction), in rank order.
    """

    def __init__(self, plans: Sequence[BlockPlan]) -> None:
        self.plans = tuple(plans)
        self.scales = max(plan.scale_count for plan in self.plans)
        self.residual: Tensor | None = None  # rows sent x slice elements, fp32; made at the first reduction

    @classmethod
    def uniform(cls, numel: int, slices: int) -> QuantizedSlices:
        """Slices of ``numel`` elements in blocks from each slice's start (a bucket of one tensor)."""
        return cls([BlockPlan.build(numel, block=GRADIENT_BLOCK)] * slices)

    @property
    def nbytes(self) -> int:
        """Bytes of the residuals held now."""
        return 0 if self.residual is None else self.residual.numel() * self.residual.element_size()

    def residual_rows(self, rows: int, numel: int, device: torch.device) -> Tensor:
        """The residuals of ``rows`` rows of ``numel`` elements, zeros at first."""
        if self.residual is None:
            self.residual = torch.zeros(rows, numel, dtype=torch.float32, device=device)
        assert self.residual.shape == (rows, numel), "one bucket's reductions always send the same rows"
        return self.residual


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

    @classmethod
    def of(cls, topology: Topology) -> QuantizedReduction | None:
        """The topology's quantized reduction; ``None`` where gradients travel exact (option off, or one node)."""
        if topology.node is None or topology.cross is None:
            return None
        return cls(topology.node, topology.cross, hierarchical=topology.replicate is None)

    @property
    def slices(self) -> int:
        """Slices a bucket is cut into: one per rank the reduction spans."""
        return self.node.world_size * (self.cross.world_size if self.hierarchical else 1)

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
        work = self.node.reduce_scatter(partial, permuted, async_op=True)
        return NodeReduced(work, partial, _nbytes(permuted, partial))  # type: ignore[arg-type]

    def across(self, output: Tensor, reduced: Work | NodeReduced, slices: QuantizedSlices) -> Work:
        """Start the quantized hop across nodes (after ``reduced`` completed); its wait writes this rank's shard of
        the global sum into ``output``. ``slices``: the bucket's block plans and residuals, updated here."""
        n = output.numel()
        if isinstance(reduced, NodeReduced):
            nodes, local, own, local_size = self.cross.world_size, self.node.rank, self.cross.rank, self.node.world_size
            rows = reduced.partial.view(nodes, n)  # row r holds slice r * L + local (see the permutation in start)
            mine = slices.plans[own * local_size + local]  # every row received is a partial of this rank's slice
            residuals = slices.residual_rows(nodes - 1, n, output.device)
            packed = torch.zeros(nodes, n + 4 * slices.scales, dtype=torch.uint8, device=output.device)
            sent = (r for r in range(nodes) if r != own)  # the own node's partial never travels
            for row, residual in zip(sent, residuals, strict=True):  # row r goes to the owner of slice r * L + local
                _quantize_with_feedback(rows[row], residual, slices.plans[row * local_size + local], packed[row])
            received = torch.empty_like(packed)
            work = self.cross.all_to_all(received.view(-1), packed.view(-1), "quantized_all_to_all", async_op=True)
            output.copy_(rows[own])  # the own node's partial waits in the output: the partials can go now
            then = lambda: _sum_rows(received, output, mine, (own, output))  # noqa: E731
            return Then(work, then, _nbytes(packed, received))  # type: ignore[arg-type]
        mine = slices.plans[self.node.rank]  # every replica sends the same slice of the bucket
        packed = torch.zeros(n + 4 * slices.scales, dtype=torch.uint8, device=output.device)
        _quantize_with_feedback(output, slices.residual_rows(1, n, output.device)[0], mine, packed)
        gathered = torch.empty(self.cross.world_size * packed.numel(), dtype=torch.uint8, device=output.device)
        work = self.cross.all_gather(gathered, packed, async_op=True, label="quantized_all_gather")
        rows_in = gathered.view(self.cross.world_size, -1)
        then = lambda: _sum_rows(rows_in, output, mine, None)  # noqa: E731
        return Then(work, then, _nbytes(packed, gathered))  # type: ignore[arg-type]


def _nbytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _quantize_with_feedback(x: Tensor, residual: Tensor, plan: BlockPlan, into: Tensor) -> None:
    """``x + residual`` rounded to nearest, as the bytes of its int8 values then its fp32 scales, into ``into``;
    ``residual`` becomes what those bytes miss (0 where inf/NaN). See [Note: error feedback]."""
    n = x.numel()
    residual.add_(x)
    values, scales = quantize_blocks(residual, plan=plan)
    into[:n] = values.view(torch.uint8)
    into[n : n + 4 * plan.scale_count] = scales.view(torch.uint8)
    residual.sub_(dequantize_blocks(values, scales, torch.empty_like(residual), plan=plan))
    residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def _sum_rows(packed: Tensor, output: Tensor, plan: BlockPlan, exact: tuple[int, Tensor] | None) -> None:
    """The fp32 sum, in row order, of the rows that ``packed`` (every row cut by ``plan``: values, then scales) stands
    for, into ``output``; with ``exact = (i, values)`` row ``i`` is ``values`` itself."""
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
