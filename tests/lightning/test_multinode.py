"""The multi-node recipes of docs/launching.md, run on two separate network hosts, train exactly like one node.

Each test reads its recipe from docs/launching.md and runs it as written on 2 "nodes" x 2 processes, the nodes
being network namespaces joined by a virtual link (tests/netns.py, [Note: test hosts]): torchrun with the c10d
rendezvous, Lightning's own launcher with NODE_RANK, and SLURM (``srun`` played by tests/fake_srun.py). The losses
global rank 0 logs at every step must equal those of one node with 4 processes, bit for bit: the world size, the
ranks, their data and the order of every reduction are the same, only the transport differs (gloo's algorithms
depend on the rank order, not on where the ranks run). The link's byte counters show that the training traffic
crossed it.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.netns import Host, HostPair, network_hosts, unavailable_reason, wait_all

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "launching.md"
CONFIG = "examples/configs/multinode.yaml"
TIMEOUT_S = 240
# Variables a launcher reads; the test process may have some (it may itself run under torchrun or SLURM).
_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "RANK", "LOCAL_RANK", "WORLD_SIZE", "JOB_ID")
_LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PL_", "GROUP_", "LOCAL_WORLD", "GLOO_", "NCCL_")

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


def _config() -> dict[str, Any]:
    return yaml.safe_load((ROOT / CONFIG).read_text())


def recipe(name: str) -> str:
    """The shell command under ``<!-- recipe: name -->`` in docs/launching.md."""
    match = re.search(rf"<!-- recipe: {name} -->\s*```bash\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert match is not None, f"docs/launching.md has no recipe {name!r}"
    return match.group(1)


def _environment(**variables: str) -> dict[str, str]:
    """This process's environment without launch variables, with this checkout and its Python first."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _LAUNCH_VARIABLES and not key.startswith(_LAUNCH_PREFIXES)
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return {**env, **variables}


def _workdir(path: Path) -> Path:
    """A working directory of its own (logs land there) that sees the repository's ``examples/``."""
    path.mkdir(parents=True)
    (path / "examples").symlink_to(ROOT / "examples")
    return path


def _losses(run_dir: Path) -> list[float]:
    """The per-step losses logged by global rank 0, the one process of the run that writes metrics."""
    found = list(run_dir.glob("**/gpt_multinode/version_*/metrics.csv"))
    assert len(found) == 1, f"expected one metrics.csv (global rank 0's) under {run_dir}, found {found}"
    with found[0].open() as handle:
        return [float(row["train_loss"]) for row in csv.DictReader(handle) if row.get("train_loss")]


def _log_tails(logs: Mapping[str, Path]) -> str:
    return "\n".join(f"--- {name}:\n{path.read_text(errors='replace')[-3000:]}" for name, path in logs.items())


def _assert_finished(codes: list[int | None], logs: Mapping[str, Path]) -> None:
    killed = f"None: still running after {TIMEOUT_S} s or when another failed, then killed"
    assert codes == [0] * len(codes), f"return codes {codes} ({killed})\n{_log_tails(logs)}"


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """One node with 4 processes (Lightning's launcher on loopback): the run the multi-node launches must equal.

    Forked ranks (not Lightning's default of running the script again) save three interpreters' start-up.
    """
    workdir = _workdir(tmp_path_factory.mktemp("single") / "node0")
    log = workdir / "output.log"
    command = ["python", "examples/gpt.py", "fit", "--config", CONFIG, "--trainer.num_nodes=1", "--trainer.devices=4"]
    command.append("--trainer.strategy.init_args.start_method=fork")
    with log.open("wb") as handle:
        launch = subprocess.Popen(
            command, cwd=workdir, env=_environment(), stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )
    _assert_finished(wait_all([launch], TIMEOUT_S), {"single node": log})  # a hang kills the ranks too
    losses = _losses(workdir)
    assert len(losses) == _config()["trainer"]["max_steps"]
    return losses


