"""NVMe offload: the master shard and the optimizer state in one unlinked file per rank, paged in per buffer.

[Note: paged optimizer steps]
``offload_optimizer="nvme"`` keeps each trainable buffer's fp32 master and its optimizer state in regions of a
:class:`SwapFile`. Between steps the optimizer's state dict holds, for each element-wise state tensor, an empty
placeholder of its dtype (scalars such as ``step`` stay). Inside the step window, ``run_paged`` (core/step/paged.py)
steps one buffer at a time: a worker thread reads the next buffers' regions (read-ahead) while the optimizer steps this
one with only its parameters given gradients (torch's optimizers skip a parameter without one), the updated master is
rounded into the device shard, and another worker writes the regions back (write-behind). At most :data:`PIPELINE_DEPTH`
buffers are in host memory at once, so host memory holds a few buckets, never the whole state. State the optimizer
creates in its first step is given a region then. A failed read or write is agreed across ranks (one all-reduce per
step) and raised on every rank naming the file, the offset and the errno.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.core.layout.flat_buffer import FlatParamBuffer
from lightning_zero.core.store.host import HOST, host_release_grads, host_step_grads
from lightning_zero.core.store.stores import ShardStore
from lightning_zero.core.store.swap import Region, SwapFile, aligned_empty, typed_view

PIPELINE_DEPTH = 3  # buffers in host memory at once during a paged step: read ahead, stepping, written behind


@dataclass
class Paged:
    """One buffer's regions in host memory during a paged step: the raw pages and typed views of them."""

    pages: dict[str, Tensor] = field(default_factory=dict)
    views: dict[str, Tensor] = field(default_factory=dict)


