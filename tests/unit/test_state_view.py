"""LazyTensor and the save-side state_dict of checkpoint hooks (see [Note: the state_dict of sharded checkpoint
hooks]); the Lightning-level behaviour is tests/lightning/test_checkpoint_hooks.py."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from lightning_zero.checkpoint.state_view import LazyTensor, saving_changes, saving_state_dict, values_of

SAVED = torch.arange(6.0).view(2, 3)


def _lazy(reads: list[int]) -> LazyTensor:
    def read() -> torch.Tensor:
        reads.append(1)
        return SAVED.clone()

    return LazyTensor("layer.weight", [2, 3], torch.float32, read, origin="checkpoint")


def test_shape_dtype_and_repr_need_no_values() -> None:
    reads: list[int] = []
    lazy = _lazy(reads)
    assert (lazy.shape, lazy.dtype, lazy.device, lazy.dim(), lazy.numel(), len(lazy)) == (
        torch.Size([2, 3]),
        torch.float32,
        torch.device("cpu"),
        2,
        6,
        2,
    )
    assert "layer.weight" in repr(lazy)
    assert isinstance(lazy, torch.Tensor)
    assert not reads
    assert not lazy.was_read


def test_the_first_use_reads_once_and_in_place_changes_stay() -> None:
    reads: list[int] = []
    lazy = _lazy(reads)
    doubled = lazy * 2
    assert type(doubled) is torch.Tensor
    assert torch.equal(doubled, SAVED * 2)
    lazy.add_(1)
    assert torch.equal(lazy.value(), SAVED + 1)
    assert torch.equal(lazy, SAVED + 1)
    assert len(reads) == 1


def test_copies_and_saves_hold_the_values() -> None:
    lazy = _lazy([])
    copied = copy.deepcopy({"w": lazy})["w"]
    buffer = io.BytesIO()
    torch.save({"w": lazy}, buffer)
    buffer.seek(0)
    for plain in (copied, torch.load(buffer)["w"], values_of({"w": lazy})["w"]):
        assert type(plain) is torch.Tensor
        assert torch.equal(plain, SAVED)
    module = torch.nn.Linear(3, 2)
    module.load_state_dict({"weight": _lazy([]), "bias": torch.zeros(2)})
    assert torch.equal(module.weight.detach(), SAVED)


def test_a_save_s_values_cannot_be_read_and_changes_are_named() -> None:
    keys = [["embed.weight", "embed.weight"], ["head.weight", "embed.weight"], ["up.bias", "up.bias"]]
    specs = {"embed.weight": {"shape": [4, 2], "dtype": "float32"}, "up.bias": {"shape": [3], "dtype": "bfloat16"}}
    state_dict = saving_state_dict(keys, specs)
    assert state_dict["head.weight"] is state_dict["embed.weight"]
    assert (state_dict["up.bias"].shape, state_dict["up.bias"].dtype) == (torch.Size([3]), torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"\['up.bias'\] has no values in a sharded save.*gathered_params"):
        state_dict["up.bias"].sum()
    assert saving_changes(state_dict, keys) is None
    assert saving_changes(dict(state_dict), keys) is None  # a copy with the same values changes nothing
    renamed = {key.replace("up.", "expand."): value for key, value in state_dict.items()}
    assert saving_changes(renamed, keys) == "removed 'up.bias'; added 'expand.bias'"
    assert saving_changes({**state_dict, "up.bias": torch.zeros(3)}, keys) == "replaced 'up.bias'"
    assert saving_changes(None, keys) == "it is a NoneType, not the state_dict"
