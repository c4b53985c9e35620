"""Separate network hosts on one machine for multi-node tests: one network namespace per "node", joined by a veth pair.

[Note: test hosts]
Two processes on one loopback address are not two nodes: they share every interface and port, so a launch that
picks the wrong address, or a rank that reaches "node 0" through 127.0.0.1, still works there and fails on a real
cluster. ``network_hosts()`` builds two hosts instead:

- one network namespace per host (``ip netns add``), holding only ``lo`` and one end of a veth pair, both up. The
  two ends share the name ``INTERFACE`` (as every node of a cluster has its ``eth0``) and the addresses
  ``SUBNET.1`` and ``SUBNET.2``. A host reaches the other only across the link, and its loopback is its own;
- one ``/etc/hosts`` per host (``ip netns exec`` mounts ``/etc/netns/<namespace>/hosts`` over it): the host names
  ``node0``, ``node1`` and this machine's own host name, which resolves to the host's own address, as on a real
  node (torchrun's rendezvous looks it up to decide which node hosts its store).

Nothing of it is visible outside the namespaces, so the subnet and the ports (29400, 29500, the ones the recipes of
docs/launching.md use) cannot collide with another run; only the namespace names are global, and they carry this
process's id and a random suffix. Leaving the context kills every process still in the namespaces (the ones the
test started there), deletes the link and the namespaces and their ``/etc/netns`` entries, also when the body
raised; namespaces left behind by a test process that was killed outright are deleted by the next run.

``HostPair.throttle`` shapes the link with a token bucket (``tc qdisc ... tbf``), for a benchmark that wants a slow
"network between nodes".
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import IO

SUBNET = "10.213.0"  # private to the namespaces, see [Note: test hosts]
INTERFACE = "lzlink"  # the veth end in each namespace (interface names are per namespace)
PREFIX = "lzt-"  # namespace names: PREFIX + "<pid>-<random>-<index>"
_NAME = re.compile(rf"{PREFIX}(?P<pid>\d+)-[0-9a-f]{{6}}-\d+")
ETC_NETNS = Path("/etc/netns")
_IP_TIMEOUT_S = 30


@dataclass(frozen=True)
class Host:
    """One "node": a network namespace with its own address and host name."""

    namespace: str
    name: str  # resolvable on every host, e.g. as a SLURM node name
    address: str
    interface: str = INTERFACE

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


@dataclass
class HostPair:
    """Two hosts joined by one link; the processes started on them are ended when the pair is torn down."""

    hosts: tuple[Host, Host]
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def popen(
        self,
        host: Host | None,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path,
        log: IO[bytes],
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` in a session of its own, stdout and stderr to ``log``.

        ``host=None`` runs it outside the hosts, in this process's namespace: for a launcher that starts the
        processes on the hosts itself (``srun``), killed with the rest when the pair is torn down.
        """
        command = list(argv) if host is None else host.command(argv)
        process = subprocess.Popen(
            command, env=dict(env), cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.processes.append(process)
        return process

    def link_bytes(self, host: Host) -> tuple[int, int]:
        """(received, sent) bytes of ``host``'s end of the link since it was created."""
        (link,) = json.loads(_ip("-n", host.namespace, "-j", "-s", "link", "show", "dev", host.interface))
        stats = link["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def qdisc(self, host: Host) -> list[dict[str, object]]:
        """The queueing disciplines of ``host``'s end of the link (``tc -j qdisc show``)."""
        return json.loads(_run(["tc", "-n", host.namespace, "-j", "qdisc", "show", "dev", host.interface]))

    @contextlib.contextmanager
    def throttle(self, rate: str, burst: str = "64kb", latency: str = "50ms") -> Iterator[None]:
        """Limit both directions of the link to ``rate`` (tc syntax, e.g. ``"100mbit"``) while the context is open.

        A token bucket (``tbf``) on each end's egress: ``burst`` is the bucket size, ``latency`` how long a packet
        may wait for tokens before it is dropped. Removed on exit, also when the body raised.
        """
        shaped: list[Host] = []
        try:
            for host in self.hosts:
                tbf = ["root", "tbf", "rate", rate, "burst", burst, "latency", latency]
                _run(["tc", "-n", host.namespace, "qdisc", "add", "dev", host.interface, *tbf])
                shaped.append(host)
            yield
        finally:
            for host in shaped:
                _run(["tc", "-n", host.namespace, "qdisc", "del", "dev", host.interface, "root"], check=False)


def wait_all(processes: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> list[int | None]:
    """Wait for every process; once one fails, or the time is up, kill the rest. Their return codes (None: killed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [process.poll() for process in processes]
        if all(code is not None for code in codes) or any(code not in (None, 0) for code in codes):
            break
        time.sleep(0.2)
    codes = [process.poll() for process in processes]
    for process, code in zip(processes, codes, strict=True):
        if code is None:
            _kill_session(process)
    return codes


@cache
def unavailable_reason() -> str | None:
    """Why network namespaces cannot be created here, or None when they can (tried once per process)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); run the tests as root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = _unique_names(1)[0]
    try:
        _ip("netns", "add", probe)
    except RuntimeError as error:
        return f"`ip netns add` failed, network namespaces are not allowed here: {error}"
    _ip("netns", "del", probe)
    return None


@contextlib.contextmanager
def network_hosts() -> Iterator[HostPair]:
    """Two hosts joined by a veth link (see [Note: test hosts]); everything is removed on exit, also after errors."""
    _delete_stale()
    namespaces = _unique_names(2)
    hosts = (
        Host(namespaces[0], "node0", f"{SUBNET}.1"),
        Host(namespaces[1], "node1", f"{SUBNET}.2"),
    )
    pair = HostPair(hosts)
    try:
        _create(hosts)
        yield pair
    finally:
        for process in pair.processes:
            _kill_session(process)
        _delete(namespaces)


def _create(hosts: tuple[Host, Host]) -> None:
    for host in hosts:
        _ip("netns", "add", host.namespace)
        _write_hosts_file(host, hosts)
    first, second = hosts
    peer = ["peer", "name", second.interface, "netns", second.namespace]
    _ip("link", "add", "name", first.interface, "netns", first.namespace, "type", "veth", *peer)
    for host in hosts:
        _ip("-n", host.namespace, "link", "set", "lo", "up")
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
        _ip("-n", host.namespace, "link", "set", host.interface, "up")


def _write_hosts_file(host: Host, hosts: Sequence[Host]) -> None:
    lines = ["127.0.0.1 localhost", f"{host.address} {socket.gethostname()}"]
    lines += [f"{other.address} {other.name}" for other in hosts]
    directory = ETC_NETNS / host.namespace
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "hosts").write_text("\n".join(lines) + "\n")


def _delete(namespaces: Sequence[str]) -> None:
    """Kill what still runs in the namespaces, delete the link and the namespaces; never raises."""
    for namespace in namespaces:
        for pid in _run(["ip", "netns", "pids", namespace], check=False).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    if namespaces:
        # Deleting a namespace frees its end of the link only once the kernel gets to it; deleting the link now
        # frees both ends at once.
        _run(["ip", "-n", namespaces[0], "link", "del", INTERFACE], check=False)
    for namespace in namespaces:
        _run(["ip", "netns", "del", namespace], check=False)
        shutil.rmtree(ETC_NETNS / namespace, ignore_errors=True)
    # /etc/netns itself stays (iproute2's own directory; removing it would race with a parallel run's mkdir).


def _delete_stale() -> None:
    """Delete the namespaces of earlier test processes that died before they could clean up.

    A process id names its creator; the test processes of one machine share one PID namespace.
    """
    ours = (_NAME.fullmatch(line.split()[0]) for line in _ip("netns", "list").splitlines() if line.strip())
    _delete([match.group(0) for match in ours if match is not None and not _alive(int(match.group("pid")))])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unique_names(count: int) -> list[str]:
    run = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
    return [f"{run}-{index}" for index in range(count)]


def _kill_session(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _run(argv: Sequence[str], check: bool = True) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` exited with {result.returncode}: {result.stderr.strip()}")
    return result.stdout
