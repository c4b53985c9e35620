"""16-bit compute parameters and the normalisation layers CPU autocast leaves alone.

[Note: fp32 inputs of 16-bit norm layers]
With a 16-bit ``param_dtype`` a ``LayerNorm`` or ``GroupNorm`` computes with 16-bit weights. On CUDA autocast runs
``layer_norm`` and ``group_norm`` in fp32 whatever their arguments; on the CPU it does not touch them, and their CPU
kernels refuse an fp32 input next to 16-bit weights ("mixed dtype (CPU): expect parameter to have scalar type of
Float"). Such an input is common: an fp32 positional buffer added to the embeddings, a frozen embedding (which stays
fp32), fp32 features. DDP never meets it (its weights stay fp32). So on the CPU an fp32 input of such a layer is cast
to the weights' dtype first, as FSDP's mixed precision casts the inputs of a unit's forward; everything else (a
16-bit input, any CUDA input) passes untouched. Batch norm keeps fp32 weights instead (see ``norm_params``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def cast_fp32_norm_inputs(module: nn.Module, param_dtype: torch.dtype | None) -> list[RemovableHandle]:
    """With a 16-bit ``param_dtype``, hook every affine ``LayerNorm`` / ``GroupNorm`` of ``module`` to cast an fp32
    CPU input to ``param_dtype`` (see the note above); the handles remove the hooks."""
    if param_dtype not in _SIXTEEN_BIT:
        return []
    return [
        m.register_forward_pre_hook(lambda layer, args: _cast_first(args, param_dtype))
        for m in module.modules()
        if isinstance(m, nn.LayerNorm | nn.GroupNorm) and m._parameters.get("weight") is not None
    ]


def _cast_first(args: tuple[Any, ...], dtype: torch.dtype) -> tuple[Any, ...] | None:
    if args and isinstance(args[0], Tensor) and args[0].device.type == "cpu" and args[0].dtype == torch.float32:
        return (args[0].to(dtype), *args[1:])
    return None
