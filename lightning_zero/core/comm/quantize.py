"""Block-wise int8 quantization of what travels (ZeRO++'s qgZ / qwZ): int8 values and one fp32 scale per block.

[Note: block quantization]
A 1-D tensor is cut into blocks of ``QUANT_BLOCK`` elements (the last one may be shorter). Each block's scale is its
largest magnitude / 127, computed in fp32 (0 for a block of zeros), and each element travels as the int8 ``x /
scale`` rounded: to the nearest integer, or stochastically with a generator (up with probability the fraction, so
the expected dequantized value is exactly ``x``: a sum of such values is unbiased). The round trip errs by at most
``scale / 2`` per element (nearest) or ``scale`` (stochastic). Quantizing never raises: a block holding inf or NaN
gets a non-finite scale, and dequantizes to non-finite values, so an fp16 overflow still reaches the overflow check
after the trip. A tensor of ``n`` elements travels as ``quantized_nbytes(n) = n + 4 * ceil(n / QUANT_BLOCK)`` bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

QUANT_BLOCK = 256
_LEVELS = 127.0


def quantize_blocks(
    x: Tensor, block: int = QUANT_BLOCK, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor]:
    """``x`` (any floating dtype, flattened) as int8 values and fp32 scales of ``ceil(numel / block)`` blocks; with
    ``generator`` rounded stochastically (unbiased), else to the nearest. See [Note: block quantization]."""
    flat = x.reshape(-1).float()
    numel = flat.numel()
    blocks = -(-numel // block)
    padded = flat if numel == blocks * block else torch.nn.functional.pad(flat, (0, blocks * block - numel))
    rows = padded.view(blocks, block)
    scales = rows.abs().amax(dim=1) / _LEVELS if blocks else torch.zeros(0, device=flat.device)
    # NaN propagates through amax; a block with inf gets scale inf. Either dequantizes to non-finite values.
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    scaled = torch.nan_to_num(rows / safe[:, None], nan=0.0, posinf=0.0, neginf=0.0)
    if generator is None:
        rounded = scaled.round()
    else:
        noise = torch.rand(scaled.shape, generator=generator, device=scaled.device, dtype=scaled.dtype)
        rounded = (scaled + noise).floor()
    values = rounded.clamp_(-_LEVELS, _LEVELS).to(torch.int8).view(-1)[:numel]
    return values, scales


def dequantize_blocks(values: Tensor, scales: Tensor, out: Tensor, block: int = QUANT_BLOCK) -> Tensor:
    """Write the values that ``values`` and ``scales`` (from :func:`quantize_blocks`) stand for into ``out`` (same
    numel as ``values``, any floating dtype) and return it."""
    numel = values.numel()
    blocks = scales.numel()
    if blocks != -(-numel // block) or out.numel() != numel:
        raise ValueError(
            f"cannot dequantize {numel} values with {blocks} scales of blocks of {block} into {out.numel()} elements"
        )
    if numel == 0:
        return out
    full = numel // block * block
    flat = out.view(-1)
    if full:
        rows = values[:full].view(-1, block).float() * scales[: full // block, None]
        flat[:full].copy_(rows.view(-1))
    if full < numel:
        flat[full:].copy_(values[full:].float() * scales[-1])
    return out


def quantized_nbytes(numel: int, block: int = QUANT_BLOCK) -> int:
    """The bytes ``numel`` elements travel as: one int8 each and one fp32 scale per block."""
    return numel + 4 * (-(-numel // block))


def check_finite_scales(scales: Tensor, what: str) -> None:
    """Raise a ``ValueError`` naming ``what`` where a block's scale is inf or NaN (its values held inf or NaN)."""
    bad = ~torch.isfinite(scales)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"{what}: block {first} of {scales.numel()} holds inf or NaN (its scale is {scales[first].item()}); "
            "quantized communication cannot carry non-finite values."
        )
