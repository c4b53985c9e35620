"""Two "nodes" on loopback (NODE_RANK 0 and 1, one process each) train exactly like one node with 2 processes."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def _command(save_dir: Path, devices: int, num_nodes: int) -> list[str]:
    return [
        sys.executable,
        "examples/gpt.py",
        "fit",
        "--config",
        "examples/configs/multinode.yaml",
        f"--trainer.devices={devices}",
        f"--trainer.num_nodes={num_nodes}",
        f"--trainer.max_steps={STEPS}",
        "--trainer.log_every_n_steps=1",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={save_dir}",
    ]


def _losses(save_dir: Path) -> list[float]:
    (metrics,) = save_dir.glob("gpt_multinode/version_*/metrics.csv")
    with metrics.open() as handle:
        return [float(row["train_loss"]) for row in csv.DictReader(handle) if row.get("train_loss")]


def test_two_nodes_on_loopback_match_one_node(tmp_path: Path) -> None:
    single = subprocess.run(
        _command(tmp_path / "single", 2, 1), cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert single.returncode == 0, single.stderr[-3000:]

    port = str(free_port())
    nodes = []
    for node_rank in (0, 1):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NODE_RANK": str(node_rank)}
        nodes.append(
            subprocess.Popen(
                _command(tmp_path / f"node{node_rank}", 1, 2),
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, stderr) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, stderr[-3000:]

    multi = _losses(tmp_path / "node0")  # global rank 0 logs
    reference = _losses(tmp_path / "single")
    assert len(multi) == len(reference) == STEPS
    for a, b in zip(reference, multi, strict=True):
        assert abs(a - b) <= 1e-6 * abs(a), (reference, multi)
