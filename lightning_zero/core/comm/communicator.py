"""The one module that calls torch.distributed collectives; it counts the bytes each one moves (see [Note: counting
communication] in stats.py). The groups they run over are made and destroyed in groups.py.

[Note: host tensors on NCCL]
NCCL takes device tensors only, but with offload the fp32 masters, optimizer state and their gradients rest on the
host, and a full state dict, ``release()`` or a clipping norm gathers or reduces them. A collective whose tensors
rest on the host is therefore staged through the device: copied there, run (and waited for), copied back, and
counted once. That happens only off the per-step path (state dicts) or on scalars (norms); gloo takes host tensors
as they are. Found by benchmarks/gpu_check.py on an H200: every offload mode failed "No backend type associated
with device type cpu" before.

[Note: uneven collectives]
With ``partition="parameter"`` (see [Note: owner layout]) the ranks' parts of a buffer differ in size, and
neither gloo nor torch's single-tensor collectives take uneven parts. An uneven all-gather is one broadcast
from each rank with a non-empty part, into its place in the full buffer; an uneven reduce-scatter is one
reduce to each such rank, of its part of the full buffer, in place (gloo may use the other ranks' copies as
scratch, so the input is spent) and then copied into the output. Each rank sends and receives what the even
collectives move, without padding; they are counted as the all-gather or reduce-scatter they replace.
"""

from __future__ import annotations

import functools
import itertools
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_zero.core.comm.groups import GroupMember
from lightning_zero.core.comm.quantize import BlockPlan, check_finite_scales, dequantize_blocks, quantize_blocks

# torch 2.10+ renamed the single-tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

Work = dist.Work


