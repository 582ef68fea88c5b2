"""A short RL run over three emulated hosts (network namespaces joined by shaped veth links).

Host 0 runs the manager, the data role and the real torch trainer (tiny Qwen2); hosts 1 and 2
each run a relay and two sim rollouts. Every role is started with ``laminar serve --role R --join
ADDR`` and listens on its own host's 198.18.0.x address, so every cross-host hop (trainer -> master
relay on host 1 -> relay on host 2, rollouts <-> data) crosses the emulated network. Checks: the
trainer publishes 3 versions, both relays hold them, each rollout loads them from the relay on its
own host (the bytes verified against the trainer's digests) and trajectories come from rollouts on
both hosts generated with the new versions; no role dies; the namespaces and shared memory are gone
afterwards. Skipped only where network namespaces are not permitted.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import time
from pathlib import Path

import msgpack
import pytest

from laminar.harness.netns import NetLab, probe

from ..support.models import tiny_qwen2
from ..support.multihost import MultiHostCluster, observe, on_host
from ..support.scenario import write_config
from ..support.task import write_prompts, write_tokenizer

_REASON = probe()
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(240),
    pytest.mark.skipif(_REASON is not None, reason=f"network namespaces unavailable: {_REASON}"),
]

VERSIONS = 3
HOSTS = {1: ["rollout-h1-0", "rollout-h1-1"], 2: ["rollout-h2-0", "rollout-h2-1"]}
PREFIX = "lmnmh"  # this test's namespaces: lmnmh{pid}-h0..h2 and -sw

SIM = {
    "backend": "sim",
    "vocab_size": 64,
    "lengths": {"kind": "lognormal", "median": 8, "sigma": 0.5, "max_length": 24},
    "cost": {"batch_points": [[1, 0.004], [256, 0.006]], "prefill_s_per_token": 0},
}


def config(tmp: Path, manager_address: str) -> Path:
    return write_config(
        tmp,
        {
            "manager": {
                "bind": f"tcp://{manager_address}:0",
                "metrics": None,
                "admin": "127.0.0.1:0",
            },
            "data": {
                "prompts": str(write_prompts(tmp / "prompts.jsonl", 64)),
                "tokenizer": str(write_tokenizer(tmp / "tok")),
                "reward": "tests.support.task:reward_len",
                "samples_per_prompt": 4,
                "epochs": None,
                "store": str(tmp / "data.sqlite"),
                "sampling": {"max_tokens": 24},
                "metrics": None,
            },
            "relay": {"metrics": None},
            "rollout": {
                "metrics": None,
                "concurrency": 8,
                "flush_interval_s": 0.1,
                "take_wait_s": 0.5,
                "engine": SIM,
            },
            "trainer": {
                "metrics": None,
                "model": str(tmp / "model"),
                "batch": {"prompts": 2, "samples": 4, "micro_batch_rows": 8},
                "optim": {"lr": 1e-4},
                "threads_per_rank": 1,
                "max_versions": VERSIONS,
                "sample_wait_s": 0.5,
                "checkpoint": {"dir": str(tmp / "ckpt"), "keep": 2},
                "metrics_file": str(tmp / "trainer.jsonl"),  # not the default runs/latest/
                "publish": {"chunks": 4},
            },
        },
    )


def trajectories(store: Path) -> list[tuple[str, int]]:
    """(rollout, version) of every stored trajectory, read beside the data role."""
    with sqlite3.connect(f"file:{store}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT body FROM trajectories").fetchall()
    return [(t["rollout"], t["version"]) for t in (msgpack.unpackb(b) for (b,) in rows)]


def host_of_address(address: str) -> str:
    return address.split("://", 1)[1].rsplit(":", 1)[0]


def our_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.startswith(PREFIX)]


def shm_segments() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith("laminar-")]


def test_rl_run_across_three_hosts(tmp_path: Path) -> None:
    NetLab.cleanup_stale(PREFIX)
    t0 = time.monotonic()
    tiny_qwen2(tmp_path / "model")
    with NetLab(3, rate_mbit=1000, prefix=PREFIX) as lab:
        addr = {i: lab.address(i) for i in range(3)}
        cluster = MultiHostCluster(lab, tmp_path, config(tmp_path, addr[0]))
        try:
            cluster.serve("manager", "manager", 0)
            # join order is chain order: the relay on host 1 is the master, host 2's follows it
            cluster.serve_all([("data", "data", 0), ("relay", "relay-h1", 1)])
            # Host 2's relay before its rollouts: one that starts first follows host 1's relay
            # as a stand-in until its own joins (roles/rollout/switching.py), and this test
            # checks that every load came from the rollout's own host.
            cluster.serve("relay", "relay-h2", 2)
            # The trainer before the rollouts: its start (torch, transformers) took ~20 s beside
            # them, while the sim rollouts generated and the data role stored some 10,000
            # trajectories nobody would train on (21 of the test's 54 CPU-s, 2026-11-29).
            cluster.serve("trainer", "trainer", 0)
            cluster.serve_all([("rollout", n, h) for h, names in HOSTS.items() for n in names])
            started = time.monotonic() - t0
            addresses = {n: cluster.address(n) for n in cluster.started}
            report = on_host(lab, 0, lambda: observe(addresses, VERSIONS, 150), 150)
            ran = time.monotonic() - t0 - started
            # which relay each rollout talks to, seen in its own host's network stack
            relays = {addresses[n].split("://", 1)[1]: n for n in ("relay-h1", "relay-h2")}
            relay_of: dict[str, set[str]] = {}
            for host, names in HOSTS.items():
                conns = cluster.connections(host)
                for name in names:
                    pid = cluster.started[name].pid
                    relay_of[name] = {
                        relays[p] for _, p, owner in conns if owner == pid and p in relays
                    }
            dead = cluster.dead()
        finally:
            rollout_names = [n for names in HOSTS.values() for n in names]
            cluster.shutdown([rollout_names, ["trainer"], ["relay-h2", "relay-h1"], ["data"]])
            pids = {p.pid for p in cluster.started.values()}
    print(
        f"start {started:.1f} s, run {ran:.1f} s, total {time.monotonic() - t0:.1f} s, exits {cluster.exits}"
    )

    assert not dead, f"roles died during the run: {dead}"
    unclean = {n: e for n, e in cluster.exits.items() if e[0] != 0}
    assert not unclean, f"roles that did not stop cleanly on SIGTERM (code, s): {unclean}"
    assert our_namespaces() == [], "namespaces left behind"
    leaked = [n for n in shm_segments() if int(n.split("-")[1], 16) in pids]
    assert not leaked, f"shared-memory segments left by our roles: {leaked}"

    # every member advertises its own host's lab address (a relay its weights listener too),
    # never loopback or a wildcard; the manager's admin HTTP stays on host 0's loopback by config
    members = {m["instance"]: m for m in report["members"]}
    expected = {"manager": 0, "data": 0, "trainer": 0, "relay-h1": 1, "relay-h2": 2}
    expected |= {n: h for h, names in HOSTS.items() for n in names}
    assert set(members) >= set(expected)
    for name, host in expected.items():
        m = members[name]
        assert host_of_address(m["address"]) == addr[host], m
        assert m["host"] == f"lmhost{host}", m
        if m["role"] == "relay":
            assert host_of_address(m["endpoints"]["weights"]) == addr[host], m

    # the chain: master relay on host 1, then host 2's; both verified every version
    chain = [r["instance"] for r in report["chain"]["relays"]]
    assert chain == ["relay-h1", "relay-h2"]
    trainer = report["trainer"]
    assert trainer["published"] >= VERSIONS
    digests = {int(v): d for v, d in trainer["digests"].items()}
    assert set(digests) >= set(range(1, VERSIONS + 1))
    for name in ("relay-h1", "relay-h2"):
        relay = report["relays"][name]
        verified = {v["version"] for v in relay["versions"] if v["verified"]}
        assert VERSIONS in verified, relay
        assert {int(v) for v in relay["received_at"]} >= set(range(1, VERSIONS + 1)), relay
    assert VERSIONS in {int(v) for v in report["relays"]["relay-h1"]["forwarded"]}

    # every rollout loaded the trainer's bytes from the relay on its own host, up to the last
    for host, names in HOSTS.items():
        for name in names:
            loads = report["rollouts"][name]["loads"]
            assert loads and loads[-1]["version"] == VERSIONS, (name, loads)
            for load in loads:
                assert load["digest"] == digests[load["version"]], (name, load)
            assert relay_of[name] == {f"relay-h{host}"}, (name, relay_of[name])

    # trajectories generated with new versions came from both hosts
    rows = trajectories(tmp_path / "data.sqlite")
    new = {rollout for rollout, version in rows if version >= 1}
    for host, names in HOSTS.items():
        assert new & set(names), f"no trajectory from host {host} with a published version"