@pytest.fixture(scope="module")
def parameter_count() -> int:
    """Number of parameters of the config's model."""
    from examples.gpt import GPTLightningModule

    module = GPTLightningModule(**_config()["model"])
    module.configure_model()
    return sum(parameter.numel() for parameter in module.parameters())


@pytest.fixture
def hosts() -> Iterator[HostPair]:
    with network_hosts() as pair:
        yield pair


def _node_variables(pair: HostPair, host: Host, index: int, run_id: str) -> dict[str, str]:
    """The placeholders of the recipes on ``host``, and the interface gloo must use."""
    return {
        "NODE0_ADDR": pair.hosts[0].address,
        "THIS_ADDR": host.address,
        "NODE_RANK": str(index),
        "JOB_ID": run_id,
        "GLOO_SOCKET_IFNAME": host.interface,
    }


def _run_on_each_host(pair: HostPair, name: str, run_dir: Path) -> None:
    """Run recipe ``name`` once on every host, each in a working directory of its own, and wait for all."""
    processes, logs = [], {}
    for index, host in enumerate(pair.hosts):
        workdir = _workdir(run_dir / host.name)
        logs[host.name] = workdir / "output.log"
        env = _environment(**_node_variables(pair, host, index, run_dir.name))
        with logs[host.name].open("wb") as log:
            processes.append(pair.popen(host, ["bash", "-c", recipe(name)], env=env, cwd=workdir, log=log))
    _assert_finished(wait_all(processes, TIMEOUT_S), logs)


def _assert_trained_like_one_node(pair: HostPair, run_dir: Path, reference: list[float], parameter_count: int) -> None:
    losses = _losses(run_dir)
    steps = _config()["trainer"]["max_steps"]
    assert len(losses) == len(reference) == steps
    assert losses == reference, (reference, losses)  # bit for bit, see the module docstring
    # Every step, the updated values of the other node's shards (2 of the 4 ranks' quarters, fp32) must reach
    # each node before its forward pass: a floor on the bytes that crossed the link in each direction.
    floor = steps * 2 * (parameter_count // 4) * 4
    received = [pair.link_bytes(host)[0] for host in pair.hosts]
    assert min(received) >= floor, f"bytes received over the link per node {received}, expected >= {floor}"


def test_torchrun_with_c10d_rendezvous_on_two_hosts(
    hosts: HostPair, reference_losses: list[float], parameter_count: int, tmp_path: Path
) -> None:
    _run_on_each_host(hosts, "torchrun", tmp_path / "torchrun")
    _assert_trained_like_one_node(hosts, tmp_path / "torchrun", reference_losses, parameter_count)


def test_lightning_launcher_with_node_rank_on_two_hosts(
    hosts: HostPair, reference_losses: list[float], parameter_count: int, tmp_path: Path
) -> None:
    _run_on_each_host(hosts, "lightning", tmp_path / "lightning")
    _assert_trained_like_one_node(hosts, tmp_path / "lightning", reference_losses, parameter_count)
    # Global rank 0 is node 0's first process: the logs are on node 0.
    assert list((tmp_path / "lightning" / "node1").glob("**/metrics.csv")) == []


def test_slurm_tasks_on_two_hosts(
    hosts: HostPair, reference_losses: list[float], parameter_count: int, tmp_path: Path
) -> None:
    """``srun`` (the stand-in) runs from the submission directory; Lightning finds MASTER_ADDR in the node list."""
    run_dir = _workdir(tmp_path / "slurm")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m tests.fake_srun "$@"\n')
    srun.chmod(0o755)
    env = _environment(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="lzt-multinode",
        GLOO_SOCKET_IFNAME=hosts.hosts[0].interface,
        LZT_SRUN_HOSTS=json.dumps([[host.namespace, host.name] for host in hosts.hosts]),
    )
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    log = run_dir / "output.log"
    with log.open("wb") as handle:
        srun_process = hosts.popen(None, ["bash", "-c", recipe("slurm")], env=env, cwd=run_dir, log=handle)
    _assert_finished(wait_all([srun_process], TIMEOUT_S), {"srun": log})
    _assert_trained_like_one_node(hosts, run_dir, reference_losses, parameter_count)
