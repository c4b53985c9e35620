"""A stage-3 ``wrap_policy`` (or ``activation_checkpointing``) that chooses no module of the model warns, naming the
policy, the model's module classes and, for the ``__main__`` trap, the class of the same name from another module."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_zero.core.stage3.activation_checkpointing import apply_activation_checkpointing
from lightning_zero.core.stage3.units import select_units
from tests.distributed.models import Block, TinyLM

# What `class Block` in a script run as `python train.py` is: the same name, another module, another class.
MainBlock = type("Block", (nn.Module,), {"__module__": "__main__", "__qualname__": "Block"})


def _model() -> nn.Module:
    return TinyLM(nested=True)  # holds a tests.distributed.models.Block


def _warnings_of(fn) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_a_policy_class_of_another_module_warns_and_names_both_classes() -> None:
    units, messages = _warnings_of(lambda: select_units(_model(), {MainBlock}))
    assert units == []
    assert len(messages) == 1, messages
    message = messages[0]
    assert message.startswith("wrap_policy={__main__.Block} matches no module of the model"), message
    assert "stage 3 gathers the whole model as one unit" in message
    for present in ("tests.distributed.models.TinyLM", "nn.Embedding", "nn.Linear", "tests.distributed.models.Block"):
        assert present in message, message
    assert "The model's tests.distributed.models.Block has the name of __main__.Block but is another class" in message


def test_a_callable_policy_that_matches_nothing_warns_naming_it() -> None:
    def nothing(module: nn.Module) -> bool:
        return False

    _, messages = _warnings_of(lambda: select_units(_model(), nothing))
    assert len(messages) == 1, messages
    assert "wrap_policy=test_a_callable_policy_that_matches_nothing_warns_naming_it.<locals>.nothing" in messages[0]
    assert "has the name of" not in messages[0]


def test_a_long_list_of_module_classes_is_shortened() -> None:
    classes = [type(f"Layer{i}", (nn.Linear,), {}) for i in range(20)]
    model = nn.Sequential(*(cls(2, 2) for cls in classes))
    _, messages = _warnings_of(lambda: select_units(model, {nn.Embedding}))
    assert "and 9 more." in messages[0], messages[0]  # Sequential and 11 layers named, 9 counted
    assert "Layer19" not in messages[0]


@pytest.mark.parametrize(
    "policy", [None, {Block}, {nn.Linear, MainBlock}, {TinyLM}], ids=["default", "block", "one_of_two", "the_root"]
)
def test_a_policy_that_matches_does_not_warn(policy: object) -> None:
    # The root is always a unit, so a policy that names only the root class does what it says.
    units, messages = _warnings_of(lambda: select_units(_model(), policy))
    assert messages == []
    assert all(isinstance(unit, nn.Module) for unit in units)


def test_activation_checkpointing_that_matches_nothing_warns() -> None:
    torch.manual_seed(0)
    chosen, messages = _warnings_of(lambda: apply_activation_checkpointing(_model(), {MainBlock}))
    assert chosen == []
    assert len(messages) == 1, messages
    assert messages[0].startswith("activation_checkpointing={__main__.Block} matches no module"), messages[0]
    assert "no activations are recomputed" in messages[0]
