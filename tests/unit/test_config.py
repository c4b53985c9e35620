"""ZeroStrategy options are checked at construction with errors that name the option, value and fix."""

from __future__ import annotations

import inspect
from dataclasses import fields
from datetime import timedelta

import pytest

from lightning_zero import ZeroStrategy
from lightning_zero.config import ZeroConfig
from lightning_zero.core.options import EngineOptions


def test_defaults_follow_the_contract() -> None:
    config = ZeroStrategy().config
    assert config.engine.stage == 2
    assert config.engine.offload_optimizer is False
    assert config.engine.partition == "flat"
    assert config.engine.bucket_cap_mb == 25
    assert config.engine.overlap_comm is True
    assert config.state_dict_type == "sharded"
    assert config.timeout == timedelta(minutes=30)


INVALID = [
    ({"stage": 0}, r"stage=0 is not supported"),
    ({"stage": 4}, r"stage=4 is not supported; choose one of \[1, 2, 3\]"),
    ({"stage": True}, r"stage=True is not supported"),
    ({"offload_optimizer": "gpu"}, r"offload_optimizer='gpu' is not supported"),
    ({"offload_params": "cpu", "stage": 2}, r"offload_params='cpu' needs stage=3, got stage=2"),
    ({"offload_optimizer": "nvme"}, r"needs nvme_path"),
    ({"offload_params": "cpu", "stage": 3}, r"offload_params='cpu' needs offload_optimizer='cpu' or 'nvme'"),
    ({"partition": "rows"}, r"partition='rows' is not supported; choose one of \['flat', 'parameter'\]"),
    ({"state_dict_type": "local"}, r"state_dict_type='local' is not supported"),
    ({"bucket_cap_mb": 0}, r"bucket_cap_mb must be > 0, got 0"),
    ({"bucket_cap_mb": "25"}, r"bucket_cap_mb must be a number"),
    ({"bucket_cap_mb": float("nan")}, r"bucket_cap_mb must be > 0, got nan"),
    ({"bucket_cap_mb": float("-inf")}, r"bucket_cap_mb must be > 0, got -inf"),
    ({"bucket_cap_mb": float("inf")}, r"bucket_cap_mb must be at most \d+ \(2\*\*63 - 1 bytes.*got inf"),
    ({"bucket_cap_mb": 1e308}, r"bucket_cap_mb must be at most .*got 1e\+308"),  # finite, but its bytes are not
    ({"bucket_cap_mb": 2**2000}, r"bucket_cap_mb must be at most .*characters\)"),  # int: never a float
    ({"overlap_comm": "yes"}, r"overlap_comm must be True or False"),
    ({"shard_size": 0}, r"shard_size=0 is not supported; choose a positive int"),
    ({"quantize_weights": 1, "stage": 3}, r"quantize_weights must be True or False, got 1"),
    ({"quantize_weights": True, "stage": 2}, r"quantize_weights=True needs stage=3 .*got stage=2"),
    (
        {"quantize_weights": True, "stage": 3, "partition": "parameter"},
        r"quantize_weights=True is not supported "
        r"with partition='parameter'.*Use partition='flat'",
    ),
    ({"process_group_backend": "mpi"}, r"process_group_backend='mpi' is not supported"),
    ({"start_method": "forkserver"}, r"start_method='forkserver' is not supported"),
    ({"timeout": 30}, r"timeout must be a datetime.timedelta"),
    ({"wrap_policy": 5}, r"wrap_policy=5 is not supported: pass a set of nn.Module classes"),
    ({"activation_checkpointing": ["no_such_module.Block"]}, r"activation_checkpointing: cannot import"),
    ({"wrap_policy": ["torch.nn.no_such_class"]}, r"wrap_policy: cannot import the class 'torch.nn.no_such_"),
    ({"wrap_policy": [3]}, r"wrap_policy must hold nn.Module classes, got 3"),
]
ENGINE_FIELDS = {option.name for option in fields(EngineOptions)}


