"""NetLab: namespaces on a bridge with shaped links. Needs root + iproute2; skipped otherwise.

No throughput assertions here (timing-dependent); only reachability, configuration and cleanup.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from laminar.harness.netns import NetLab, NetLabError, probe

_REASON = probe()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"netns unavailable: {_REASON}")

ECHO_SERVER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(8)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    with c:
        c.sendall(c.recv(4096))
"""

ECHO_CLIENT = r"""
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as c:
    c.sendall(sys.argv[3].encode())
    sys.stdout.write(c.recv(4096).decode())
"""


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def _start_echo(lab: NetLab, host: int, bind: str, port: int) -> subprocess.Popen[str]:
    server = lab.popen(
        host,
        [sys.executable, "-c", ECHO_SERVER, bind, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    assert server.stdout.readline().strip() == "ready"
    return server


def _echo(lab: NetLab, host: int, addr: str, port: int, msg: str) -> str:
    res = lab.run(
        host,
        [sys.executable, "-c", ECHO_CLIENT, addr, str(port), msg],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_hosts_reach_each_other_and_cleanup() -> None:
    with NetLab(3, rate_mbit=200) as lab:
        names = [lab.namespace(i) for i in range(3)]
        assert [lab.address(i) for i in range(3)] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
        assert set(names) <= set(_namespaces())
        server = _start_echo(lab, 0, "0.0.0.0", 7000)
        assert _echo(lab, 2, lab.address(0), 7000, "hello from h2") == "hello from h2"
        assert _echo(lab, 1, lab.address(0), 7000, "hello from h1") == "hello from h1"
        # Loopback is up and private to each host.
        _start_echo(lab, 1, "127.0.0.1", 7001)
        assert _echo(lab, 1, "127.0.0.1", 7001, "local") == "local"
        res = lab.run(
            2,
            [sys.executable, "-c", ECHO_CLIENT, "127.0.0.1", "7001", "x"],
            capture_output=True,
            timeout=10,
        )
        assert res.returncode != 0  # host 2's loopback has no such server
    assert server.poll() is not None  # killed by close()
    left = set(_namespaces())
    assert not (set(names) | {lab.switch_namespace}) & left
    lab.close()  # idempotent


def test_tc_shows_configured_rate() -> None:
    with NetLab(2, rate_mbit=200) as lab:
        out = lab.run(1, ["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True)
        assert "tbf" in out.stdout and "rate 200Mbit" in out.stdout, out.stdout
        # Receive direction: the bridge port towards host 1.
        sw = subprocess.run(
            ["ip", "netns", "exec", lab.switch_namespace, "tc", "qdisc", "show", "dev", "h1"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert "rate 200Mbit" in sw.stdout, sw.stdout
    with NetLab(1, rate_mbit=None) as lab:
        out = lab.run(0, ["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True)
        assert "tbf" not in out.stdout


def test_setup_error_is_clear_and_cleans_up(monkeypatch: pytest.MonkeyPatch) -> None:
    import laminar.harness.netns as netns

    bogus = [["tc", "qdisc", "replace", "dev", "eth0", "root", "nosuchqdisc"]]
    monkeypatch.setattr(netns, "_shape_cmds", lambda *a: bogus)
    # Its own prefix: another xdist worker may open and close labs meanwhile.
    prefix = f"lmnseterr{os.getpid()}x"
    with pytest.raises(NetLabError, match="nosuchqdisc") as err:
        NetLab(2, rate_mbit=100, prefix=prefix)
    assert "rc=" in str(err.value)
    assert not [n for n in _namespaces() if n.startswith(prefix)]


def test_cleanup_stale_removes_namespaces_of_dead_process() -> None:
    prefix = "lmnstale"
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]);"
        "from laminar.harness.netns import NetLab;"
        f"lab = NetLab(2, rate_mbit=None, prefix={prefix!r});"
        "print(lab.namespace(0), flush=True); time.sleep(60)"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen([sys.executable, "-c", code, root], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        ns = child.stdout.readline().strip()
        assert ns.startswith(f"{prefix}{child.pid}-")
        assert NetLab.cleanup_stale(prefix) == []  # owner still alive
    finally:
        child.send_signal(signal.SIGKILL)  # no atexit: namespaces are left behind
        child.wait()
    assert ns in _namespaces()
    removed = NetLab.cleanup_stale(prefix)
    assert ns in removed and len(removed) == 3  # two hosts + switch
    assert not any(n.startswith(f"{prefix}{child.pid}-") for n in _namespaces())


def test_atexit_cleans_up() -> None:
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from laminar.harness.netns import NetLab;"
        "lab = NetLab(1, rate_mbit=None, prefix='lmnexit');"
        "p = lab.popen(0, ['sleep', '60']); print(lab.namespace(0), p.pid, flush=True)"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-c", code, root], capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 0, res.stderr
    ns, pid = res.stdout.split()
    assert time.monotonic() - t0 < 20
    assert ns not in _namespaces()
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)
