"""``laminar status``: ask the manager for the cluster and render it."""

from __future__ import annotations

from rich.table import Table

from .config import ClusterConfig
from .membership import ClusterStatus, MembershipApi
from .rpc_client import RpcClient, remote
from .service import transport_options

_STATE_STYLE = {"alive": "green", "dead": "bold red", "left": "dim"}


async def fetch_status(
    manager: str, token: bytes, cluster: ClusterConfig, *, timeout: float = 5.0
) -> ClusterStatus:
    client = RpcClient(manager, transport_options(cluster, token), timeout=timeout)
    try:
        return await remote(MembershipApi, client).status.call()
    finally:
        await client.close()


def render_status(status: ClusterStatus, *, title: str | None = None) -> Table:
    counts: dict[str, int] = {}
    for member in status.members:
        counts[member.state] = counts.get(member.state, 0) + 1
    summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    table = Table(
        title=f"{title or 'cluster'} {status.cluster!r} (manager {status.manager}): {summary}",
        title_justify="left",
    )
    for column in (
        "instance",
        "role",
        "state",
        "address",
        "pid",
        "last heartbeat",
        "incarnation",
        "reason",
    ):
        table.add_column(column)
    for m in sorted(status.members, key=lambda m: (m.role != "manager", m.role, m.instance)):
        age = status.now - m.last_seen
        table.add_row(
            m.instance,
            m.role,
            f"[{_STATE_STYLE.get(m.state, '')}]{m.state}[/]",
            m.address,
            str(m.pid) if m.pid else "",
            f"{age:.1f} s ago",
            str(m.incarnation),
            m.reason,
        )
    return table
