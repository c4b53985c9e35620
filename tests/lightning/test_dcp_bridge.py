"""The DCP bridge (docs/checkpoints.md): ZeroStrategy -> convert -> FSDP2 / a plain model / ZeroStrategy again /
Lightning's ModelParallelStrategy, and FSDP2 or ModelParallelStrategy -> ZeroStrategy at stages 1-3. One spawn of 2
gloo ranks runs every case (tests/lightning/dcp_cases.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_zero import convert
from lightning_zero.checkpoint import CheckpointError
from lightning_zero.cli import main
from tests.helpers import run_on_ranks
from tests.lightning.dcp_cases import run_all
from tests.lightning.models import max_rel_diff

TOLERANCE = 1e-5  # fp32 on both sides


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    directory = tmp_path_factory.mktemp("dcp")
    return run_on_ranks(run_all, 2, str(directory)), directory


def _case(ranks: tuple[list[dict[str, Any]], Path], name: str, rank: int = 0) -> Any:
    result = ranks[0][rank][name]
    if isinstance(result, dict) and "error" in result:
        pytest.fail(result["error"], pytrace=False)
    return result


def _close(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    diffs = max_rel_diff(expected, actual)
    assert max(diffs.values()) <= TOLERANCE, diffs


def test_every_case_finished_on_every_rank(ranks: Any) -> None:
    """A case that raised on a rank whose results no other test reads is still a failure."""
    for rank, results in enumerate(ranks[0]):
        for name in results:
            _case(ranks, name, rank)


def test_zero_stage3_to_fsdp2_and_plain_model(ranks: Any) -> None:
    """The converted directory loads with get_state_dict / dcp.load / set_state_dict into FSDP2 on 2 ranks (model and
    AdamW state) and with dcp.load into a plain model: equal to the sharded checkpoint's tensors."""
    result = _case(ranks, "zero_to_dcp")
    _close(result["expected"], result["fsdp"])
    _close(result["expected"], result["plain"])
    assert result["fsdp_optim"].keys() == result["expected_optim"].keys()
    for name, state in result["expected_optim"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            loaded = torch.as_tensor(result["fsdp_optim"][name][key])
            assert torch.equal(loaded, torch.as_tensor(state[key])), (name, key)
    assert result["fsdp_lr"] == [1e-2]


def test_converted_directory_resumes_with_loop_state(ranks: Any) -> None:
    """ZeroStrategy stage 3 saved after 2 of 4 steps, converted, resumed at stage 1 from the DCP directory: meta.pt
    carries the loops, and the run ends as the uninterrupted one."""
    expected = _case(ranks, "zero_to_dcp")["uninterrupted"]
    for rank in range(2):
        resumed = _case(ranks, "dcp_resume", rank)
        assert resumed["global_step"] == 4
        _close(expected, resumed["state"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fsdp2_to_zero_continues_as_fsdp2(ranks: Any, stage: int) -> None:
    """FSDP2's dcp.save(get_state_dict(...)) (stage 2: Lightning's key layout, else torch's) resumed by ZeroStrategy:
    its next 2 steps equal FSDP2's own."""
    result = _case(ranks, "fsdp_to_zero")
    _close(result["reference"], result["resumed"][stage])


@pytest.mark.parametrize(
    ("label", "resumer"),
    [("one_group", "model_parallel"), ("one_group", 1), ("one_group", 2), ("one_group", 3), ("groups", 3)],
)
def test_model_parallel_strategy_to_zero(ranks: Any, label: str, resumer: str | int) -> None:
    """Lightning's ModelParallelStrategy (FSDP2) saves with trainer.save_checkpoint after 2 of 4 steps; ZeroStrategy at
    each stage resumes from the directory at step 2 (loop state from meta.pt) and ends as ModelParallelStrategy
    uninterrupted, and as ModelParallelStrategy resuming itself; "groups": two param groups and a LambdaLR."""
    result = _case(ranks, "mps_to_zero")[label]
    for rank in range(2):
        resumed = _case(ranks, "mps_to_zero", rank)[label]["resumed"][resumer]
        assert (resumed["start_step"], resumed["global_step"]) == (2, 4), rank
        _close(result["uninterrupted"], resumed["state"])


@pytest.mark.parametrize("label", ["one_group", "groups"])
def test_zero_to_model_parallel_strategy(ranks: Any, label: str) -> None:
    """ZeroStrategy stage 3 saved after 2 of 4 steps, converted to DCP, resumed by ModelParallelStrategy with
    fit(ckpt_path=...): it starts at step 2 and ends as ZeroStrategy uninterrupted, on every rank ("groups": two param
    groups and a LambdaLR)."""
    zero = _case(ranks, "zero_to_mps")
    expected = _case(ranks, "zero_to_dcp")["uninterrupted"] if label == "one_group" else zero["groups_uninterrupted"]
    for rank in range(2):
        resumed = _case(ranks, "zero_to_mps", rank)[label]
        assert (resumed["start_step"], resumed["global_step"]) == (2, 4), rank
        _close(expected, resumed["state"])


def test_tied_weights_resume_from_converted_directory(ranks: Any) -> None:
    """DCP holds a tied tensor under both keys: checked equal, loaded once."""
    result = _case(ranks, "tied")
    _close(result["uninterrupted"], result["resumed"])


def test_mismatched_keys_name_missing_and_unexpected_on_every_rank(ranks: Any) -> None:
    for rank in range(2):
        message = _case(ranks, "mismatch", rank)
        assert "is of a different model" in message
        assert "Missing keys (in this model, not in the checkpoint): ['embed.weight', 'up.weight'" in message
        assert "unexpected keys (in the checkpoint, not in this model): ['a.weight', 'a.bias', 'b.weight'" in message


def test_convert_refuses_bad_outputs(ranks: Any) -> None:
    sharded = ranks[1] / "zero3.ckpt"
    with pytest.raises(ValueError, match=r"choose one of \['dcp'\]"):
        convert(sharded, ranks[1] / "x", to="safetensors")
    with pytest.raises(CheckpointError, match="exists and is not an empty directory"):
        convert(sharded, ranks[1] / "zero3-dcp", to="dcp")
    with pytest.raises(ValueError, match="is inside the sharded checkpoint"):
        convert(sharded, sharded / "dcp", to="dcp")
    assert not (sharded / "dcp").exists()


def test_cli_convert(ranks: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out = ranks[1] / "cli-dcp"
    assert main(["convert", str(ranks[1] / "zero3.ckpt"), str(out), "--to", "dcp"]) == 0
    assert (out / ".metadata").is_file()
    assert (out / "meta.pt").is_file()
    assert "wrote" in capsys.readouterr().out
    assert main(["convert", str(ranks[1] / "zero3.ckpt"), str(out), "--to", "dcp"]) == 1
    assert "exists and is not an empty directory" in capsys.readouterr().err
    assert main(["convert", str(ranks[1] / "zero3.ckpt"), "/proc/dcp_out", "--to", "dcp"]) == 1  # not writable
    assert "lightning-zero convert: cannot write /proc/dcp_out: [Errno" in capsys.readouterr().err
