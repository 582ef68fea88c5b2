"""``laminar status`` and ``laminar repack``: ask the manager (RPC and its admin HTTP API), render.

The admin API's URL is the manager's own member record's ``endpoints["admin"]`` (what the
membership ``status`` RPC returns), unless ``--admin URL`` names it; its bearer token is the
cluster token, found where ``laminar status`` finds it (``$LAMINAR_TOKEN``, the run dir's token
file, the config).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from rich.table import Table

from laminar.roles.manager.api import parse_stats
from laminar.roles.rollout.api import RolloutPhase, RolloutStats
from laminar.runtime.config import ClusterConfig
from laminar.runtime.context import transport_options
from laminar.runtime.errors import LaminarError
from laminar.runtime.membership import ClusterStatus, MembershipApi
from laminar.runtime.rpc.client import RpcClient, remote
from laminar.runtime.stats import VersionedStats

_STATE_STYLE = {"alive": "green", "dead": "bold red", "left": "dim"}
_PHASE_STYLE = {
    RolloutPhase.RUNNING: "green",
    RolloutPhase.DRAINING: "yellow",
    RolloutPhase.SWITCHING: "cyan",
}


async def fetch_status(
    manager: str, token: bytes, cluster: ClusterConfig, *, timeout: float = 5.0
) -> ClusterStatus:
    client = RpcClient(manager, transport_options(cluster, token), timeout=timeout)
    try:
        return await remote(MembershipApi, client).status.call()
    finally:
        await client.close()


def admin_url(status: ClusterStatus, manager_address: str | None = None) -> str | None:
    """The admin API's base URL from the manager's member record (a wildcard bind address is
    replaced by the host the manager was reached at)."""
    for m in status.members:
        if m.role == "manager" and m.instance == status.manager and m.endpoints.get("admin"):
            url = m.endpoints["admin"]
            parts = urllib.parse.urlsplit(url)
            if parts.hostname in ("0.0.0.0", "::") and manager_address:
                host = urllib.parse.urlsplit(manager_address.replace("tcp://", "http://")).hostname
                if host:
                    url = f"{parts.scheme}://{host}:{parts.port}"
            return url
    return None


class AdminError(LaminarError):
    def __init__(self, status: int, message: str, detail: Any = None) -> None:
        self.status, self.message, self.detail = status, message, detail
        text = f"HTTP {status}: {message}"
        if status == 401:
            text += " (is the cluster token right? it comes from $LAMINAR_TOKEN or the run dir)"
        if detail:
            text += "\n" + _format_detail(detail)
        super().__init__(text)


def _format_detail(detail: Any) -> str:
    if isinstance(detail, list) and all(isinstance(d, dict) and "field" in d for d in detail):
        return "\n".join(f"  {d['field']}: {d['message']}" for d in detail)
    return "  " + (detail if isinstance(detail, str) else json.dumps(detail))


class AdminClient:
    """A small synchronous client of the admin HTTP API (bearer token, JSON in and out)."""

    def __init__(self, url: str, token: bytes | str, *, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.token = token.decode() if isinstance(token, bytes) else token
        self.timeout = timeout

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        req.add_header("Accept", "application/json")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                payload = json.loads(exc.read() or b"{}")
            except ValueError:
                payload = {}
            error = payload.get("error") or exc.reason
            raise AdminError(exc.code, error, payload.get("detail")) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise LaminarError(f"cannot reach the admin API at {self.url}: {reason}") from None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, body)

    def put(self, path: str, body: Any) -> Any:
        return self.request("PUT", path, body)


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
        "version",
        "KV",
        "run/wait/flight",
        "address",
        "pid",
        "last heartbeat",
        "incarnation",
        "reason",
    ):
        table.add_column(column)
    for m in sorted(status.members, key=lambda m: (m.role != "manager", m.role, m.instance)):
        age = status.now - m.last_seen
        s = parse_stats(m.role, m.stats)  # None before its first heartbeat: blank, not zeros
        state = f"[{_STATE_STYLE.get(m.state, '')}]{m.state}[/]"
        if isinstance(s, RolloutStats) and m.state == "alive":
            state += f" [{_PHASE_STYLE.get(s.phase, '')}]{s.phase}[/]"
        version = str(s.version) if isinstance(s, VersionedStats) else ""
        kv = load = ""
        if isinstance(s, RolloutStats):
            kv = f"{s.kv_cache_usage * 100:.1f}%"
            load = f"{s.running}/{s.waiting}/{s.in_flight}"
        table.add_row(
            m.instance,
            m.role,
            state,
            version,
            kv,
            load,
            m.address,
            str(m.pid) if m.pid else "",
            f"{age:.1f} s ago",
            str(m.incarnation),
            m.reason,
        )
    return table


def render_admin_summary(s: dict[str, Any]) -> str:
    """A few lines from ``GET /v1/status`` that the membership table does not show."""
    lines = []
    trainer = s.get("trainer")
    st = s.get("staleness") or {}
    if trainer:
        lines.append(
            f"trainer {trainer['id']}: version {trainer['version']}, published "
            f"{trainer['published']}, max staleness trained {trainer['max_staleness']}"
        )
    versions = st.get("rollout_versions") or []
    if versions:
        lag = st.get("max_lag")
        lines.append(
            "rollout versions: " + ", ".join(map(str, versions))
            + (f" (max lag {lag})" if lag is not None else "")
        )  # fmt: skip
    data = s.get("data")
    if data:
        lines.append(
            f"data: {data['queued']} queued, {data['leased']} leased, "
            f"{data['trajectories'] - data['consumed']} ready, {data['consumed']} consumed, "
            f"{data['evicted']} evicted"
        )
    chain = s.get("chain") or {}
    if chain.get("order"):
        lines.append(f"relay chain (epoch {chain['epoch']}): " + " -> ".join(chain["order"]))
    lines.append("repack policy: " + render_policy(s["repack_policy"]))
    for role, error in (s.get("errors") or {}).items():
        lines.append(f"[yellow]{role} did not answer: {error}[/]")
    return "\n".join(lines)


def render_policy(p: dict[str, Any]) -> str:
    return (
        f"{'enabled' if p['enabled'] else 'disabled'}, period {p['period_s']} s, "
        f"c_max {p['c_max']}, batch_limit {p['batch_limit']}, "
        f"on_publish {'yes' if p['on_publish'] else 'no'}"
    )


def render_plan(view: dict[str, Any]) -> Table:
    plan = view["plan"]
    table = Table(title=f"repack plan (dry run): {len(plan['moves'])} moves", title_justify="left")
    for column in ("rollout", "version", "KV", "prev KV", "in flight", "waiting", "draining",
                   "accepting", "move"):  # fmt: skip
        table.add_column(column)
    moves = {m["source"]: m["destination"] for m in plan["moves"]}
    targets = {m["destination"] for m in plan["moves"]}
    for load in view["loads"]:
        rid = load["rollout"]
        move = f"-> {moves[rid]}" if rid in moves else ("destination" if rid in targets else "")
        table.add_row(
            rid,
            str(load["version"]),
            f"{load['kv_used'] * 100:.1f}%",
            f"{load['kv_prev'] * 100:.1f}%",
            str(load["n_reqs"]),
            str(load["waiting"]),
            "yes" if load["draining"] else "",
            "yes" if load["accepting"] else "no",
            move,
        )
    return table


def render_outcome(o: dict[str, Any]) -> str:
    moves = o["plan"]["moves"]
    lines = [
        f"repack #{o['id']} ({o['reason']}): {len(moves)} moves, {o['moved']} trajectories "
        f"moved, released {', '.join(o['released']) or 'none'}, overhead {o['overhead_s']:.3f} s"
    ]
    for r in o.get("reports", []):
        lines.append(
            f"  {r['source']} -> {r['destination']} (v{r['version']}): {len(r['moved'])} moved, "
            f"{len(r['returned'])} returned, mode {r['mode']}, {r['total_s']:.3f} s"
            + (f", error: {r['error']}" if r["error"] else "")
        )
    for e in o.get("errors", []):
        lines.append(f"  [red]error: {e}[/]")
    return "\n".join(lines)
