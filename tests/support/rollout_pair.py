"""A vLLM process cluster handed from one slow test to the next (see tests/slow/conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from laminar.harness.launch import ProcessCluster


@dataclass
class RolloutPair:
    """A process cluster with two vLLM rollouts, started by the repack test and handed on.

    The repack test needs manager + data + two rollouts; the orphan test needs one rollout to
    kill with -9. The repack test leaves its cluster here (``keep``); the orphan test, when it
    finds one whose ``rollout-a`` is alive, kills that rollout and shuts the cluster down, and
    otherwise starts a one-rollout cluster of its own (run alone, or before the repack test).
    Whatever is left is shut down at the end of the session.
    """

    clusters: list[ProcessCluster] = field(default_factory=list)

    def keep(self, cluster: ProcessCluster) -> None:
        self.clusters.append(cluster)

    def take(self, rollout: str) -> ProcessCluster | None:
        """A kept cluster whose ``rollout`` runs (now the caller's to shut down), or None."""
        for cluster in self.clusters:
            proc = cluster.procs.get(rollout)
            if proc is not None and proc.poll() is None:
                self.clusters.remove(cluster)
                return cluster
        return None
