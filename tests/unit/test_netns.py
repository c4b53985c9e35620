"""The test hosts of tests/netns.py ([Note: test hosts]): separate, joined by one link, throttled on demand, and
always removed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import netns
from tests.netns import ETC_NETNS, PREFIX, HostPair, network_hosts, unavailable_reason, wait_all

needs_netns = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

# A listener on node 0 that accepts two connections; a client that connects to an address and reports.
_SERVER = """
import socket
server = socket.create_server(("0.0.0.0", 29500))
server.settimeout(60)
for _ in range(2):
    server.accept()[0].close()
"""
_CLIENT = """
import socket, sys, time
deadline = time.monotonic() + 30
while True:
    try:
        socket.create_connection((sys.argv[1], 29500), timeout=5).close()
        print("connected")
        break
    except ConnectionRefusedError:
        if time.monotonic() > deadline or sys.argv[2] == "once":
            print("refused")
            break
        time.sleep(0.1)
"""


def _namespaces() -> set[str]:
    return {
        line.split()[0]
        for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
    }


def _python(pair: HostPair, host_index: int, code: str, *args: str) -> str:
    argv = pair.hosts[host_index].command([sys.executable, "-c", code, *args])
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout.strip()


@needs_netns
def test_hosts_are_separate_and_joined_by_one_link(tmp_path: Path) -> None:
    with network_hosts() as pair:
        node0, node1 = pair.hosts
        with (tmp_path / "server.log").open("wb") as log:
            server = pair.popen(node0, [sys.executable, "-c", _SERVER], env={}, cwd=tmp_path, log=log)
        assert _python(pair, 0, _CLIENT, "127.0.0.1", "retry") == "connected"  # node 0's own loopback
        assert _python(pair, 1, _CLIENT, "127.0.0.1", "once") == "refused"  # node 1's loopback is its own
        assert _python(pair, 1, _CLIENT, node0.address, "retry") == "connected"  # across the link
        assert wait_all([server], 30) == [0]
        received, sent = pair.link_bytes(node1)
        assert min(received, sent) > 0
        resolve = "import socket, sys; print(socket.gethostbyname(sys.argv[1]))"
        assert _python(pair, 1, resolve, "node0") == node0.address
        assert _python(pair, 1, "import socket; print(socket.gethostbyname(socket.gethostname()))") == node1.address
        links = subprocess.run(node1.command(["ip", "-o", "link"]), capture_output=True, text=True).stdout
        assert sorted(line.split(":")[1].strip().split("@")[0] for line in links.splitlines()) == [
            "lo",
            node1.interface,
        ]


def _start_a_process_then_fail(tmp_path: Path, seen: dict[str, object]) -> None:
    with network_hosts() as pair, (tmp_path / "sleep.log").open("wb") as log:
        seen["process"] = pair.popen(pair.hosts[1], ["sleep", "600"], env={}, cwd=tmp_path, log=log)
        seen["names"] = {host.namespace for host in pair.hosts}
        assert seen["names"] <= _namespaces()
        raise RuntimeError("test body failed")


@needs_netns
def test_everything_is_removed_when_the_body_raises(tmp_path: Path) -> None:
    seen: dict[str, object] = {}
    with pytest.raises(RuntimeError, match="test body failed"):
        _start_a_process_then_fail(tmp_path, seen)
    process, names = seen["process"], seen["names"]
    assert isinstance(process, subprocess.Popen)
    assert isinstance(names, set)
    assert process.returncode is not None, "the process on the host outlived the hosts"
    assert not names & _namespaces()
    assert not any((ETC_NETNS / name).exists() for name in names)


@needs_netns
def test_namespaces_of_a_dead_test_process_are_deleted() -> None:
    ended = subprocess.Popen(["true"])
    ended.wait()
    dead_pid = ended.pid
    stale = f"{PREFIX}{dead_pid}-000000-0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with network_hosts():
            assert stale not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True, check=False)


@needs_netns
@pytest.mark.skipif(shutil.which("tc") is None, reason="the `tc` command (iproute2) is not installed")
def test_throttle_shapes_both_ends_and_is_removed() -> None:
    with network_hosts() as pair:
        with pair.throttle("8mbit", burst="32kb", latency="20ms"):
            for host in pair.hosts:
                (qdisc,) = pair.qdisc(host)
                assert qdisc["kind"] == "tbf"
                assert qdisc["options"]["rate"] == 8_000_000 // 8  # bytes per second
        for host in pair.hosts:
            assert "tbf" not in [qdisc["kind"] for qdisc in pair.qdisc(host)]


def test_wait_all_kills_the_others_when_one_fails(tmp_path: Path) -> None:
    def start(code: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)

    started = time.monotonic()
    codes = wait_all([start("import time; time.sleep(600)"), start("raise SystemExit(3)")], timeout_s=120)
    assert codes == [None, 3]
    assert time.monotonic() - started < 60


def test_the_reason_to_skip_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    unavailable_reason.cache_clear()
    try:
        monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
        assert "needs root" in str(unavailable_reason())
        unavailable_reason.cache_clear()
        monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
        monkeypatch.setattr(netns.shutil, "which", lambda name: None)
        assert "`ip` command" in str(unavailable_reason())
    finally:
        unavailable_reason.cache_clear()
