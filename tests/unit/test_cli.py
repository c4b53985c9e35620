"""`lightning-zero estimate` builds the model on the meta device and prints one row per stage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero import __version__
from lightning_zero.cli import main

REPO = Path(__file__).resolve().parents[2]
GPT = "examples.gpt:GPTLightningModule"
# examples.gpt.count_params of the default shape (n_layer=2, n_embd=64, vocab 256, block 64, biases).
DEFAULT_GPT_PARAMS = 120_576


def _rows(output: str) -> dict[str, list[str]]:
    """Table rows by stage label: '0 (DDP)', '1', '2', '3' -> the five byte columns."""
    rows = {}
    for line in output.splitlines():
        label, _, rest = line.partition("  ")
        if label.strip() in ("0 (DDP)", "1", "2", "3"):
            values = rest.split()
            rows[label.strip()] = [" ".join(values[i : i + 2]) for i in range(0, len(values), 2)]
    return rows


def test_estimate_prints_one_row_per_stage_in_megabytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", "--model", GPT, "--world-size", "2", "--precision", "32-true"]) == 0
    output = capsys.readouterr().out
    assert f"{GPT}: {DEFAULT_GPT_PARAMS:,} parameters ({DEFAULT_GPT_PARAMS:,} trainable)" in output
    assert "params  gradients  optimizer states  offloaded" in output
    # fp32 Adam, Ψ = 120,576, N = 2: 4Ψ = 0.48 MB, 8Ψ = 0.96 MB, totals 16Ψ, 12Ψ, 10Ψ, 8Ψ.
    assert _rows(output) == {
        "0 (DDP)": ["0.48 MB", "0.48 MB", "0.96 MB", "0.00 MB", "1.93 MB"],
        "1": ["0.48 MB", "0.48 MB", "0.48 MB", "0.00 MB", "1.45 MB"],
        "2": ["0.48 MB", "0.24 MB", "0.48 MB", "0.00 MB", "1.21 MB"],
        "3": ["0.24 MB", "0.24 MB", "0.48 MB", "0.00 MB", "0.96 MB"],
    }


def test_estimate_builds_a_large_model_in_configure_model_on_meta(capsys: pytest.CaptureFixture[str]) -> None:
    # 24 layers of width 2048: examples.gpt.count_params gives 1,209,257,984, built on meta in configure_model().
    init_args = json.dumps({"n_layer": 24, "n_embd": 2048, "n_head": 16})
    argv = ["estimate", "--model", GPT, "--init-args", init_args, "--world-size", "8", "--offload-optimizer", "cpu"]
    assert main(argv) == 0
    output = capsys.readouterr().out
    assert "1,209,257,984 parameters" in output
    # 16-mixed Adam: 2Ψ = 2.42 GB; 12Ψ/8 = 1.81 GB offloaded from stage 1; the DDP row has no offload.
    assert _rows(output) == {
        "0 (DDP)": ["2.42 GB", "2.42 GB", "14.51 GB", "0.00 MB", "19.35 GB"],
        "1": ["2.42 GB", "2.42 GB", "0.00 MB", "1.81 GB", "4.84 GB"],
        "2": ["2.42 GB", "302.31 MB", "0.00 MB", "1.81 GB", "2.72 GB"],
        "3": ["302.31 MB", "302.31 MB", "0.00 MB", "1.81 GB", "604.63 MB"],
    }
    assert "Offload applies where the stage allows it" in output


def test_offload_params_applies_to_stage_3_only(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--model", GPT, "--world-size", "2", "--precision", "32-true"]
    assert main([*argv, "--offload-params", "cpu", "--offload-optimizer", "cpu"]) == 0
    rows = _rows(capsys.readouterr().out)
    # Ψ = 120,576, N = 2: stage 2 offloads the optimizer's 12Ψ/N (masters' state and a gradient copy) and keeps the
    # 4Ψ parameters; stage 3 offloads the 4Ψ/N parameter shard too.
    assert rows["2"] == ["0.48 MB", "0.24 MB", "0.00 MB", "0.72 MB", "0.72 MB"]
    assert rows["3"] == ["0.00 MB", "0.24 MB", "0.00 MB", "0.96 MB", "0.24 MB"]


@pytest.mark.parametrize(
    ("extra", "config", "match"),
    [
        (["--world-size", "2", "--offload-params", "cpu"], None, "needs offload_optimizer: ZeroStrategy refuses"),
        (
            ["--world-size", "4", "--num-nodes", "2", "--secondary-shard-size", "4"],
            None,
            "--secondary-shard-size 4 does not fit nodes of 2 ranks",
        ),
        (["--world-size", "4", "--num-nodes", "2", "--shard-size", "3"], None, "--shard-size 3 does not"),
        ([], "shard_sise: 2", "ZeroStrategy has no option 'shard_sise'"),
        ([], "stage: 5", "ZeroStrategy refuses its options: stage=5 is not supported"),
        ([], "stage: 2\n      secondary_shard_size: 2", "secondary_shard_size=2 needs stage=3"),
    ],
)
def test_estimate_refuses_what_the_strategy_refuses(
    tmp_path: Path, extra: list[str], config: str | None, match: str
) -> None:
    """A table for a run ZeroStrategy would refuse would mislead: the command exits naming why."""
    argv = ["estimate", "--model", GPT, *extra]
    if config is not None:
        path = tmp_path / "c.yaml"
        path.write_text(
            "model: {}\ntrainer:\n  devices: 2\n  strategy:\n    class_path: lightning_zero.ZeroStrategy\n"
            f"    init_args:\n      {config}\n"
        )
        argv += ["--config", str(path)]
    with pytest.raises(SystemExit, match=match):
        main(argv)


def test_estimate_takes_the_config_values_lightning_cli_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``timeout`` as LightningCLI writes it (a string it makes a timedelta of) and a ``wrap_policy`` class from
    the working directory: ``fit`` accepts both, so the estimate does (it refused both: found in a user's trial)."""
    (tmp_path / "my_blocks.py").write_text("from torch import nn\n\n\nclass Block(nn.Linear):\n    pass\n")
    config = tmp_path / "c.yaml"
    config.write_text(
        "model: {}\ntrainer:\n  devices: 2\n  strategy:\n    class_path: lightning_zero.ZeroStrategy\n"
        "    init_args: {stage: 3, timeout: '0:05:00', wrap_policy: [my_blocks.Block]}\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in (str(tmp_path), "")])  # as a console script
    assert main(["estimate", "--model", GPT, "--config", str(config)]) == 0
    assert "wrap_policy=['my_blocks.Block']" in capsys.readouterr().out


def test_a_config_that_is_not_yaml_exits_with_a_message(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("model: [1, 2\n")
    with pytest.raises(SystemExit, match=r"is not valid YAML: while parsing a flow sequence"):
        main(["estimate", "--config", str(path), "--model", GPT])


def test_accumulation_adds_the_waiting_reduction_with_both_offloads_on_nvme(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # fp32, Ψ = 120,576, N = 2: offloaded at stage 3 is (4 + 4 + 12)Ψ/2 = 1.21 MB, accumulating + 4Ψ/2 = 1.45 MB.
    argv = ["estimate", "--model", GPT, "--world-size", "2", "--precision", "32-true"]
    argv += ["--offload-optimizer", "nvme", "--offload-params", "nvme"]
    assert main(argv) == 0
    output = capsys.readouterr().out
    assert "accumulate_grad_batches=1" in output
    assert _rows(output)["3"][3] == "1.21 MB"
    assert main([*argv, "--accumulate-grad-batches", "4"]) == 0
    assert _rows(capsys.readouterr().out)["3"][3] == "1.45 MB"
    config = tmp_path / "c.yaml"
    config.write_text("model: {}\ntrainer:\n  accumulate_grad_batches: 2\n")
    assert main([*argv, "--config", str(config)]) == 0  # the Trainer's flag, read from the config
    output = capsys.readouterr().out
    assert "accumulate_grad_batches=2" in output
    assert _rows(output)["3"][3] == "1.45 MB"


def test_estimate_reads_the_model_section_of_a_lightning_cli_config(capsys: pytest.CaptureFixture[str]) -> None:
    # examples/configs/zero1.yaml gives plain init args (the default shape); the class comes from --model.
    config = str(REPO / "examples" / "configs" / "zero1.yaml")
    assert main(["estimate", "--config", config, "--model", GPT, "--world-size", "2", "--precision", "32-true"]) == 0
    assert _rows(capsys.readouterr().out)["0 (DDP)"][-1] == "1.93 MB"


def test_estimate_takes_precision_and_world_size_from_the_configs_trainer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # zero1.yaml: precision 32-true, 2 devices on 1 node; the command line still wins.
    config = str(REPO / "examples" / "configs" / "zero1.yaml")
    assert main(["estimate", "--config", config, "--model", GPT]) == 0
    assert "world_size=2, precision=32-true" in capsys.readouterr().out
    assert main(["estimate", "--config", config, "--model", GPT, "--precision", "bf16-mixed", "--world-size", "8"]) == 0
    assert "world_size=8, precision=bf16-mixed" in capsys.readouterr().out
    no_devices = tmp_path / "c.yaml"
    no_devices.write_text("trainer:\n  devices: auto\n")
    with pytest.raises(SystemExit, match="pass --world-size N"):
        main(["estimate", "--config", str(no_devices), "--model", GPT])


def test_config_class_path_with_init_args_overridden_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "model:\n  class_path: examples.gpt.GPTLightningModule\n  init_args:\n    n_layer: 4\n    n_embd: 64\n"
    )
    argv = ["estimate", "--config", str(config), "--init-args", '{"n_layer": 2}', "--world-size", "2"]
    assert main(argv) == 0
    output = capsys.readouterr().out
    assert f"examples.gpt.GPTLightningModule: {DEFAULT_GPT_PARAMS:,} parameters" in output


@pytest.mark.parametrize(
    ("model", "match"),
    [
        (
            "no_such_package.models:Net",
            r"cannot import 'no_such_package.models:Net': No module named 'no_such_package'",
        ),
        ("examples.gpt:NoSuchClass", r"cannot import 'examples.gpt:NoSuchClass': module 'examples.gpt' has no"),
        ("GPTLightningModule", r"--model 'GPTLightningModule' is not of the form package.module:Class"),
        ("examples.gpt:ByteDataModule", r"examples.gpt:ByteDataModule built a ByteDataModule, not a torch.nn.Module"),
    ],
)
def test_a_model_that_cannot_be_built_exits_with_a_message_naming_it(model: str, match: str) -> None:
    with pytest.raises(SystemExit, match=match):
        main(["estimate", "--model", model, "--world-size", "2"])


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--model", GPT, "--init-args", "{n_layer: 2}"], r"--init-args '\{n_layer: 2\}' is not valid JSON"),
        (["--model", GPT, "--init-args", "[2]"], r"--init-args must be a JSON object, got '\[2\]'"),
        (["--model", GPT, "--init-args", '{"depth": 2}'], r"cannot build examples.gpt:GPTLightningModule with"),
        ([], r"no model class given. Pass --model package.module:Class"),
        (["--config", "missing.yaml"], r"cannot read --config 'missing.yaml'"),
    ],
)
def test_bad_arguments_exit_with_a_message(extra: list[str], match: str) -> None:
    with pytest.raises(SystemExit, match=match):
        main(["estimate", "--world-size", "2", *extra])