class Communicator(GroupMember):
    """Named collectives over one process group, each counted in :attr:`stats` (arguments: :class:`GroupMember`'s)."""

    def _on_host(self, *tensors: Tensor) -> bool:
        """A tensor of the collective rests on the host while the backend (NCCL) takes device tensors only."""
        return self._nccl_device is not None and any(t.device.type == "cpu" for t in tensors)

    def reduce_scatter(
        self, output: Tensor, input: Tensor, async_op: bool = False, sizes: Sequence[int] | None = None
    ) -> Work | None:
        """Sum ``input`` over ranks; this rank receives its ``1/world_size`` part in ``output`` (its ``sizes[rank]``
        elements, after those of the lower ranks, with uneven ``sizes``: see [Note: uneven collectives]). ``input``
        is spent (its other parts may be overwritten)."""
        if self._on_host(output, input):  # see [Note: host tensors on NCCL]
            staged = torch.empty_like(output, device=self._nccl_device)
            self.reduce_scatter(staged, input.to(self._nccl_device), sizes=sizes)
            return _copied_back(output, staged, async_op)
        self.stats.add("reduce_scatter", input.numel() * input.element_size())
        what = self._what("reduce-scatter", input)
        if sizes is not None:
            return self._uneven(what, "reduce", input, output, sizes, async_op)
        if self._list_reduce_scatter:
            chunks = list(input.chunk(self.world_size))
            work = self._guarded(what, dist.reduce_scatter, output, chunks, group=self.group, async_op=True)
        else:
            work = self._guarded(what, _reduce_scatter_single, output, input, group=self.group, async_op=True)
        return _finish(work, async_op)

    def all_gather(
        self,
        output: Tensor,
        input: Tensor,
        async_op: bool = False,
        sizes: Sequence[int] | None = None,
        label: str = "all_gather",
    ) -> Work | None:
        """Concatenate every rank's ``input`` into ``output`` (``input`` may be this rank's part of it); with
        ``sizes``, rank ``r``'s input has ``sizes[r]`` elements (see [Note: uneven collectives]). Counted under
        ``label``."""
        if self._on_host(output, input):  # see [Note: host tensors on NCCL]
            staged = torch.empty_like(output, device=self._nccl_device)
            self.all_gather(staged, input.to(self._nccl_device), sizes=sizes, label=label)
            return _copied_back(output, staged, async_op)
        self.stats.add(label, output.numel() * output.element_size())
        what = self._what("all-gather", output)
        if sizes is not None:
            return self._uneven(what, "broadcast", output, input, sizes, async_op)
        work = self._guarded(what, _all_gather_single, output, input, group=self.group, async_op=True)
        return _finish(work, async_op)

    def all_to_all(
        self, output: Tensor, input: Tensor, label: str = "all_to_all", async_op: bool = False
    ) -> Work | None:
        """Send the ``r``-th of ``world_size`` equal parts of the 1-D ``input`` to rank ``r``; ``output`` receives
        every rank's part for this rank, in rank order. Counted as ``input``'s bytes under ``label``: each rank
        sends ``1/world_size`` of them to each peer, as [Note: counting communication] assumes. Device tensors
        only (the gradient buckets')."""
        self.stats.add(label, input.numel() * input.element_size())
        what = self._what("all-to-all", input)
        work = self._guarded(what, dist.all_to_all_single, output, input, group=self.group, async_op=True)
        return _finish(work, async_op)

    def all_gather_quantized(
        self, output: Tensor, input: Tensor, what: str, async_op: bool = False, plans: Sequence[BlockPlan] = ()
    ) -> Work | None:
        """As :meth:`all_gather` (even parts only), each rank's ``input`` sent as int8 (see [Note: quantized
        all-gather] in quantize.py), every part dequantized into ``output``; ``plans[r]`` cuts rank ``r``'s part into
        blocks. ``what`` names the tensor in the error raised on every rank when a part holds inf/NaN."""
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(
                f"a quantized all-gather takes even parts: {input.numel()} x {self.world_size} ranks "
                f"!= {output.numel()} elements"
            )
        plans = plans or [BlockPlan.build(input.numel())] * self.world_size
        values, own_scales = quantize_blocks(input.to(output.device), plan=plans[self.rank])
        scales = own_scales.new_zeros(max(plan.scale_count for plan in plans))
        scales[: own_scales.numel()] = own_scales
        staged = self._nccl_device if self._on_host(output) else None  # see [Note: host tensors on NCCL]
        if staged is not None:
            values, scales = values.to(staged), scales.to(staged)
        all_values = torch.empty(values.numel() * self.world_size, dtype=values.dtype, device=values.device)
        all_scales = torch.empty(scales.numel() * self.world_size, dtype=scales.dtype, device=scales.device)
        self.stats.add("all_gather", all_values.numel() + all_scales.numel() * all_scales.element_size())  # int8
        label = self._what("quantized all-gather", all_values)
        works = [
            self._guarded(label, _all_gather_single, all_values, values, group=self.group, async_op=True),
            self._guarded(label, _all_gather_single, all_scales, scales, group=self.group, async_op=True),
        ]

        def dequantize() -> None:
            check_finite_scales(all_scales, what)
            chunks = (t.chunk(self.world_size) for t in (output, all_values, all_scales))
            for rank, (part, part_values, part_scales) in enumerate(zip(*chunks, strict=True)):
                part_scales = part_scales[: plans[rank].scale_count].to(part.device)
                dequantize_blocks(part_values.to(part.device), part_scales, part, plan=plans[rank])

        return _finish(UnevenWork(works, dequantize), async_op)

    def all_reduce(
        self, tensor: Tensor, op: str = "sum", counted: bool = True, label: str = "all_reduce", async_op: bool = False
    ) -> Work | None:
        """Reduce ``tensor`` over the ranks in place, counted under ``label`` (``counted=False``: not the engine's,
        e.g. a logged metric)."""
        if self._on_host(tensor):  # see [Note: host tensors on NCCL]
            staged = tensor.to(self._nccl_device)
            self.all_reduce(staged, op, counted, label)
            tensor.copy_(staged)
            return UnevenWork([]) if async_op else None  # type: ignore[return-value]
        if counted:
            self.stats.add(label, 2 * tensor.numel() * tensor.element_size())
        what = self._what("all-reduce", tensor)
        work = self._guarded(what, dist.all_reduce, tensor, op=_REDUCE_OPS[op], group=self.group, async_op=True)
        return _finish(work, async_op)

    def broadcast(self, tensor: Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` with rank ``src``'s (``src`` is a rank of this group)."""
        if self._on_host(tensor):  # see [Note: host tensors on NCCL]
            staged = tensor.to(self._nccl_device)
            self.broadcast(staged, src)
            tensor.copy_(staged)
            return
        self.stats.add("broadcast", tensor.numel() * tensor.element_size())
        self._broadcast(self._what("broadcast", tensor), tensor, src)

    def _broadcast(self, what: str, tensor: Tensor, src: int) -> None:
        source = dist.get_global_rank(self.group, src) if self.group else src
        self._guarded(what, dist.broadcast, tensor, src=source, group=self.group, async_op=True).wait()

    def barrier(self) -> None:
        """Wait until every rank reached this barrier (uncounted: it moves no data)."""
        what = f"a barrier of {self.world_size} ranks"
        self._guarded(what, dist.barrier, group=self.group, async_op=True).wait()

    def exchange_tags(self, mine: Tensor, everyone: Tensor) -> None:
        """Every rank's ``mine`` (a few int64, the same count on every rank) into ``everyone``, counted under
        ``"agree"``."""
        self.stats.add("agree", everyone.numel() * everyone.element_size())
        what = self._what("all-gather", everyone) + " (of stage-3 gather tags)"
        self._guarded(what, _all_gather_single, everyone, mine, group=self.group, async_op=True).wait()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj`` (uncounted: agreements and error messages), through tensors, so that its
        waits are those of any collective (see [Note: a rank that raises and stays alive])."""
        what = "an all-gather of Python objects (an agreement between ranks)"
        device = self._nccl_device or torch.device("cpu")
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=device)
        mine = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        self._guarded(what, _all_gather_single, sizes, mine, group=self.group, async_op=True).wait()
        counts = sizes.tolist()
        padded = torch.zeros(max(counts), dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        everyone = torch.empty(self.world_size * padded.numel(), dtype=torch.uint8, device=device)
        self._guarded(what, _all_gather_single, everyone, padded, group=self.group, async_op=True).wait()
        rows = everyone.view(self.world_size, -1).cpu()
        return [pickle.loads(rows[rank, :count].numpy().tobytes()) for rank, count in enumerate(counts)]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s picklable ``obj`` on every rank (uncounted, as :meth:`all_gather_object`)."""
        what = "a broadcast of a Python object"
        device = self._nccl_device or torch.device("cpu")
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        self._broadcast(what, size, src)
        payload = data if self.rank == src else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        self._broadcast(what, payload, src)
        return obj if self.rank == src else pickle.loads(payload.cpu().numpy().tobytes())

    def _uneven(
        self, what: str, op: str, full: Tensor, part: Tensor, sizes: Sequence[int], async_op: bool
    ) -> Work | None:
        """An uneven all-gather (``op="broadcast"``) or reduce-scatter (``op="reduce"``) of the 1-D ``full`` as one
        broadcast from, or reduce to, each rank with a non-empty part. See [Note: uneven collectives]."""
        if len(sizes) != self.world_size or sum(sizes) != full.numel():
            raise ValueError(f"uneven sizes {list(sizes)} do not split {full.numel()} elements over {self.world_size}")
        offsets = _offsets(tuple(sizes))
        mine = full[offsets[self.rank] : offsets[self.rank] + sizes[self.rank]]
        if op == "broadcast" and part.data_ptr() != mine.data_ptr():
            mine.copy_(part)
        works = []
        for rank, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
            if size == 0:
                continue
            region = full[offset : offset + size]
            peer = dist.get_global_rank(self.group, rank) if self.group else rank
            if op == "broadcast":
                works.append(self._guarded(what, dist.broadcast, region, src=peer, group=self.group, async_op=True))
            else:
                works.append(self._guarded(what, dist.reduce, region, dst=peer, group=self.group, async_op=True))
        copy_out = op == "reduce" and part.data_ptr() != mine.data_ptr()
        work = UnevenWork(works, (lambda: part.copy_(mine)) if copy_out else None)
        if async_op:
            return work  # type: ignore[return-value]
        work.wait()
        return None

    def _what(self, op: str, tensor: Tensor) -> str:
        article = "an" if op[0] in "aeiou" else "a"
        nbytes = tensor.numel() * tensor.element_size()
        return f"{article} {op} of {nbytes} bytes ({tensor.dtype}) over {self.world_size} ranks"

    def agree(self, what: str, entries: Sequence[tuple[str, Any]], fix: str) -> None:
        """Raise the same ``RuntimeError`` on every rank unless all ranks pass equal ``entries``.

        ``entries`` are ``(name, value)`` pairs; the error names the first pair that differs.
        """
        everyone = self.all_gather_object(list(entries))
        reference = everyone[0]
        for rank, theirs in enumerate(everyone[1:], start=1):
            if theirs == reference:
                continue
            mine, other = dict(reference), dict(theirs)
            for name in list(mine) + [name for name in other if name not in mine]:
                if mine.get(name, "<missing>") != other.get(name, "<missing>"):
                    raise RuntimeError(
                        f"ranks disagree on {what}: rank 0 has {name!r} {mine.get(name, '<missing>')}, rank {rank} "
                        f"has {other.get(name, '<missing>')}. {fix}"
                    )
            raise RuntimeError(f"ranks disagree on {what}: rank 0 and rank {rank} list them in another order. {fix}")


class UnevenWork:
    """The works of one uneven collective, waited for together; ``then`` runs once they completed."""

    def __init__(self, works: Sequence[Any], then: Callable[[], object] | None = None) -> None:
        self.works, self.then = list(works), then

    def wait(self, *args: Any) -> bool:
        for work in self.works:
            work.wait(*args)
        self.works = []
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@functools.cache
def _offsets(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """Where each rank's part of an uneven collective begins (once per layout: a gather asks every time)."""
    return (0, *itertools.accumulate(sizes))[:-1]


def _copied_back(output: Tensor, staged: Tensor, async_op: bool) -> Any:
    """After a collective staged through the device (complete): its result copied into the host ``output``."""
    output.copy_(staged)
    return UnevenWork([]) if async_op else None  # a work that is already complete


def _finish(work: Any, async_op: bool) -> Any:
    """``work`` for the caller to wait for, or waited for here (``None``)."""
    if async_op:
        return work
    work.wait()
    return None


def wait_all(works: Sequence[Work | None]) -> None:
    for work in works:
        if work is not None:
            work.wait()
