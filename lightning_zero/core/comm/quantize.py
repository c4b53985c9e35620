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
collective. One part costs ``numel + 4 * ceil(numel / QUANT_BLOCK)`` bytes on the wire (:func:`quantized_nbytes`):
about 1.016 bytes per element instead of 2 (bf16) or 4 (fp32).
"""

from __future__ import annotations

import torch
from torch import Tensor

QUANT_BLOCK = 256  # elements per scale
_QMAX = 127.0


def quantize_blocks(
    x: Tensor, block: int = QUANT_BLOCK, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """``x`` (1-D, floating point) as int8 values (``x.numel()``) and fp32 scales (``ceil(numel / block)``); see
    [Note: block-wise int8]. Rounds to nearest, or stochastically with ``generator`` (on ``x``'s device)."""
    if x.dim() != 1 or not x.dtype.is_floating_point:
        raise ValueError(f"quantize_blocks takes a 1-D floating-point tensor, got {x.dtype} of shape {tuple(x.shape)}")
    numel = x.numel()
    nblocks = -(-numel // block)
    scaled = _padded_rows(x, nblocks, block)  # the one full-size fp32 temporary: divided and rounded in place
    if numel:
        low, high = torch.aminmax(scaled, dim=1)
        scales = torch.maximum(high, -low) / _QMAX  # absmax / 127; inf and NaN propagate
    else:
        scales = scaled.new_empty(0)
    usable = torch.isfinite(scales) & (scales > 0)
    scaled.div_(torch.where(usable, scales, torch.ones_like(scales)).unsqueeze(1))
    scaled.masked_fill_(~usable.unsqueeze(1), 0.0)  # zero blocks are 0; non-finite ones are flagged by their scale
    if generator is None:
        scaled.round_()
    else:
        noise = torch.rand(scaled.shape, generator=generator, device=scaled.device, dtype=scaled.dtype)
        scaled.add_(noise).floor_()
    values = scaled.clamp_(-_QMAX, _QMAX).to(torch.int8).view(-1)[:numel]
    return values, scales


def dequantize_blocks(values: Tensor, scales: Tensor, out: Tensor, block: int = QUANT_BLOCK) -> Tensor:
    """Write ``values * scale`` (per block of ``block`` elements) into ``out`` (1-D, any float dtype, as many
    elements as ``values``), computed in fp32; return ``out``."""
    numel = values.numel()
    if out.numel() != numel or scales.numel() != -(-numel // block):
        raise ValueError(
            f"dequantize_blocks: {numel} values need {-(-numel // block)} scales and an output of {numel} elements, "
            f"got {scales.numel()} scales and {out.numel()} elements"
        )
    whole = numel // block  # computed in fp32 (int8 * fp32 promotes), rounded once into out's dtype, no temporary
    if whole:
        rows = values[: whole * block].view(whole, block)
        torch.mul(rows, scales[:whole].unsqueeze(1), out=out[: whole * block].view(whole, block))
    if numel > whole * block:
        torch.mul(values[whole * block :], scales[whole], out=out[whole * block :])
    return out


def quantized_nbytes(numel: int, block: int = QUANT_BLOCK) -> int:
    """Bytes one part of ``numel`` elements travels as: its int8 values and fp32 scales."""
    return numel + 4 * -(-numel // block)


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


def _padded_rows(x: Tensor, nblocks: int, block: int) -> Tensor:
    """``x`` in fp32 as ``nblocks`` rows of ``block``, zero-padded at the end; a fresh tensor (``x`` is not
    changed)."""
    rows = x.new_zeros(nblocks * block, dtype=torch.float32)
    rows[: x.numel()] = x
    return rows.view(nblocks, block)
