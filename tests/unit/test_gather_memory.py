"""GatherMemory: a freed stage-3 buffer's host memory waits for the next gather of its size, and no longer (see
[Note: reusing gathered storage]). The tests hold storages, not tensors: a failing assertion's locals are printed,
and a tensor whose storage was freed cannot be."""

from __future__ import annotations

import torch

from lightning_zero.core.layout.gather_memory import GatherMemory
from lightning_zero.core.peak import PeakLedger


def test_kept_memory_goes_to_the_next_gather_of_its_size_and_views_follow() -> None:
    ledger = PeakLedger()
    memory = GatherMemory(torch.device("cpu"), ledger)
    freed, gathered = torch.UntypedStorage(4096), torch.UntypedStorage(4096)
    address = freed.data_ptr()
    memory.free(freed, keep=True)
    memory.count()
    assert freed.nbytes() == 0  # freed, as a resize to zero leaves it
    assert memory.nbytes == 4096
    assert ledger.current["gathered"] == 4096
    memory.free(gathered, keep=False)  # not kept: given back
    assert gathered.nbytes() == 0
    assert memory.nbytes == 4096
    memory.fill(gathered, 4096)
    assert gathered.data_ptr() == address  # the kept memory, not new memory
    assert memory.nbytes == 0
    assert ledger.current["gathered"] == 0
    memory.fill(freed, 4096)  # nothing kept: new memory
    assert freed.nbytes() == 4096
    assert freed.data_ptr() != address

    values = torch.empty(0).set_(freed, 0, (1024,))
    view = values[10:20]  # a parameter's view, or one autograd saved
    memory.free(freed, keep=True)
    memory.fill(freed, 4096)  # the storage the view shares gets its memory back
    values.fill_(1.0)
    assert torch.equal(view, torch.ones(10))


def test_another_size_gets_new_memory_after_what_was_kept_went_back() -> None:
    memory = GatherMemory(torch.device("cpu"))
    small, large = torch.UntypedStorage(1024), torch.UntypedStorage(0)
    memory.free(small, keep=True)
    assert memory.nbytes == 1024
    memory.fill(large, 4096)  # no memory of its size kept: the small one goes back first, then new memory
    assert large.nbytes() == 4096
    assert memory.nbytes == 0
    memory.free(large, keep=True)
    memory.release()  # a pass ended: nothing waits any more
    assert memory.nbytes == 0
    memory.fill(small, 1024)
    assert small.nbytes() == 1024


def test_where_the_allocator_caches_by_itself_nothing_is_kept() -> None:
    memory = GatherMemory(torch.device("meta"))
    assert not memory.enabled
    storage = torch.UntypedStorage(64)
    memory.free(storage, keep=True)
    assert storage.nbytes() == 0
    assert memory.nbytes == 0
