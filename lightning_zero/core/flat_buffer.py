"""Contiguous storage for a group of parameters; each parameter becomes a view into it.

[Note: parameter views and optimizer pieces]
``FlatParamBuffer`` copies its parameters into one padded 1D tensor and points each ``param.data``
at its slice, so the module keeps its own ``nn.Parameter`` objects (hooks, ``state_dict`` keys and
tied weights stay as the user made them). The rank's shard of the buffer is exposed to the optimizer
as one ``nn.Parameter`` per :class:`~lightning_zero.core.layout.Piece`: a 1D view of the part of one
parameter that the rank owns. The optimizer therefore sees per-parameter tensors, keeps per-parameter
state for exactly the owned elements, and skips a parameter whose ``grad`` is ``None`` as it would
without sharding. Its in-place update writes straight into the flat buffer, from where the updated
shard is all-gathered.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_zero.core.layout import FlatLayout, Piece


class FlatParamBuffer:
    """Parameters of one dtype, device and optimizer param group, laid out flat and sharded."""

    layout: FlatLayout
    params: list[nn.Parameter]
    data: Tensor  # 1D, layout.padded_numel elements; params are views into it
    shard: Tensor  # 1D view of data: this rank's layout.shard_numel elements
    pieces: tuple[Piece, ...]  # the parts of params inside this rank's shard
    piece_params: list[nn.Parameter]  # one 1D view of the shard per piece, handed to the optimizer

    def __init__(self, params: Sequence[nn.Parameter], rank: int, world_size: int) -> None:
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"a flat buffer needs one dtype and one device, got {dtypes} and {devices}")
        self.params = list(params)
        self.rank = rank
        self.layout = FlatLayout.build([tuple(p.shape) for p in self.params], world_size)
        self.data = torch.zeros(self.layout.padded_numel, dtype=dtypes.pop(), device=devices.pop())
        with torch.no_grad():
            for param, view in zip(self.params, self.param_views(self.data), strict=True):
                view.copy_(param.detach())
                param.data = view
        lo, hi = self.layout.shard_bounds(rank)
        self.shard = self.data[lo:hi]
        self.pieces = self.layout.pieces(rank)
        self.piece_params = [nn.Parameter(self.shard_view(self.shard, piece)) for piece in self.pieces]

    def param_views(self, flat: Tensor) -> list[Tensor]:
        """Views of a full-size flat tensor shaped like each parameter."""
        return [flat[slot.offset : slot.offset + slot.numel].view(slot.shape) for slot in self.layout.slots]

    @staticmethod
    def shard_view(shard: Tensor, piece: Piece) -> Tensor:
        """The 1D part of a shard-size tensor that belongs to ``piece``."""
        return shard[piece.shard_offset : piece.shard_offset + piece.numel]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()
