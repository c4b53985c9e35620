"""Block-wise symmetric int8 quantization of what a collective sends (ZeRO++'s qwZ, Wang et al. 2023).

[Note: block-wise int8]
A 1-D tensor travels as int8 values plus one fp32 scale per block of ``QUANT_BLOCK`` consecutive elements (the
last block may be partial): ``scale = absmax / 127`` of the block, computed in fp32, and ``value = x / scale``
rounded to an integer in [-127, 127]. An all-zero block has scale 0 and values 0 (no division by zero). Rounding
is to nearest (error at most ``scale / 2`` per element, deterministic: every rank quantizing the same tensor sends
the same bytes) or, with a ``torch.Generator``, stochastic (``floor(x / scale + u)`` with ``u`` uniform in [0, 1):
error below ``scale``, and unbiased, ``E[dequantized] = x``). A block holding inf or NaN gets a non-finite scale
instead of an error here: the caller checks the scales once they were exchanged (:func:`check_finite_scales`), so
every rank sees the same scales and raises together rather than one rank raising while the others wait in a
collective. One part costs ``numel + 4 * ceil(numel / QUANT_BLOCK)`` bytes on the wire (:func:`quantized_nbytes`,
more where blocks restart): about 1.016 bytes per element instead of 2 (bf16) or 4 (fp32).

[Note: blocks never span two tensors]
A flat buffer lays tensors of very different magnitudes end to end: a LayerNorm's weight (about 1) before its bias
(about 0.01). A block spanning both takes the weight's scale, and the bias is rounded to steps of 1/127: 7-13%
relative error in the example GPT's LayerNorm biases with blocks of 256 from the shard's start, against 0.6-0.8%
when each tensor has blocks of its own. So a :class:`BlockPlan` restarts the blocks where a tensor begins (a run's
last block may be partial), and sends the tensors of at most one dimension (biases, norms' weights) exact: value 1
and the value itself as its "scale", 5 bytes an element instead of 4 (exact for every float dtype up to fp32). Those
are a small share of a model's elements (0.1% of a 1B GPT's; DeepSpeed never gathers them at all, below its
persistence threshold) but not of its sensitivity. Measured on the example GPT (0.95M parameters, 500 steps, fp32
AdamW, the mean loss of the last 100 steps against unquantized stage 3, one process standing in for the gathers):
blocks of 256 from the shard's start +8.3% (the real run: +8.6%); restarting at tensors +3.2%, with blocks of 64
+3.5%, min-max (asymmetric) blocks +3.4%, 1-D tensors in blocks of 16 +4.2%, biases exact +3.3%; the LayerNorms'
weights and biases exact -0.01%, every 1-D tensor exact -0.4%. The exact elements are uneven across ranks, so the
scales travel padded to the rank with the most: a few percent of a large model's gather, more for a small model
over many ranks.

[Note: quantized all-gather]
With ``quantize_weights`` (ZeRO++'s qwZ) the stage-3 parameter gathers of forward and backward send each rank's
shard as int8 values plus fp32 block scales (see [Note: block-wise int8]), blocks restarting where a tensor
begins: two even all-gathers, of the values and of the scales (padded to the largest part's count), started
together (``Communicator.all_gather_quantized``); the work returned dequantizes every part into the output when
waited for, this rank's own part too, so every rank holds the same full values. Rounding is to nearest, so what a
rank sends depends on its shard alone, and a unit gathered again (backward, activation checkpointing's
recomputation) holds exactly the values its forward used. The scales are checked for inf/NaN after the exchange,
where every rank holds the same ones, so all ranks raise together (on CUDA that check synchronises the host with
the gather, once per gathered buffer). It is counted under ``"all_gather"`` as the bytes that travel (see [Note:
counting communication]): the full int8 buffer plus the padded scales.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

QUANT_BLOCK = 256  # elements per scale
_QMAX = 127.0


@dataclass(frozen=True)
class Segment:
    """A run of a part's elements inside one tensor: ``[begin, end)``, its scales from ``first`` on, and either its
    rows of blocks in the quantizer's scratch from ``row`` on, or ``exact`` (one scale per element: the value)."""

    begin: int
    end: int
    first: int
    row: int
    exact: bool


