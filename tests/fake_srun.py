"""A stand-in for ``srun`` on a machine without SLURM: starts the tasks of one job step on the test hosts.

``srun --nodes=N --ntasks-per-node=M command ...`` starts N*M tasks, M on each of the first N hosts named in
``$LZT_SRUN_HOSTS`` (a JSON list of ``[namespace, host name]``, see tests/netns.py), each in its host's network
namespace with the environment ``srun`` gives a task (``task_environment``). Like ``srun --kill-on-bad-exit``, the
first task that fails ends the others; the exit status is the first non-zero one. The job's own variables
(``SLURM_JOB_ID``, ``SLURM_JOB_NAME``) come from the caller's environment, as ``sbatch`` sets them for the batch
script. Only the options above are understood; anything else is an error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence

from tests.netns import wait_all

TIMEOUT_S = 600


def task_environment(nodes: Sequence[str], tasks_per_node: int, node_id: int, local_id: int) -> dict[str, str]:
    """The variables ``srun`` sets for task ``local_id`` on node ``node_id`` (names in ``nodes``, in order)."""
    ntasks = len(nodes) * tasks_per_node
    nodelist = _compress(nodes)
    return {
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NPROCS": str(ntasks),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_TASKS_PER_NODE": f"{tasks_per_node}(x{len(nodes)})",
        "SLURM_NNODES": str(len(nodes)),
        "SLURM_JOB_NUM_NODES": str(len(nodes)),
        "SLURM_NODELIST": nodelist,
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0",
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_NUM_NODES": str(len(nodes)),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x{len(nodes)})",
        "SLURM_PROCID": str(node_id * tasks_per_node + local_id),
        "SLURM_LOCALID": str(local_id),
        "SLURM_NODEID": str(node_id),
        "SLURMD_NODENAME": nodes[node_id],
        "SLURM_GTIDS": ",".join(str(node_id * tasks_per_node + i) for i in range(tasks_per_node)),
    }


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="srun (test stand-in)")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--ntasks-per-node", type=int, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    hosts = json.loads(os.environ["LZT_SRUN_HOSTS"])
    if not args.command or args.nodes > len(hosts):
        parser.error(f"need a command and at most {len(hosts)} nodes (the test hosts), got {argv}")
    names = [name for _, name in hosts[: args.nodes]]
    tasks = []
    for node_id, (namespace, _) in enumerate(hosts[: args.nodes]):
        for local_id in range(args.ntasks_per_node):
            env = {**os.environ, **task_environment(names, args.ntasks_per_node, node_id, local_id)}
            argv_in_host = ["ip", "netns", "exec", namespace, *args.command]
            tasks.append(subprocess.Popen(argv_in_host, env=env, start_new_session=True))
    codes = wait_all(tasks, TIMEOUT_S)
    failed = [code for code in codes if code != 0]
    return (failed[0] or 1) if failed else 0


def _compress(names: Sequence[str]) -> str:
    """SLURM's node-list form: ``node[0-1]`` for consecutively numbered names, else the names joined by commas."""
    stem = names[0].rstrip("0123456789")
    suffixes = [name[len(stem) :] for name in names]
    if len(names) > 1 and all(name.startswith(stem) and s.isdigit() for name, s in zip(names, suffixes, strict=True)):
        values = [int(suffix) for suffix in suffixes]
        if values == list(range(values[0], values[0] + len(values))):
            return f"{stem}[{suffixes[0]}-{suffixes[-1]}]"
    return ",".join(names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