@pytest.mark.parametrize(("kwargs", "match"), INVALID)
def test_invalid_options_raise_value_error(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ZeroStrategy(**kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [case for case in INVALID if set(case[0]) <= ENGINE_FIELDS])
def test_the_core_refuses_its_options_with_the_strategys_errors(kwargs: dict, match: str) -> None:
    # One check per engine option: a caller of the core reads what a ZeroStrategy user reads.
    with pytest.raises(ValueError, match=match) as from_strategy:
        ZeroStrategy(**kwargs)
    with pytest.raises(ValueError, match=match) as from_core:
        EngineOptions(**kwargs)
    assert str(from_core.value) == str(from_strategy.value)


def test_zero_config_declares_only_the_lightning_sides_options() -> None:
    declared = {option.name for option in fields(ZeroConfig)} - {"engine"}
    assert not declared & ENGINE_FIELDS, "an engine option is declared twice"
    # Between them the two records hold every ZeroStrategy option but the launcher's and Lightning's plug-ins.
    launching = {"start_method", "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io"}
    options = set(inspect.signature(ZeroStrategy).parameters) - launching - {"precision_plugin"}
    assert declared | ENGINE_FIELDS == options


def test_describe_names_every_option_ranks_agree_on() -> None:
    # The rank-agreement payload: every option by its ZeroStrategy keyword, nvme_path included.
    launching = {"start_method", "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io"}
    options = set(inspect.signature(ZeroStrategy).parameters) - launching - {"precision_plugin"}
    described = ZeroStrategy(stage=3, offload_optimizer="nvme", nvme_path="/tmp").config.describe()
    assert set(described) == options
    assert (described["stage"], described["nvme_path"], described["timeout"]) == (3, "/tmp", 1800.0)


def test_shard_size_is_an_engine_option_every_rank_agrees_on() -> None:
    strategy = ZeroStrategy(stage=2, shard_size=2)
    assert strategy.config.engine.shard_size == 2
    assert strategy.config.describe()["shard_size"] == 2


def test_quantize_weights_is_an_engine_option_every_rank_agrees_on() -> None:
    from lightning_zero import ZeroFabricStrategy

    assert ZeroStrategy().config.engine.quantize_weights is False
    for strategy_class in (ZeroStrategy, ZeroFabricStrategy):
        config = strategy_class(stage=3, quantize_weights=True).config
        assert config.engine.quantize_weights is True
        assert config.describe()["quantize_weights"] is True


def test_describe_is_comparable_across_ranks() -> None:
    assert ZeroConfig(EngineOptions(stage=1)).describe() == ZeroConfig(EngineOptions(stage=1)).describe()
    assert ZeroConfig(EngineOptions(stage=1)).describe() != ZeroConfig(EngineOptions(stage=2)).describe()
    assert ZeroConfig(timeout=timedelta(1)).describe() != ZeroConfig().describe()


def test_describe_names_policies_in_a_stable_order() -> None:
    # Sets iterate in a per-process order; the rank-agreement check must not see that as a difference.
    from torch import nn

    described = ZeroConfig(EngineOptions(wrap_policy={nn.Linear, nn.Embedding})).describe()["wrap_policy"]
    assert described == ["torch.nn.modules.linear.Linear", "torch.nn.modules.sparse.Embedding"]
    checkpointed = ZeroConfig(activation_checkpointing={nn.Linear, nn.Embedding}).describe()["activation_checkpointing"]
    assert checkpointed == described


def test_policies_accept_import_paths_as_yaml_gives_them() -> None:
    from torch import nn

    config = ZeroStrategy(
        stage=3, wrap_policy=["torch.nn.Linear"], activation_checkpointing="torch.nn.Embedding"
    ).config
    assert config.engine.wrap_policy == {nn.Linear}
    assert config.activation_checkpointing == {nn.Embedding}
    assert EngineOptions(wrap_policy=[nn.Linear, "torch.nn.Embedding"]).wrap_policy == {nn.Linear, nn.Embedding}
    policy = lambda module: False  # noqa: E731 - a callable passes through unchanged
    assert EngineOptions(wrap_policy=policy).wrap_policy is policy
    assert ZeroConfig(activation_checkpointing=policy).activation_checkpointing is policy


@pytest.mark.parametrize("cap_mb", [float("nan"), float("inf"), 1e308, 2**70])
def test_engine_options_refuse_bucket_caps_without_a_byte_count(cap_mb: float) -> None:
    # The core's own options are checked the same way (its users build them without ZeroConfig).
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        EngineOptions(bucket_cap_mb=cap_mb)


def test_the_largest_bucket_cap_has_a_byte_count() -> None:
    from lightning_zero.core.options import MAX_BUCKET_CAP_MB

    assert EngineOptions(bucket_cap_mb=MAX_BUCKET_CAP_MB).bucket_cap_bytes <= 2**63 - 1


def test_the_fabric_strategy_takes_the_trainer_strategy_options() -> None:
    """Both front doors take the same options, with the same defaults (Fabric's precision plugin is its own)."""
    from lightning_zero import ZeroFabricStrategy

    trainer = dict(inspect.signature(ZeroStrategy).parameters)
    fabric = dict(inspect.signature(ZeroFabricStrategy).parameters)
    trainer.pop("precision_plugin")
    fabric.pop("precision")
    assert list(trainer) == list(fabric)
    assert {k: p.default for k, p in trainer.items()} == {k: p.default for k, p in fabric.items()}
    described = ZeroFabricStrategy(stage=3, shard_size=2).config.describe()
    assert described == ZeroStrategy(stage=3, shard_size=2).config.describe()
