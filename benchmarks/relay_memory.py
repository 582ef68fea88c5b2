"""Does a relay's heap grow with the versions it serves, or step once? (The soak's relay question.)

A manager and two relays as processes; this script publishes ``--versions`` weight versions of
``--mib`` MiB each through the real publisher (the trainer's path) and samples each relay's
resident anonymous memory (``RssAnon``: heaps, not the shared-memory versions, which ``relay.keep``
bounds) every ten versions. A leak grows with the version count; a working set steps up and stays.

    python benchmarks/relay_memory.py --json OUT.json [--versions 300 --mib 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from laminar.harness.launch import ProcessCluster  # noqa: E402
from laminar.roles.trainer.publisher import WeightPublisher  # noqa: E402
from laminar.runtime.config import ClusterConfig  # noqa: E402
from laminar.runtime.context import transport_options  # noqa: E402
from laminar.runtime.rpc.client import RpcClient  # noqa: E402
from laminar.weights.config import PublishConfig  # noqa: E402

TOKEN = "relay-memory-bench-token-0123456789"
RELAYS = ("relay-0", "relay-1")


def anon_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon"):
                return int(line.split()[1]) / 1024
    return 0.0


async def publish(cluster: ProcessCluster, args: argparse.Namespace) -> list[dict]:
    assert cluster.manager is not None
    options = transport_options(ClusterConfig(), TOKEN.encode())
    manager = RpcClient(cluster.manager, options, timeout=30.0)
    publisher = WeightPublisher(PublishConfig(chunks=4), options, manager=manager)
    pushing = asyncio.create_task(publisher.run())
    tensors = [("w", torch.zeros(args.mib * (1 << 20) // 4))]
    pids = {name: cluster.info[name]["pid"] for name in RELAYS}
    rows: list[dict] = []
    t0 = time.perf_counter()
    try:
        for version in range(1, args.versions + 1):
            staged = await asyncio.to_thread(publisher.stage, version, tensors)
            await publisher.hand_off(staged)
            await asyncio.sleep(args.interval)
            if version % 10 == 0:
                row = {"t_s": round(time.perf_counter() - t0, 1), "version": version}
                row.update({name: round(anon_mib(pid), 1) for name, pid in pids.items()})
                rows.append(row)
                print(row, flush=True)
    finally:
        pushing.cancel()
        await asyncio.gather(pushing, return_exceptions=True)
        await manager.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path)
    p.add_argument("--versions", type=int, default=300)
    p.add_argument("--mib", type=int, default=8, help="MiB per version")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between publishes")
    args = p.parse_args()
    os.environ["LAMINAR_TOKEN"] = TOKEN
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        config = {
            "cluster": {"name": "relay-memory", "token_env": "LAMINAR_TOKEN"},
            "relay": {"weights_bind": "tcp://127.0.0.1:0", "metrics": None, "keep": 2},
            "manager": {"metrics": None},
        }
        (d / "cluster.yaml").write_text(yaml.safe_dump(config))
        with ProcessCluster(d / "cluster.yaml", d / "logs", cwd=d) as cluster:
            cluster.serve("manager", "manager")
            for name in RELAYS:
                cluster.serve("relay", name)
            rows = asyncio.run(publish(cluster, args))
    third = max(1, len(rows) // 3)
    summary = {
        name: {
            "first_mib": rows[0][name],
            "after_a_third_mib": rows[third - 1][name],
            "end_mib": rows[-1][name],
            "growth_over_last_two_thirds": round(rows[-1][name] / rows[third - 1][name] - 1, 4),
        }
        for name in RELAYS
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = vars(args) | {"json": str(args.json)}
        out = {"settings": settings, "samples": rows, "summary": summary}
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
