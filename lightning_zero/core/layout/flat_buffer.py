"""Contiguous storage for a group of parameters; each parameter becomes a view into it.

[Note: parameter views and optimizer pieces]
``FlatParamBuffer`` copies its parameters into one padded 1D tensor and points each ``param.data``
at its slice, so the module keeps its own ``nn.Parameter`` objects (hooks, ``state_dict`` keys and
tied weights stay as the user made them). The part of a parameter inside this rank's shard is its
*piece* (empty when the rank owns none of it, so every rank lists the same parameters). The optimizer
keeps the user's parameters in its param groups; only while ``optimizer.step()`` runs does each one
hold its piece as ``data`` and the piece's reduced gradient as ``grad`` (see [Note: the step window]).
So the optimizer keeps state for exactly the owned elements, keyed by the user's parameters, skips a
parameter without gradient as it would without sharding, and its in-place update writes straight into
the shard (or into the fp32 master of it), from where the updated shard is gathered.

Stages 1 and 2 hold every parameter in full (:class:`ReplicatedBuffer`: the shard is a view of the full
buffer); stage 3 holds only the shard and gathers the full buffer when a unit runs
(:class:`ShardedBuffer`).

[Note: freeing gathered storage]
Stage 3 frees a gathered buffer by resizing its storage to zero bytes, and gathers into the same storage
after resizing it back. The parameters stay views of the buffer throughout (their shapes never change),
and so do the tensors autograd saved for backward: ``F.linear`` saves ``weight.t()``, a view of the
buffer's storage. Swapping ``param.data`` instead would leave those saved views holding the old
storage, i.e. every unit gathered in forward would stay in memory until its backward.

[Note: quantized gathers never reach the shard]
With ``quantize_weights`` a unit's forward and backward gathers fill the full buffer with dequantized int8 values
(see [Note: quantized all-gather]): close to the shards' values, not equal. The shard (and the fp32 master of it)
stays exact: the optimizer steps it, and everything that reads parameters as state (``gathered()``, state dicts,
checkpoints, ``release()``) gathers exactly. So a :class:`ShardedBuffer` remembers that its full buffer was
gathered quantized (``quantized``, cleared when freed) and refuses :meth:`ShardedBuffer.write_back` then: the
approximate values can never be copied into the shard. ``gathered()`` gathers such a unit again, exactly, first.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from enum import Enum, auto
from typing import Protocol

import torch
from torch import Tensor, nn

from lightning_zero.core.comm import Communicator, Work
from lightning_zero.core.comm.quantize import QUANT_BLOCK, BlockPlan
from lightning_zero.core.layout.gather_memory import NO_REUSE
from lightning_zero.core.layout.host_memory import host_empty
from lightning_zero.core.layout.pieces import FlatLayout, Layout, OwnerLayout, Piece
from lightning_zero.core.layout.resting import engine_access


class ShardStorage(Protocol):
    """Where a stage-3 shard rests between uses (``offload_params="nvme"``: a swap-file region)."""

    def put(self, shard: Tensor) -> None: ...

    def get(self, dtype: torch.dtype, numel: int) -> Tensor: ...

    def holds(self, shard: Tensor) -> bool: ...

    def get_async(self, dtype: torch.dtype, numel: int) -> Future[Tensor]: ...

    @property
    def nbytes(self) -> int: ...


class ShardedState(Enum):
    """Which parameter storage a buffer holds; see ``FlatParamBuffer.nbytes`` for what each costs."""

    SHARDED = auto()  # only the shard; the full buffer's storage has size 0 (stage 3 at rest)
    GATHERED = auto()  # the full flat buffer too; parameters are views into it


class FlatParamBuffer:
    """Parameters of one dtype and device, laid out flat; this rank's shard of them."""

    layout: Layout
    params: list[nn.Parameter]
    data: Tensor  # 1D, layout.padded_numel elements; params are views into it
    views: list[Tensor]  # per param, its view of data (made while data has its memory)
    shard: Tensor  # 1D, shard_numel elements: this rank's part
    pieces: list[Piece]  # per param, its part inside this rank's shard (empty where it has none)
    may_change_at_rest: bool  # users can write the parameters between steps (stages 1 and 2)

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        rank: int,
        world_size: int,
        device: torch.device | None = None,
        owners: Sequence[int] | None = None,
    ) -> None:
        """Pack ``params`` (their values are copied, except from the meta device: initialise those in the views);
        with ``owners`` (one rank per parameter) as whole tensors per owner, see [Note: owner layout]."""
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"a flat buffer needs one dtype and one device, got {dtypes} and {devices}")
        self.params = list(params)
        self.rank = rank
        self._block_plans: dict[tuple[int, bool], tuple[BlockPlan, ...]] = {}  # see block_plans
        shapes = [tuple(p.shape) for p in self.params]
        self.layout: Layout = (
            FlatLayout.build(shapes, world_size) if owners is None else OwnerLayout.build(shapes, owners, world_size)
        )
        dtype, device = dtypes.pop(), device or devices.pop()
        self.data = torch.zeros(self.layout.padded_numel, dtype=dtype, device=device)
        self.views = self.param_views(self.data)
        with torch.no_grad(), engine_access():
            for param, view in zip(self.params, self.views, strict=True):
                if param.is_meta:
                    # `.data =` cannot change a tensor's device type; swapping keeps the Parameter object, which
                    # the module, tied modules and the optimizer already hold.
                    torch.utils.swap_tensors(param, nn.Parameter(view, requires_grad=param.requires_grad))
                    continue
                view.copy_(param.detach())
                param.data = view
        owned = {piece.slot: piece for piece in self.layout.pieces(rank)}
        self.pieces = [owned.get(slot, Piece(slot, 0, 0, 0)) for slot in range(len(self.params))]
        self.shard = self._make_shard()

    def _make_shard(self) -> Tensor:
        raise NotImplementedError

    @property
    def bounds(self) -> tuple[int, int]:
        return self.layout.shard_bounds(self.rank)

    @property
    def shard_numel(self) -> int:
        """Elements of this rank's shard (with whole-tensor owners, they differ between ranks)."""
        return self.layout.shard_size(self.rank)

    def block_plans(self, block: int = QUANT_BLOCK, exact_vectors: bool = True) -> tuple[BlockPlan, ...]:
        """How each rank's shard (of the parameters, or of their gradients) travels quantized, in rank order: blocks
        of ``block`` restart where a tensor begins, and with ``exact_vectors`` tensors of at most one dimension
        (biases, norms' weights) travel exact (see [Note: blocks never span two tensors]). Made once per choice:
        the layout never changes."""
        key = (block, exact_vectors)
        if key not in self._block_plans:
            ranks = self.layout.padded_numel // self.shard_numel
            self._block_plans[key] = tuple(self._block_plan(rank, block, exact_vectors) for rank in range(ranks))
        return self._block_plans[key]

    def _block_plan(self, rank: int, block: int, exact_vectors: bool) -> BlockPlan:
        pieces, padding = self.layout.pieces(rank), self.layout.numel - rank * self.shard_numel  # zeros from there
        exact = [p.shard_offset for p in pieces if exact_vectors and len(self.layout.slots[p.slot].shape) <= 1]
        return BlockPlan.build(self.shard_numel, [*(p.shard_offset for p in pieces), padding], exact, block)

    def owned_elsewhere(self, slot: int) -> bool:
        """Another rank owns parameter ``slot`` whole (see [Note: owner layout]): this rank steps none of it."""
        return self.layout.whole_tensors and not self.pieces[slot].numel and self.layout.slots[slot].numel > 0

    def shaped(self, owned: Tensor, slot: int) -> Tensor:
        """``owned`` (a parameter's 1-D owned part) as the optimizer sees it: in the parameter's own shape where the
        rank owns it whole (see [Note: owner layout]), else as it is."""
        if not self.layout.whole_tensors or owned.numel() != self.layout.slots[slot].numel:
            return owned
        return owned.view(self.layout.slots[slot].shape)

    def cast(self, dtype: torch.dtype | None) -> None:
        """Hold the parameters in ``dtype`` (floating-point buffers only). Call while the buffer holds its full
        values, before training (stage 3: before :meth:`ShardedBuffer.commit_shard`)."""
        if dtype is None or dtype == self.data.dtype or not self.data.dtype.is_floating_point:
            return
        self.data = self.data.to(dtype)
        self.views = self.param_views(self.data)
        self.restore_param_views()
        self.shard = self._make_shard()

    def restore_param_views(self) -> None:
        """Point every parameter at its view of the full buffer again (after a step window swapped them). The views
        are the ones made while the buffer had its memory: a view of a freed storage cannot be made anew."""
        with torch.no_grad(), engine_access():
            for param, view in zip(self.params, self.views, strict=True):
                param.data = view

    def reattach(self) -> bool:
        """Parameters whose ``data`` was replaced (``param.data = tensor``, as ModelPruning's lottery-ticket reset
        does) become views of the buffer again, holding the values they were given. Returns whether any was."""
        storage = self.data.untyped_storage().data_ptr()
        replaced = False
        with torch.no_grad(), engine_access():
            for param, view in zip(self.params, self.views, strict=True):
                if param.untyped_storage().data_ptr() == storage and param.shape == view.shape:
                    continue
                if tuple(param.shape) != tuple(view.shape):
                    raise RuntimeError(
                        f"a parameter of shape {tuple(view.shape)} was given data of shape {tuple(param.shape)}: a "
                        "sharded parameter keeps its shape. Copy values in place (param.copy_(...)) instead."
                    )
                view.copy_(param.data)
                param.data = view
                replaced = True
        return replaced

    def param_views(self, flat: Tensor) -> list[Tensor]:
        """Views of a full-size flat tensor shaped like each parameter."""
        return [flat[slot.offset : slot.offset + slot.numel].view(slot.shape) for slot in self.layout.slots]

    def owned(self, shard_like: Tensor, slot: int) -> Tensor:
        """The 1D part of a shard-size tensor that belongs to parameter ``slot`` (empty where none is owned)."""
        return self.shard_view(shard_like, self.pieces[slot])

    @staticmethod
    def shard_view(shard: Tensor, piece: Piece) -> Tensor:
        """The 1D part of a shard-size tensor that belongs to ``piece``."""
        return shard[piece.shard_offset : piece.shard_offset + piece.numel]

    def gather_full(self, shard_like: Tensor, comm: Communicator) -> Tensor:
        """A new full-size tensor from every rank's ``shard_like`` (collective)."""
        full = torch.empty(self.layout.padded_numel, dtype=shard_like.dtype, device=shard_like.device)
        comm.all_gather(full, shard_like, sizes=self.layout.uneven_sizes)
        return full

    def load_owned(self, slot: int, values: Tensor) -> None:
        """Set the owned elements of parameter ``slot`` (stage 3: in the shard; stages 1 and 2: in the full buffer,
        whose other elements :meth:`ReplicatedBuffer.load_full` sets)."""
        self.owned(self.shard, slot).copy_(values)

    def assign_shard(self, values: Tensor) -> None:
        """The shard becomes ``values`` (an updated master), rounded to the shard's dtype where they are (the
        host, for an offloaded master) and then copied to the shard's device."""
        self.shard.copy_(values.to(self.data.dtype))
        self.shard_written()

    def shard_written(self) -> None:
        """The shard's values were changed in place (a step): where it rests on disk, write it back when settled."""

    def settle(self) -> None:
        """Let a shard resting on disk leave memory (see :class:`ShardedBuffer`); a no-op here."""

    def read_ahead(self) -> None:
        """Start bringing a shard resting on disk into memory (see :class:`ShardedBuffer`); a no-op here."""

    @property
    def nbytes(self) -> int:
        """Bytes of parameter storage held now."""
        raise NotImplementedError


