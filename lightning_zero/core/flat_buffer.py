"""Contiguous storage for a group of parameters; each parameter becomes a view into it.

[Note: parameter views and optimizer pieces]
``FlatParamBuffer`` copies its parameters into one padded 1D tensor and points each ``param.data``
at its slice, so the module keeps its own ``nn.Parameter`` objects (hooks, ``state_dict`` keys and
tied weights stay as the user made them). The rank's shard of the buffer is exposed to the optimizer
as one :class:`ShardPiece` per parameter: a 1D view of the part of that parameter the rank owns
(empty when it owns none, so every rank lists the same parameters). The optimizer therefore sees
per-parameter tensors, keeps per-parameter state for exactly the owned elements, and skips a
parameter whose ``grad`` is ``None`` as it would without sharding. Its in-place update writes
straight into the flat buffer, from where the updated shard is all-gathered. A piece forwards
``requires_grad`` to its parameter, so code that freezes "the optimizer's parameters" (Lightning's
``toggle_optimizer``) freezes the module's.

[Note: freeing gathered storage]
Stage 3 frees a gathered buffer by resizing its storage to zero bytes, and gathers into the same storage
after resizing it back. The parameters stay views of the buffer throughout (their shapes never change),
and so do the tensors autograd saved for backward: ``F.linear`` saves ``weight.t()``, a view of the
buffer's storage. Swapping ``param.data`` instead would leave those saved views holding the old
storage, i.e. every unit gathered in forward would stay in memory until its backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum, auto

import torch
from torch import Tensor, nn

from lightning_zero.core.comm import Communicator, Work
from lightning_zero.core.layout import FlatLayout, Piece


class ShardedState(Enum):
    """Which parameter storage a buffer holds; see ``FlatParamBuffer.nbytes`` for what each costs."""

    SHARDED = auto()  # only the shard; the full buffer's storage has size 0 (stage 3 at rest)
    GATHERED = auto()  # the full flat buffer too; parameters are views into it


class ShardPiece(nn.Parameter):
    """The optimizer's view of the part of ``owner`` this rank owns.

    See [Note: parameter views and optimizer pieces].
    """

    owner: nn.Parameter

    def __new__(cls, data: Tensor, owner: nn.Parameter) -> ShardPiece:
        # Only floating-point and complex tensors can require gradients (a frozen integer parameter cannot).
        piece = super().__new__(cls, data, requires_grad=data.is_floating_point() or data.is_complex())
        piece.owner = owner
        return piece

    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        return self.owner.requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.owner.requires_grad_(value)


class MasterPiece(ShardPiece):
    """A :class:`ShardPiece` of the fp32 master shard. See [Note: mixed-precision model states].

    Its ``grad`` is the held 16-bit gradient, or during an optimizer step the fp32 ``step_grad`` made from it.
    Setting ``grad`` (the buckets after a reduction, ``zero_grad``) sets the held gradient and drops the other.
    """

    def __new__(cls, data: Tensor, owner: nn.Parameter) -> MasterPiece:
        piece = super().__new__(cls, data, owner)
        piece.held_grad = None
        piece.step_grad = None
        return piece

    @property
    def grad(self) -> Tensor | None:  # type: ignore[override]
        return self.step_grad if self.step_grad is not None else self.held_grad

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        self.held_grad, self.step_grad = value, None


class FlatParamBuffer:
    """Parameters of one dtype, device and optimizer param group, laid out flat and sharded."""

    layout: FlatLayout
    params: list[nn.Parameter]
    data: Tensor  # 1D, layout.padded_numel elements; params are views into it (storage freed while sharded)
    shard: Tensor  # 1D, this rank's layout.shard_numel elements (a view of data when it is kept)
    master: Tensor | None  # 1D copy of the shard in a wider dtype that the optimizer updates (mixed precision)
    pieces: list[Piece]  # per param, its part inside this rank's shard (empty where it has none)
    piece_params: list[ShardPiece]  # per param, a 1D view of the shard (or of the master) for the optimizer

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        rank: int,
        world_size: int,
        keep_full: bool = True,
        device: torch.device | None = None,
    ) -> None:
        """Pack ``params`` (their values are copied, except from the meta device: initialise those in the views).

        With ``keep_full=False`` (stage 3) the shard is a tensor of its own; call :meth:`commit_shard` once the
        full buffer holds the final initial values to keep only the shard.
        """
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"a flat buffer needs one dtype and one device, got {dtypes} and {devices}")
        self.params = list(params)
        self.rank = rank
        self.layout = FlatLayout.build([tuple(p.shape) for p in self.params], world_size)
        dtype, device = dtypes.pop(), device or devices.pop()
        self.data = torch.zeros(self.layout.padded_numel, dtype=dtype, device=device)
        with torch.no_grad():
            for param, view in zip(self.params, self.param_views(self.data), strict=True):
                if param.is_meta:
                    # `.data =` cannot change a tensor's device type; swapping keeps the Parameter object, which
                    # the module, tied modules and the optimizer already hold.
                    torch.utils.swap_tensors(param, nn.Parameter(view, requires_grad=param.requires_grad))
                    continue
                view.copy_(param.detach())
                param.data = view
        self.keep_full = keep_full
        owned = {piece.slot: piece for piece in self.layout.pieces(rank)}
        self.pieces = [owned.get(slot, Piece(slot, 0, 0, 0)) for slot in range(len(self.params))]
        self.master = None
        self._make_shard()

    def _make_shard(self) -> None:
        """The shard (a view of ``data``, or stage 3's own tensor) and the optimizer's pieces of it."""
        lo, hi = self.layout.shard_bounds(self.rank)
        data = self.data
        self.shard = data[lo:hi] if self.keep_full else torch.empty(hi - lo, dtype=data.dtype, device=data.device)
        source, piece_type = (self.shard, ShardPiece) if self.master is None else (self.master, MasterPiece)
        self.piece_params = [
            piece_type(self.shard_view(source, piece), param)
            for piece, param in zip(self.pieces, self.params, strict=True)
        ]

    def set_dtypes(self, param_dtype: torch.dtype | None, master_dtype: torch.dtype | None) -> None:
        """Hold the parameters in ``param_dtype``; with ``master_dtype`` the optimizer gets a copy of the shard in
        that dtype, taken before the cast. Both apply to floating-point buffers only (complex and integer ones keep
        their dtype). Call before training, while the buffer holds its full values (stage 3: before
        :meth:`commit_shard`). See [Note: mixed-precision model states]."""
        if self.state is not ShardedState.GATHERED:
            raise RuntimeError("set_dtypes needs the full buffer: call it before commit_shard()")
        if not self.data.dtype.is_floating_point:
            param_dtype = master_dtype = None
        lo, hi = self.layout.shard_bounds(self.rank)
        if master_dtype is not None:
            self.master = self.data[lo:hi].to(master_dtype, copy=True)
        if param_dtype is not None and param_dtype != self.data.dtype:
            self.data = self.data.to(param_dtype)
            with torch.no_grad():
                for param, view in zip(self.params, self.param_views(self.data), strict=True):
                    param.data = view
        self._make_shard()
        if not self.keep_full:
            self.shard.copy_(self.data[lo:hi])

    def master_to_shard(self) -> None:
        """Round the master (just updated by the optimizer) into the shard."""
        if self.master is not None:
            self.shard.copy_(self.master)

    def refresh_master(self) -> None:
        """Take into the master the shard elements that were changed directly (e.g. by ``load_state_dict``)."""
        if self.master is not None:
            changed = self.shard != self.master.to(self.shard.dtype)
            torch.where(changed, self.shard, self.master, out=self.master)

    def full_values(self, comm: Communicator) -> Tensor:
        """A new full-size tensor of every element in its best precision: the masters where kept (collective
        unless the buffer is full and has no master)."""
        source = self.master if self.master is not None else self.shard
        if self.master is None and self.keep_full:
            return self.data.detach().clone()
        full = torch.empty(self.layout.padded_numel, dtype=source.dtype, device=source.device)
        comm.all_gather(full, source)
        return full

    @property
    def state(self) -> ShardedState:
        return ShardedState.GATHERED if self.data.untyped_storage().nbytes() > 0 else ShardedState.SHARDED

    def start_unshard(self, comm: Communicator) -> Work | None:
        """Give the full buffer its memory back and start gathering every rank's shard into it (stage 3)."""
        if self.state is ShardedState.GATHERED:
            return None
        storage = self.data.untyped_storage()
        storage.resize_(self.layout.padded_numel * self.data.element_size())
        # The gather writes back the values autograd saved in forward. It writes through an alias of the
        # storage with a version counter of its own, so backward does not take it for an in-place change of
        # the saved views (the values are the same: see [Note: freeing gathered storage]).
        target = torch.empty(0, dtype=self.data.dtype, device=self.data.device).set_(storage, 0, self.data.shape)
        return comm.all_gather(target, self.shard, async_op=True)

    @staticmethod
    def wait_unshard(work: Work | None) -> None:
        """Wait for a gather from :meth:`start_unshard`."""
        if work is not None:
            work.wait()

    def commit_shard(self) -> None:
        """Keep this rank's part of the full buffer as the shard and free the rest (stage 3 setup)."""
        self.write_back()
        self.reshard()

    def write_back(self) -> None:
        """Copy this rank's part of the gathered buffer into the shard (after the parameters were changed)."""
        lo, hi = self.layout.shard_bounds(self.rank)
        if not self.keep_full:
            self.shard.copy_(self.data[lo:hi])

    def reshard(self) -> None:
        """Free the full buffer's memory. See [Note: freeing gathered storage]."""
        self.data.untyped_storage().resize_(0)

    def param_views(self, flat: Tensor) -> list[Tensor]:
        """Views of a full-size flat tensor shaped like each parameter."""
        return [flat[slot.offset : slot.offset + slot.numel].view(slot.shape) for slot in self.layout.slots]

    @staticmethod
    def shard_view(shard: Tensor, piece: Piece) -> Tensor:
        """The 1D part of a shard-size tensor that belongs to ``piece``."""
        return shard[piece.shard_offset : piece.shard_offset + piece.numel]

    @property
    def nbytes(self) -> int:
        """Bytes of parameter storage held now: the full buffer, and the shard when it is separate."""
        full = self.data.untyped_storage().nbytes()
        return full + (0 if self.keep_full else self.shard.numel() * self.shard.element_size())

    @property
    def master_nbytes(self) -> int:
        return 0 if self.master is None else self.master.numel() * self.master.element_size()
