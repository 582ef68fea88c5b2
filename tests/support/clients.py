"""Typed proxies to the services of a ProcessCluster, one cached RPC client per address."""

from __future__ import annotations

from typing import TypeVar

from laminar.harness.launch import ProcessCluster
from laminar.runtime.config import ClusterConfig
from laminar.runtime.context import transport_options
from laminar.runtime.rpc.client import RpcClient, remote

from .procs import TOKEN

S = TypeVar("S")


class ClusterClients:
    """``proxy(Cls, name)`` reaches the service ``name`` started by ``cluster``.

    Clients are cached by address, so polling reuses one connection, and a restarted service
    (a new address) gets a fresh client.
    """

    def __init__(self, cluster: ProcessCluster) -> None:
        self.cluster = cluster
        self.options = transport_options(ClusterConfig(), TOKEN.encode())
        self._clients: dict[str, RpcClient] = {}

    def client(self, address: str) -> RpcClient:
        if address not in self._clients:
            self._clients[address] = RpcClient(address, self.options, timeout=10.0)
        return self._clients[address]

    def proxy(self, cls: type[S], name: str) -> S:
        return remote(cls, self.client(self.cluster.info[name]["address"]))

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