@dataclass(frozen=True)
class BlockPlan:
    """How a part of ``numel`` elements is cut into blocks (see [Note: blocks never span two tensors])."""

    numel: int
    block: int
    segments: tuple[Segment, ...]
    scale_count: int  # fp32 scales the part travels with
    rows: int  # blocks of the quantized segments

    @classmethod
    def build(
        cls, numel: int, starts: Sequence[int] = (), exact: Sequence[int] = (), block: int = QUANT_BLOCK
    ) -> BlockPlan:
        """Blocks restart at each offset of ``starts`` (where a tensor begins); the runs beginning at an offset of
        ``exact`` (0 or one of ``starts``) travel exact. Offsets outside ``[0, numel)`` are ignored."""
        bounds, exact = [0, *sorted({s for s in starts if 0 < s < numel}), numel], set(exact)
        segments, first, row = [], 0, 0
        for begin, end in itertools.pairwise(bounds):
            is_exact = begin in exact
            blocks = end - begin if is_exact else -(-(end - begin) // block)
            segments.append(Segment(begin, end, first, -1 if is_exact else row, is_exact))
            first, row = first + blocks, row if is_exact else row + blocks
        return cls(numel, block, tuple(segments), first, row)

    @property
    def uniform(self) -> bool:
        """One quantized run: blocks from the start, as without a plan."""
        return len(self.segments) <= 1 and not any(s.exact for s in self.segments)


def quantize_blocks(
    x: Tensor, block: int = QUANT_BLOCK, generator: torch.Generator | None = None, plan: BlockPlan | None = None
) -> tuple[Tensor, Tensor]:
    """``x`` (1-D, floating point) as int8 values (``x.numel()``) and fp32 scales (``plan.scale_count``); see
    [Note: block-wise int8]. Rounds to nearest, or stochastically with ``generator`` (on ``x``'s device). ``plan``:
    where blocks restart and which runs travel exact (default: blocks of ``block`` from the start)."""
    if x.dim() != 1 or not x.dtype.is_floating_point:
        raise ValueError(f"quantize_blocks takes a 1-D floating-point tensor, got {x.dtype} of shape {tuple(x.shape)}")
    plan = plan or BlockPlan.build(x.numel(), block=block)
    scaled = _padded_rows(x, plan)  # the one full-size fp32 temporary: divided and rounded in place
    if scaled.numel():
        low, high = torch.aminmax(scaled, dim=1)
        row_scales = torch.maximum(high, -low) / _QMAX  # absmax / 127; inf and NaN propagate
    else:
        row_scales = scaled.new_empty(0)
    usable = torch.isfinite(row_scales) & (row_scales > 0)
    scaled.div_(torch.where(usable, row_scales, torch.ones_like(row_scales)).unsqueeze(1))
    scaled.masked_fill_(~usable.unsqueeze(1), 0.0)  # zero blocks are 0; non-finite ones are flagged by their scale
    if generator is None:
        scaled.round_()
    else:
        noise = torch.rand(scaled.shape, generator=generator, device=scaled.device, dtype=scaled.dtype)
        scaled.add_(noise).floor_()
    rows = scaled.clamp_(-_QMAX, _QMAX).to(torch.int8).view(-1)
    if plan.uniform:
        return rows[: x.numel()], row_scales
    values = torch.empty(x.numel(), dtype=torch.int8, device=x.device)
    scales = torch.empty(plan.scale_count, dtype=torch.float32, device=x.device)
    for s in plan.segments:
        length = s.end - s.begin
        if s.exact:  # value 1, scale the value itself: exact in fp32, inf/NaN flagged as any scale
            values[s.begin : s.end] = 1
            scales[s.first : s.first + length] = x[s.begin : s.end]
        else:
            values[s.begin : s.end] = rows[s.row * plan.block : s.row * plan.block + length]
            blocks = -(-length // plan.block)
            scales[s.first : s.first + blocks] = row_scales[s.row : s.row + blocks]
    return values, scales


def dequantize_blocks(
    values: Tensor, scales: Tensor, out: Tensor, block: int = QUANT_BLOCK, plan: BlockPlan | None = None
) -> Tensor:
    """Write ``values * scale`` (per block of ``plan``, default blocks of ``block`` from the start) into ``out``
    (1-D, any float dtype, as many elements as ``values``), computed in fp32; return ``out``."""
    numel = values.numel()
    plan = plan or BlockPlan.build(numel, block=block)
    if out.numel() != numel or plan.numel != numel or scales.numel() != plan.scale_count:
        raise ValueError(
            f"dequantize_blocks: {numel} values need {plan.scale_count} scales and an output of {numel} elements "
            f"(a plan of {plan.numel}), got {scales.numel()} scales and {out.numel()} elements"
        )
    for s in plan.segments:
        length = s.end - s.begin
        if s.exact:
            out[s.begin : s.end] = scales[s.first : s.first + length]
            continue
        whole = length // plan.block  # computed in fp32 (int8 * fp32 promotes), rounded once into out's dtype
        if whole:
            rows = values[s.begin : s.begin + whole * plan.block].view(whole, plan.block)
            target = out[s.begin : s.begin + whole * plan.block].view(whole, plan.block)
            torch.mul(rows, scales[s.first : s.first + whole].unsqueeze(1), out=target)
        if length > whole * plan.block:
            tail = slice(s.begin + whole * plan.block, s.end)
            torch.mul(values[tail], scales[s.first + whole], out=out[tail])
    return out


def quantized_nbytes(numel: int, block: int = QUANT_BLOCK, plan: BlockPlan | None = None) -> int:
    """Bytes one part of ``numel`` elements travels as: its int8 values and fp32 scales."""
    return numel + 4 * (plan or BlockPlan.build(numel, block=block)).scale_count


def check_finite_scales(scales: Tensor, what: str) -> None:
    """Raise a ``ValueError`` naming ``what`` where a scale is inf or NaN (a block of inf/NaN values); see
    [Note: block-wise int8]. Call it on exchanged scales, which every rank holds alike."""
    if not bool(torch.isfinite(scales).all()):
        bad = int((~torch.isfinite(scales)).sum())
        raise ValueError(
            f"{what}: values are inf/NaN ({bad} of {scales.numel()} blocks of the quantized all-gather have a "
            "non-finite scale), so they cannot be sent as int8. The parameters diverged: lower the learning rate, "
            "clip gradients or use loss scaling; or pass quantize_weights=False to see the values unquantized."
        )


def _padded_rows(x: Tensor, plan: BlockPlan) -> Tensor:
    """The quantized runs of ``x`` in fp32 as rows of ``plan.block``, each run from its first row, zero-padded to
    whole rows; a fresh tensor (``x`` is not changed)."""
    rows = x.new_zeros(plan.rows * plan.block, dtype=torch.float32)
    if plan.uniform:
        rows[: x.numel()] = x
    else:
        for s in plan.segments:
            if not s.exact:
                rows[s.row * plan.block : s.row * plan.block + s.end - s.begin] = x[s.begin : s.end]
    return rows.view(plan.rows, plan.block)
