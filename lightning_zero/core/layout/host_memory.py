"""Host tensors of exactly the size asked for, page-locked on CUDA (offloaded shards and masters live in them)."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

HOST = torch.device("cpu")


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> Tensor:
    """An uninitialised host tensor of exactly ``numel`` elements; page-locked when ``pin`` (on CUDA).

    ``torch.empty(..., pin_memory=True)`` goes through the caching host allocator, which rounds a request up to a
    power of two (a 20 GiB master would take 32 GiB); registering an ordinary allocation pins exactly its bytes.
    Where pinning fails (no CUDA, a locked-memory limit) the tensor stays pageable, with one warning.
    """
    tensor = torch.empty(numel, dtype=dtype, device=HOST)
    if pin and tensor.numel() > 0:
        try:
            code = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
            if int(code) != 0:
                raise RuntimeError(f"cudaHostRegister returned {code}")
            _REGISTERED[tensor.data_ptr()] = tensor.untyped_storage()
        except Exception as error:
            _warn_once(
                f"offload: could not pin {tensor.numel() * tensor.element_size()} bytes of host memory "
                f"({error}); using pageable memory, so host-device copies do not overlap with compute."
            )
    return tensor


def host_release(tensor: Tensor) -> None:
    """Unpin a tensor made by :func:`host_empty` (a no-op for pageable ones)."""
    if _REGISTERED.pop(tensor.data_ptr(), None) is not None:
        torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


_REGISTERED: dict[int, object] = {}
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)
