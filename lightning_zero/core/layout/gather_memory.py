"""Host memory a freed stage-3 buffer hands to the next gather, so that it is not given back to the system in between.

[Note: reusing gathered storage]
Stage 3 frees a gathered buffer by resizing its storage to zero bytes and gives it memory again at its next gather
(see [Note: freeing gathered storage]). On CUDA the caching allocator keeps freed blocks for the next request. On the
CPU the memory goes back to glibc, which returns large blocks to the system (``munmap``, or a trim of the heap's top),
so every gather of a unit faults its pages in afresh: 87 MiB of fresh pages a step on the 25M GPT of
docs/benchmarks.md, with their cost in the forward and the backward.

So, on the CPU, a buffer freed while the scheduler expects another gather soon (a forward whose last pass went on
after this unit, a backward plan with entries left) moves its memory into :class:`GatherMemory` instead: the storage's
data is swapped into an empty storage the pool keeps (``UntypedStorage._swap_data_ptr_``, which leaves the
``StorageImpl`` that the parameters and autograd's saved views share in place, empty as after a resize). The next
gather of a buffer of the same size swaps it back; other sizes get new memory. The pool holds memory only until the
next gather starts (what no gather took is freed then) or the pass ends (``release``): at most one unit's buffers,
in the window where the freed unit's memory would have been requested again anyway, never at the end of a forward or
a backward. Its bytes are counted as ``gathered`` in the step's ledger (see [Note: step peak ledger]). The values in
kept memory are stale, like a new allocation's: every gather overwrites its whole buffer.
"""

from __future__ import annotations

import torch

from lightning_zero.core.peak import DETACHED, PeakLedger

_SWAP = getattr(torch.UntypedStorage, "_swap_data_ptr_", None)  # absent: every free gives memory back, as before


class GatherMemory:
    """Memory of freed full buffers, kept from a free until the next gather starts (see [Note: reusing gathered
    storage]). ``enabled`` is False where the allocator caches by itself (CUDA) or torch cannot swap storages."""

    def __init__(self, device: torch.device, ledger: PeakLedger = DETACHED) -> None:
        self.enabled = device.type == "cpu" and _SWAP is not None
        self.ledger = ledger
        self._idle: dict[int, list[torch.UntypedStorage]] = {}

    @property
    def nbytes(self) -> int:
        return sum(nbytes * len(kept) for nbytes, kept in self._idle.items())

    def free(self, storage: torch.UntypedStorage, keep: bool) -> None:
        """Empty ``storage``; with ``keep`` its memory waits here for the next gather instead of going back."""
        nbytes = storage.nbytes()
        if not (keep and self.enabled and nbytes):
            storage.resize_(0)
            return
        holder = torch.UntypedStorage(0, device=storage.device)
        _SWAP(storage, holder)
        self._idle.setdefault(nbytes, []).append(holder)  # counted by count(), once the buffer's bytes are dropped

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give the empty ``storage`` ``nbytes`` of memory: kept memory of that size where there is some."""
        kept = self._idle.get(nbytes)
        if kept and storage.nbytes() == 0:
            _SWAP(storage, kept.pop())
            if not kept:
                del self._idle[nbytes]
            self.count()  # before the buffer's bytes are counted: the ledger never sees them twice
        else:
            self.release()  # memory of other sizes goes back before new memory is taken
            storage.resize_(nbytes)

    def release(self) -> None:
        """Give back what no gather took: a gather started (it took what it could) or a pass ended."""
        if self._idle:
            self._idle.clear()
            self.count()

    def count(self) -> None:
        """Tell the ledger the bytes kept now (see [Note: step peak ledger])."""
        self.ledger.hold("gathered", (id(self), "kept"), self.nbytes)


NO_REUSE = GatherMemory(torch.device("meta"))  # buffers outside a scheduler: every free gives memory back
