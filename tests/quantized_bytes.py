"""What a quantized gather sends, from a buffer's tensors alone (see [Note: blocks never span two tensors]): the
formula the tests hold the counted bytes to."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_zero.core.comm.quantize import QUANT_BLOCK


def quantized_part_bytes(
    tensors: Sequence[tuple[int, int]], world: int, block: int = QUANT_BLOCK, exact_vectors: bool = True
) -> int:
    """Bytes of one rank's part of a quantized gather (or one slice of a quantized gradient reduction) of a buffer
    holding ``tensors`` (``(numel, dims)`` each, in order) padded to a multiple of ``world``: a byte per element, and
    4 per scale of the rank with the most (blocks of ``block`` restarting at each tensor and at the padding; with
    ``exact_vectors`` a scale per element of a 1-D tensor)."""
    numel = sum(n for n, _ in tensors)
    shard = -(-numel // world)
    runs, offset = [], 0
    for n, dims in tensors:
        runs.append((offset, offset + n, exact_vectors and dims <= 1))
        offset += n
    runs.append((numel, shard * world, False))
    counts = []
    for rank in range(world):
        lo, hi = rank * shard, (rank + 1) * shard
        count = 0
        for begin, end, exact in runs:
            inside = min(end, hi) - max(begin, lo)
            if inside > 0:
                count += inside if exact else -(-inside // block)
        counts.append(count)
    return shard + 4 * max(counts)