class DiskStore(ShardStore):
    """``offload_optimizer="nvme"``: the master shard and the optimizer state of one buffer in a swap file. See
    [Note: paged optimizer steps].

    Args:
        buffer: the parameters; call while it holds its full values (before ``buffer.cast``).
        master_dtype: the master's dtype (fp32).
        swap: the rank's swap file.
    """

    offloaded = True
    paged = True

    def __init__(self, buffer: FlatParamBuffer, master_dtype: torch.dtype, swap: SwapFile) -> None:
        super().__init__(buffer)
        self.swap = swap
        self.master_dtype = master_dtype
        lo, hi = buffer.bounds
        self.numel = hi - lo
        # region name -> (region, dtype); state regions are named "<optimizer id>/<state key>"
        self.regions: dict[str, tuple[Region, torch.dtype]] = {}
        self.slots_with: dict[str, set[int]] = {}  # state region -> the slots whose state it holds
        self._staged: Tensor | None = None  # the master in memory while a checkpoint loads into it
        self._sync_pending = False
        master = self._new_region("master", master_dtype)
        page = aligned_empty(master.padded)
        typed_view(page, master_dtype, self.numel).copy_(buffer.data[lo:hi])
        swap.write(master, page)

    def _new_region(self, name: str, dtype: torch.dtype) -> Region:
        region = self.swap.allocate(self.numel * dtype.itemsize)
        self.regions[name] = (region, dtype)
        return region

    # ------------------------------------------------------------------ the step (see run_paged)
    def page_in(self, optimizer: Optimizer) -> Paged:
        """Read the master and ``optimizer``'s state regions (in a worker thread)."""
        paged = Paged()
        prefix = _prefix(optimizer)
        for name, (region, dtype) in self.regions.items():
            if name == "master" or name.startswith(prefix):
                paged.pages[name] = self.swap.read(region)
                paged.views[name] = typed_view(paged.pages[name], dtype, self.numel)
        return paged

    def bind(self, paged: Paged, optimizer: Optimizer, entries: Sequence[tuple[nn.Parameter, int, Tensor]]) -> None:
        """Point the parameters, their gradients and their optimizer state at the paged-in regions."""
        master = paged.views["master"]
        self._apply_writes_at_rest(master)
        prefix = _prefix(optimizer)
        for param, slot, grad in entries:
            param.data = self.buffer.shaped(self.buffer.owned(master, slot), slot)
            stepped = grad is not None and not self.buffer.owned_elsewhere(slot)
            param.grad = self.buffer.shaped(grad, slot) if stepped else None
            state = optimizer.state.get(param)
            if not state:
                continue
            for name, view in paged.views.items():
                if name.startswith(prefix) and slot in self.slots_with[name]:
                    state[name.removeprefix(prefix)] = self.buffer.shaped(self.buffer.owned(view, slot), slot)

    def unbind(self, paged: Paged, optimizer: Optimizer, entries: Sequence[tuple[nn.Parameter, int, Tensor]]) -> None:
        """After the optimizer stepped: the new shard reaches the device, state moves into the regions (new state
        gets one), and the optimizer keeps placeholders."""
        self.buffer.assign_shard(paged.views["master"])
        self._sync_pending = False
        self._take_state(paged, optimizer, [(param, slot) for param, slot, _ in entries])
        for param, slot, _ in entries:
            param.grad = None
            param.data = self.step_view(slot)  # the page is freed once written back, not at the end of the step
        self.buffer.settle()  # offload_params="nvme": the new shard goes to its region too

    def page_out(self, paged: Paged) -> None:
        """Write the paged-in regions back (in a worker thread)."""
        for name, page in paged.pages.items():
            self.swap.write(self.regions[name][0], page)

    def _take_state(self, paged: Paged, optimizer: Optimizer, params: Sequence[tuple[nn.Parameter, int]]) -> None:
        prefix = _prefix(optimizer)
        for param, slot in params:
            state = optimizer.state.get(param)
            if not state:
                continue
            numel = self.buffer.pieces[slot].numel
            for key, value in list(state.items()):
                if not isinstance(value, Tensor) or value.dim() == 0 or value.numel() != numel:
                    continue
                name = prefix + key
                if name not in self.regions:
                    region = self._new_region(name, value.dtype)
                    paged.pages[name] = aligned_empty(region.padded)
                    paged.views[name] = typed_view(paged.pages[name], value.dtype, self.numel).zero_()
                    self.slots_with[name] = set()
                elif name not in paged.pages:  # a region of this optimizer not paged in: state made outside a step
                    paged.pages[name] = self.swap.read(self.regions[name][0])
                    paged.views[name] = typed_view(paged.pages[name], value.dtype, self.numel)
                target = self.buffer.owned(paged.views[name], slot)
                if target.data_ptr() != value.data_ptr() or numel == 0:
                    target.copy_(value.reshape(-1))  # whole-tensor owners step it in the parameter's shape
                self.slots_with[name].add(slot)
                state[key] = torch.empty(0, dtype=value.dtype, device=HOST)  # see [Note: paged optimizer steps]

    def _apply_writes_at_rest(self, master: Tensor) -> None:
        """Parameter values written between steps (stages 1 and 2, or a write-back at stage 3) reach the master."""
        if self.buffer.may_change_at_rest or self._sync_pending:
            shard = self.buffer.shard.to(HOST)
            torch.where(shard != master.to(shard.dtype), shard.to(master.dtype), master, out=master)

    # ------------------------------------------------------------------ outside the step
    def absorb_state(self, optimizer: Optimizer, params: Sequence[tuple[nn.Parameter, int]]) -> None:
        """Move in-memory state ``optimizer`` holds for ``params`` (loaded from a checkpoint) into the file."""
        if not any(
            isinstance(v, Tensor) and v.dim() > 0 and v.numel() > 0
            for p, _ in params
            for v in optimizer.state.get(p, {}).values()
        ):
            return
        self.flush()
        prefix = _prefix(optimizer)
        for name in [n for n in self.slots_with if n.startswith(prefix)]:
            kept = {slot for slot in self.slots_with[name] if _has_placeholder(optimizer, params, slot, name)}
            self.slots_with[name] = kept
        paged = Paged()
        self._take_state(paged, optimizer, params)
        self.page_out(paged)

    def read_state(self, optimizer: Optimizer, params: Sequence[tuple[nn.Parameter, int]]) -> dict[int, dict]:
        """The state of ``params`` with its element-wise tensors read from the file (copies; read-only maps of it
        inside :meth:`SwapFile.mapped_reads`), by ``id(param)``."""
        prefix = _prefix(optimizer)
        pages = {name: self._read(name) for name in self.regions if name.startswith(prefix)}
        mapped = self.swap.map_reads
        states: dict[int, dict] = {}
        for param, slot in params:
            state = optimizer.state.get(param)
            if not state:
                continue
            full = dict(state)
            for name, view in pages.items():
                if slot in self.slots_with[name]:
                    piece = self.buffer.owned(view, slot)
                    full[name.removeprefix(prefix)] = piece if mapped else piece.clone()
            states[id(param)] = full
        return states

    def forget_state(self, optimizer: Optimizer) -> None:
        """``optimizer``'s state was cleared: its regions hold nothing any more."""
        prefix = _prefix(optimizer)
        for name in self.slots_with:
            if name.startswith(prefix):
                self.slots_with[name].clear()

    def step_view(self, slot: int) -> Tensor:
        """A stand-in of the piece's size that holds no memory: the parameter is stepped in
        :func:`~lightning_zero.core.step.paged.run_paged`, and ``optimizer.step()`` itself then sees it without a
        gradient."""
        return torch.empty((), dtype=self.master_dtype).expand(self.buffer.pieces[slot].numel)

    def best(self) -> Tensor:
        if self._staged is not None:
            return self._staged
        if self.swap.map_reads and not (self.buffer.may_change_at_rest or self._sync_pending):
            return self._read("master")  # nothing written at rest to apply: the file holds the values
        master = typed_view(self.swap.read(self.regions["master"][0]), self.master_dtype, self.numel)
        self._apply_writes_at_rest(master)
        return master

    def _read(self, name: str) -> Tensor:
        """Region ``name``'s values: a copy, or a read-only map inside :meth:`SwapFile.mapped_reads`."""
        region, dtype = self.regions[name]
        if self.swap.map_reads:
            return self.swap.map(region, dtype, self.numel)
        return typed_view(self.swap.read(region), dtype, self.numel)

    def step_grads(self, slots: Sequence[int], held: Sequence[Tensor], scale: float | None) -> list[Tensor]:
        return host_step_grads(self.buffer, self.master_dtype, slots, held, scale)

    def release(self, held: Sequence[Tensor], step_grads: Sequence[Tensor], clipped: bool, scale: float | None) -> None:
        host_release_grads(held, step_grads, clipped, scale)

    def finish(self) -> None:
        """Nothing to do: :meth:`unbind` rounded each paged-in master into the shard."""

    def sync_from_params(self) -> None:
        self.buffer.reattach()
        self._sync_pending = True  # applied when the master is next read

    def load_owned(self, slot: int, values: Tensor) -> None:
        if self._staged is None:
            if self.swap.staged is not None:
                self.swap.staged.flush()
            self._staged = self.best().clone()
            self.swap.staged = self
        self.buffer.owned(self._staged, slot).copy_(values)
        self.buffer.load_owned(slot, values)

    def flush(self) -> None:
        """Write a master staged by :meth:`load_owned` to the file."""
        if self._staged is None:
            return
        region = self.regions["master"][0]
        page = aligned_empty(region.padded)
        typed_view(page, self.master_dtype, self.numel).copy_(self._staged)
        self.swap.write(region, page)
        self._staged = None
        self._sync_pending = False
        if self.swap.staged is self:
            self.swap.staged = None

    @property
    def offloaded_nbytes(self) -> int:
        return sum(region.nbytes for region, _ in self.regions.values())


def _prefix(optimizer: Optimizer) -> str:
    return f"{id(optimizer)}/"


def _has_placeholder(optimizer: Optimizer, params: Sequence[tuple[nn.Parameter, int]], slot: int, name: str) -> bool:
    key = name.split("/", 1)[1]
    for param, param_slot in params:
        if param_slot == slot:
            value = optimizer.state.get(param, {}).get(key)
            return isinstance(value, Tensor) and value.numel() == 0
    return False