class ReplicatedBuffer(FlatParamBuffer):
    """Stages 1 and 2: every rank holds every parameter; the shard is this rank's view of the full buffer."""

    may_change_at_rest = True

    def _make_shard(self) -> Tensor:
        lo, hi = self.bounds
        return self.data[lo:hi]

    def publish(self, comm: Communicator) -> Work | None:
        """Start gathering every rank's (just updated) shard into the full buffer."""
        return comm.all_gather(self.data, self.shard, async_op=True, sizes=self.layout.uneven_sizes)

    def full_values(self, best: Tensor, comm: Communicator) -> Tensor:
        """A new full-size tensor of ``best`` (the shard, or a wider master of it): collective unless the shard."""
        if best is self.shard:
            return self.data.detach().clone()
        return self.gather_full(best, comm)

    def load_full(self, slot: int, values: Tensor) -> None:
        """Set every element of parameter ``slot`` (each rank holds them all)."""
        self.param_views(self.data)[slot].copy_(values.view(self.layout.slots[slot].shape))

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class ShardedBuffer(FlatParamBuffer):
    """Stage 3: the shard is a tensor of its own; the full buffer exists only while gathered. With
    ``shard_home`` (``offload_params="cpu"``) the shard rests there and is copied to the device for each gather;
    with ``resting`` (``offload_params="nvme"``) it rests in a swap file and is in memory only from its first use
    (a gather, a step, a checkpoint) until :meth:`settle` (when the unit is freed, after the step)."""

    may_change_at_rest = False  # writes at rest are refused (see [Note: stage-3 parameters at rest])

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        rank: int,
        world_size: int,
        device: torch.device | None = None,
        shard_home: torch.device | None = None,
        resting: ShardStorage | None = None,
        owners: Sequence[int] | None = None,
    ) -> None:
        self.shard_home = shard_home
        self.resting = resting
        self._shard: Tensor | None = None
        self._reading: Future[Tensor] | None = None  # a read-ahead of the resting shard (see read_ahead)
        self._written = False
        self.quantized = False  # the full buffer holds dequantized int8 values, not the shards' exact ones
        self.gather_memory = NO_REUSE  # set by its unit (GatherUnit.use_memory): [Note: reusing gathered storage]
        super().__init__(params, rank, world_size, device, owners)

    @property  # type: ignore[override]
    def shard(self) -> Tensor:
        if self._shard is None:  # at rest on disk: read back on first use (or take the read-ahead)
            assert self.resting is not None
            reading, self._reading = self._reading, None
            self._shard = reading.result() if reading else self.resting.get(self.data.dtype, self.shard_numel)
        return self._shard

    @shard.setter
    def shard(self, value: Tensor) -> None:
        if self._reading is not None:
            self._reading.result()
            self._reading = None
        self._shard, self._written = value, True

    def assign_shard(self, values: Tensor) -> None:
        if self.resting is not None and self._shard is None:  # at rest on disk: no need to read what is replaced
            if self._reading is not None:
                self._reading.result()
                self._reading = None
            self.shard = values.to(self.data.dtype, copy=True)
            return
        super().assign_shard(values)

    def read_ahead(self) -> None:
        """Start reading a shard that rests on disk in the background (the unit is gathered soon); a no-op when
        it is in memory, being read, or not on disk."""
        if self.resting is not None and self._shard is None and self._reading is None:
            self._reading = self.resting.get_async(self.data.dtype, self.shard_numel)

    def shard_written(self) -> None:
        self._written = True

    def settle(self) -> None:
        """``offload_params="nvme"``: the shard goes back to its swap region (written if it changed) and leaves
        memory; a no-op otherwise."""
        if self._reading is not None:  # read ahead, never used: the region still holds the values
            self._reading.result()
            self._reading = None
        if self.resting is None or self._shard is None:
            return
        if self._written or not self.resting.holds(self._shard):
            self.resting.put(self._shard)
        self._shard, self._written = None, False

    def _make_shard(self) -> Tensor:
        lo, hi = self.bounds
        if self.shard_home is None or self.shard_home == self.data.device:
            return self.data[lo:hi].clone()
        shard = host_empty(hi - lo, self.data.dtype, pin=self.data.device.type == "cuda")
        return shard.copy_(self.data[lo:hi])

    def load_owned(self, slot: int, values: Tensor) -> None:
        super().load_owned(slot, values)
        self._written = True

    @property
    def shard_offloaded(self) -> bool:
        """The shard rests off the device (``offload_params``)."""
        return self.shard_home is not None

    @property
    def state(self) -> ShardedState:
        return ShardedState.GATHERED if self.data.untyped_storage().nbytes() > 0 else ShardedState.SHARDED

    def full_values(self, best: Tensor, comm: Communicator) -> Tensor:
        return self.gather_full(best, comm)

    def publish(self, comm: Communicator) -> Work | None:
        """Nothing to send after a step: the new shard is gathered when the unit is next used."""
        return None

    def start_unshard(self, comm: Communicator, quantized: bool = False, what: str = "a buffer") -> Work | None:
        """Give the full buffer its memory back and start gathering every rank's shard into it; with ``quantized``
        as int8, ``what`` naming the buffer in errors (see [Note: quantized gathers never reach the shard])."""
        shard = self.shard.to(self.data.device, non_blocking=True)
        return self.start_gather_from(shard, comm, self.layout.uneven_sizes, quantized, what)

    def start_gather_from(
        self, part: Tensor, comm: Communicator, sizes: Sequence[int] | None, quantized: bool = False, what: str = ""
    ) -> Work | None:
        """Give the full buffer its memory back and start gathering every rank of ``comm``'s ``part`` of it (rank
        ``r``'s has ``sizes[r]`` elements, all alike where ``None``) into it: the shards, or the secondary slices (see
        [Note: secondary shards]); as int8 with ``quantized``."""
        storage = self.data.untyped_storage()
        self.gather_memory.fill(storage, self.layout.padded_numel * self.data.element_size())
        # The gather writes back the values autograd saved in forward. It writes through an alias of the
        # storage with a version counter of its own, so backward does not take it for an in-place change of
        # the saved views (the values are the same: see [Note: freeing gathered storage]).
        target = torch.empty(0, dtype=self.data.dtype, device=self.data.device).set_(storage, 0, self.data.shape)
        self.quantized = quantized
        if quantized:
            return comm.all_gather_quantized(target, part, what, async_op=True, plans=self.block_plans())
        return comm.all_gather(target, part, async_op=True, sizes=sizes)

    def commit_shard(self) -> None:
        """Keep this rank's part of the full buffer as the shard and free the rest (setup)."""
        self.write_back()
        self.reshard()

    def write_back(self) -> None:
        """Copy this rank's part of the gathered buffer into the shard (after the parameters were changed); refused
        after a quantized gather (see [Note: quantized gathers never reach the shard])."""
        if self.quantized:
            raise RuntimeError(
                "ZeroStrategy(quantize_weights=True): a buffer gathered as int8 holds approximate values and is never "
                "written back into the exact shard. Gather it exactly (gathered_params / the engine's gathered()) "
                "before changing parameters."
            )
        lo, hi = self.bounds
        self.shard.copy_(self.data[lo:hi])
        self._written = True

    def reshard(self, keep: bool = False) -> None:
        """Free the full buffer's memory (and, resting on disk, the shard's). See [Note: freeing gathered storage];
        ``keep``: another gather follows soon, which may take the memory (see [Note: reusing gathered storage])."""
        self.gather_memory.free(self.data.untyped_storage(), keep)
        self.quantized = False
        self.settle()

    @property
    def nbytes(self) -> int:
        """Device bytes (the shard too, unless it rests off the device)."""
        shard = 0 if self.shard_offloaded else self.shard_nbytes
        return self.data.untyped_storage().nbytes() + shard

    @property
    def shard_nbytes(self) -> int:
        return self.shard_numel * self.data.element_size()
