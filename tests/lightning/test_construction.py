"""How users select ZeroStrategy: registry strings, LightningCLI YAML, and the Trainer's precision flag.

Single process: building a Trainer needs no process group; nothing here calls fit.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins import DoublePrecision, MixedPrecision

import lightning_zero
from lightning_zero import ZeroStrategy
from tests.lightning.models import TwoLayer

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


def _trainer(**kwargs: object) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=2, logger=False, enable_checkpointing=False, **kwargs)


@pytest.mark.parametrize(("name", "stage"), [("zero_1", 1), ("zero_2", 2)])
def test_registry_string_selects_zero_strategy(name: str, stage: int) -> None:
    trainer = _trainer(strategy=name)
    assert type(trainer.strategy) is ZeroStrategy
    assert trainer.strategy.config.engine.stage == stage
    assert trainer.strategy.num_processes == 2
    assert isinstance(trainer.strategy.precision_plugin, lightning_zero.ZeroPrecision)


def _cli(tmp_path: Path, strategy_yaml: str) -> LightningCLI:
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  accelerator: cpu\n"
        "  devices: 2\n"
        "  logger: false\n"
        "  enable_checkpointing: false\n"
        f"  strategy:{strategy_yaml}\n"
        "model:\n"
        "  hidden: 9\n"
    )
    return LightningCLI(TwoLayer, run=False, args=["--config", str(config)], save_config_callback=None)


def test_lightning_cli_yaml_class_path_builds_zero_strategy(tmp_path: Path) -> None:
    cli = _cli(
        tmp_path,
        "\n    class_path: lightning_zero.ZeroStrategy"
        "\n    init_args:"
        "\n      stage: 1"
        "\n      bucket_cap_mb: 3"
        "\n      state_dict_type: full",
    )
    strategy = cli.trainer.strategy
    assert type(strategy) is ZeroStrategy
    assert strategy.config.engine.stage == 1
    assert strategy.config.engine.bucket_cap_mb == 3
    assert strategy.config.state_dict_type == "full"
    assert cli.model.a.out_features == 9


def test_lightning_cli_yaml_registry_string(tmp_path: Path) -> None:
    cli = _cli(tmp_path, " zero_2")
    assert type(cli.trainer.strategy) is ZeroStrategy
    assert cli.trainer.strategy.config.engine.stage == 2


def test_lightning_cli_yaml_quantize_weights(tmp_path: Path) -> None:
    yaml = "\n    class_path: lightning_zero.ZeroStrategy\n    init_args: {stage: 3, quantize_weights: true}"
    assert _cli(tmp_path, yaml).trainer.strategy.config.engine.quantize_weights is True


def test_lightning_cli_yaml_free_gradients_after_step(tmp_path: Path) -> None:
    yaml = "\n    class_path: lightning_zero.ZeroStrategy\n    init_args: {stage: 3, free_gradients_after_step: true}"
    assert _cli(tmp_path, yaml).trainer.strategy.config.engine.free_gradients_after_step is True


def test_lightning_cli_rejects_an_invalid_option(tmp_path: Path) -> None:
    """An invalid ``init_args`` value ends the CLI with ZeroStrategy's own error, not a silent default."""
    with pytest.raises(ValueError, match=r"stage=7 is not supported"):
        _cli(tmp_path, "\n    class_path: lightning_zero.ZeroStrategy\n    init_args:\n      stage: 7")


# ZeroStrategy reaches the Trainer either as an instance (Python, LightningCLI class_path) or as a registry
# string; the Trainer's precision flag and precision plugins must mean the same in both forms.
FORMS = {"instance": lambda: ZeroStrategy(), "registry_string": lambda: "zero_2"}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("precision", ["64-true", "16-true"])
def test_unsupported_precision_flag_raises_value_error_listing_supported(precision: str, form: str) -> None:
    with pytest.raises(ValueError, match="precision") as info:
        _trainer(strategy=FORMS[form](), precision=precision)
    _assert_lists_supported(str(info.value))


@pytest.mark.parametrize("form", FORMS)
def test_unsupported_precision_plugin_raises_value_error_listing_supported(form: str) -> None:
    with pytest.raises(ValueError, match="precision") as info:
        _trainer(strategy=FORMS[form](), plugins=[DoublePrecision()])
    _assert_lists_supported(str(info.value))


def _assert_lists_supported(message: str) -> None:
    for supported in SUPPORTED_PRECISIONS:
        assert supported in message, f"{supported!r} missing from: {message}"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    ("how", "expected"),
    [
        ({"precision": "32-true"}, "32-true"),
        ({"precision": "bf16-mixed"}, "bf16-mixed"),
        ({"precision": "bf16-true"}, "bf16-true"),
        # On CPU Lightning turns the string "16-mixed" into bf16 for strategies it does not know; fp16 comes as
        # a MixedPrecision plugin (CONTRACT.md), whose GradScaler settings are kept.
        ({"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=8.0))]}, "16-mixed"),
        ({"plugins": [MixedPrecision("bf16-mixed", "cpu")]}, "bf16-mixed"),
        ({"plugins": [lightning_zero.ZeroPrecision("16-mixed", growth_interval=7)]}, "16-mixed"),
    ],
    ids=["32-true", "bf16-mixed", "bf16-true", "16-mixed-plugin", "bf16-mixed-plugin", "zero-plugin"],
)
def test_supported_precisions_select_zero_precision(form: str, how: dict[str, object], expected: str) -> None:
    trainer = _trainer(strategy=FORMS[form](), **how)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, lightning_zero.ZeroPrecision)
    assert plugin.precision == expected
    assert trainer.precision_plugin is plugin
    if expected == "16-mixed":
        assert plugin.scaler is not None
        if "precision" not in how and isinstance(how["plugins"][0], MixedPrecision):  # type: ignore[index]
            assert plugin.scaler.scale == 8.0
    else:
        assert plugin.scaler is None


def test_precision_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"reduce_dtype='float16' does not fit precision='bf16-mixed'"):
        lightning_zero.ZeroPrecision("bf16-mixed", reduce_dtype="float16")
    with pytest.raises(ValueError, match="backoff_factor=2"):
        lightning_zero.ZeroPrecision("16-mixed", backoff_factor=2)
    with pytest.raises(ValueError, match="growth_interval=True"):
        lightning_zero.ZeroPrecision("16-mixed", growth_interval=True)
    # A torch.dtype is taken as FSDP's MixedPrecisionPolicy takes it.
    assert lightning_zero.ZeroPrecision("bf16-mixed", reduce_dtype=torch.bfloat16).reduce_dtype == torch.bfloat16


@pytest.mark.parametrize(("name", "stage", "params"), [("zero_2_offload", 2, False), ("zero_3_offload", 3, "cpu")])
def test_offload_registry_strings_select_the_optimizer_on_the_cpu(name: str, stage: int, params: object) -> None:
    config = _trainer(strategy=name).strategy.config.engine
    assert (config.stage, config.offload_optimizer, config.offload_params) == (stage, "cpu", params)


@pytest.mark.parametrize("form", FORMS)
def test_32_true_is_accepted(form: str) -> None:
    trainer = _trainer(strategy=FORMS[form](), precision="32-true")
    assert isinstance(trainer.strategy.precision_plugin, lightning_zero.ZeroPrecision)
    assert trainer.strategy.precision_plugin.precision == "32-true"