def test_config_without_a_model_section_exits(tmp_path: Path) -> None:
    config = tmp_path / "trainer_only.yaml"
    config.write_text("trainer:\n  devices: 2\n")
    with pytest.raises(SystemExit, match=r"has no 'model:' section"):
        main(["estimate", "--config", str(config), "--world-size", "2"])


def test_shard_size_prints_the_table_of_a_world_of_that_size(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["estimate", "--model", GPT, "--precision", "32-true", "--partition", "parameter"]
    assert main([*base, "--world-size", "2"]) == 0
    two = capsys.readouterr().out
    assert main([*base, "--world-size", "6", "--shard-size", "2"]) == 0
    hybrid = capsys.readouterr().out
    assert _rows(hybrid) == _rows(two)
    assert _rows(hybrid)["3"] != _rows(hybrid)["0 (DDP)"]  # stage 3 is sharded at all
    assert "world_size=6," in hybrid
    assert "shard_size=2" in hybrid
    assert "shard_size=None" in two
    assert "Hybrid sharding: stages 1-3 shard over groups of 2 ranks, replicated 3 times" in hybrid
    owners = [line for line in hybrid.splitlines() if line.startswith("partition=parameter:")]
    assert owners == [line for line in two.splitlines() if line.startswith("partition=parameter:")]
    assert len(owners) == 1


def test_shard_size_that_does_not_divide_the_world_size_exits_before_building(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The model does not exist: the shard size is checked first, the message names both flags.
    with pytest.raises(SystemExit, match=r"--shard-size 3 does not divide --world-size 4: pick a divisor of 4"):
        main(["estimate", "--model", "no_such_package.models:Net", "--world-size", "4", "--shard-size", "3"])


@pytest.mark.parametrize("shard_size", ["0", "two"])
def test_shard_size_must_be_a_positive_int(shard_size: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--model", GPT, "--world-size", "4", "--shard-size", shard_size])
    assert exit_info.value.code == 2
    assert f"--shard-size: must be a positive int, got '{shard_size}'" in capsys.readouterr().err


@pytest.mark.parametrize("world_size", ["0", "two"])
def test_world_size_must_be_a_positive_int(world_size: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--model", GPT, "--world-size", world_size])
    assert exit_info.value.code == 2
    assert f"--world-size: must be a positive int, got '{world_size}'" in capsys.readouterr().err


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"lightning-zero {__version__}"
    assert main([]) == 0
    assert "estimate" in capsys.readouterr().out


def test_consolidate_progress_line_every_ten_percent(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_zero.cli import _ProgressLine

    progress = _ProgressLine()
    for written in range(0, 1_000_000_001, 50_000_000):
        progress(written, 1_000_000_000)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "consolidate: 10% (0.1 of 1.0 GB)"
    assert lines[-1] == "consolidate: 100% (1.0 of 1.0 GB)"
    assert len(lines) == 10
    small = _ProgressLine()
    small(5, 10)  # under 100 MB: silent
    assert capsys.readouterr().err == ""


def test_quantize_gradients_adds_the_residuals_across_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    # fp32, Ψ = 120,576, N = 4 ranks on 2 nodes: error feedback keeps 4Ψ (M - 1) / N = 0.12 MB of gradients more at
    # stages 1-3 (stage 0, DDP, has no quantized reduction).
    base = ["estimate", "--model", GPT, "--precision", "32-true", "--world-size", "4", "--num-nodes", "2"]
    assert main(base) == 0
    plain = _rows(capsys.readouterr().out)
    assert main([*base, "--quantize-gradients"]) == 0
    output = capsys.readouterr().out
    quantized = _rows(output)
    assert "quantize_gradients=True, num_nodes=2" in output
    assert "error feedback's fp32 residuals" in output
    assert quantized["0 (DDP)"] == plain["0 (DDP)"]
    assert [quantized[s][1] for s in "123"] == ["0.60 MB", "0.24 MB", "0.24 MB"]
    assert [plain[s][1] for s in "123"] == ["0.48 MB", "0.12 MB", "0.12 MB"]
    with pytest.raises(SystemExit, match=r"--num-nodes 3 does not divide --world-size 4"):
        main(["estimate", "--model", GPT, "--world-size", "4", "--num-nodes", "3", "--quantize-gradients"])


def _header(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("world_size="))


@pytest.mark.parametrize(
    ("strategy", "flags"),
    [
        (
            "\n    class_path: lightning_zero.ZeroStrategy\n    init_args:\n      stage: 3\n      shard_size: 2\n"
            "      offload_optimizer: true\n      secondary_shard_size: 2\n      quantize_gradients: true\n"
            "      weighted_loss: true\n      wrap_policy: [examples.gpt.Block, torch.nn.Embedding]",
            [
                *("--shard-size", "2", "--offload-optimizer", "cpu", "--secondary-shard-size", "2"),
                *("--quantize-gradients", "--wrap-policy", "examples.gpt.Block", "torch.nn.Embedding"),
            ],
        ),
        (" zero_3_offload", ["--offload-optimizer", "cpu", "--offload-params", "cpu"]),
        (
            "\n    class_path: lightning_zero.strategy.ZeroStrategy\n    init_args:\n      stage: 3\n"
            "      partition: parameter",
            ["--partition", "parameter"],
        ),
    ],
    ids=["class_path", "registry", "module_path"],
)
def test_estimate_takes_the_zero_strategy_options_of_the_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], strategy: str, flags: list[str]
) -> None:
    """A config's ZeroStrategy options count as the same flags would; its trainer.num_nodes too."""
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{}}\ntrainer:\n  devices: 2\n  num_nodes: 2\n  strategy:{strategy}\n")
    assert main(["estimate", "--config", str(config), "--model", GPT]) == 0
    from_config = capsys.readouterr().out
    assert "From --config's strategy: stage=3" in from_config
    assert (
        main(["estimate", "--model", GPT, "--world-size", "4", "--num-nodes", "2", "--precision", "32-true", *flags])
        == 0
    )
    from_flags = capsys.readouterr().out
    assert _header(from_config) == _header(from_flags)
    assert _rows(from_config) == _rows(from_flags)


def test_the_command_line_wins_over_the_configs_strategy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "model: {}\ntrainer:\n  devices: 4\n  strategy:\n    class_path: lightning_zero.ZeroStrategy\n"
        "    init_args:\n      shard_size: 2\n      offload_optimizer: nvme\n"
    )
    assert main(["estimate", "--config", str(config), "--model", GPT, "--shard-size", "4"]) == 0
    header = _header(capsys.readouterr().out)
    assert "shard_size=4" in header
    assert "offload_optimizer=nvme" in header


def test_another_strategy_in_the_config_sets_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("model: {}\ntrainer:\n  devices: 2\n  strategy: ddp\n")
    assert main(["estimate", "--config", str(config), "--model", GPT]) == 0
    output = capsys.readouterr().out
    assert "From --config" not in output
    assert "offload_optimizer=False, offload_params=False, partition=flat" in _header(output)


@pytest.mark.parametrize(
    ("trainer", "precision"),
    [
        ("", "32-true"),  # Lightning's default
        ("\n  precision: bf16", "bf16-mixed"),
        ("\n  precision: 16", "16-mixed"),
        (
            "\n  precision: null\n  plugins:\n    - class_path: lightning_zero.ZeroPrecision\n"
            "      init_args:\n        precision: 16-mixed",
            "16-mixed",
        ),
    ],
    ids=["none", "bf16", "16", "plugin"],
)
def test_the_configs_precision_is_what_its_trainer_trains_in(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], trainer: str, precision: str
) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{}}\ntrainer:\n  devices: 2{trainer}\n")
    assert main(["estimate", "--config", str(config), "--model", GPT]) == 0
    assert f"precision={precision}," in _header(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("trainer", "match"),
    [
        ("\n  precision: 64-true", r"--config's precision '64-true' is not one the estimate knows .*pass --precision"),
        (
            "\n  strategy:\n    class_path: lightning_zero.ZeroStrategy\n    init_args:\n      partition: rows",
            "partition",
        ),
    ],
    ids=["precision", "partition"],
)
def test_a_config_value_the_estimate_cannot_take_exits_naming_it(tmp_path: Path, trainer: str, match: str) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{}}\ntrainer:\n  devices: 2{trainer}\n")
    with pytest.raises(SystemExit, match=match):
        main(["estimate", "--config", str(config), "--model", GPT])


@pytest.mark.parametrize("module", ["lightning_zero", "lightning_zero.cli"])
def test_python_dash_m_runs_the_command_line(module: str) -> None:
    """``python -m lightning_zero.cli --help`` printed nothing and exited 0 (a consolidation scripted that way did
    nothing, silently; found in a user's trial); ``python -m lightning_zero`` had no ``__main__``."""
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "consolidate" in done.stdout
