"""Planning the relay chain: who is master, who forwards to whom, and how it heals.

The manager owns the order; relays and the trainer follow it through a watch stream. The planning
rule is pure and deliberately boring, because it runs exactly when something just broke:

* survivors keep their relative order, so a dead relay is routed around by linking its upstream
  to its downstream (the paper's O(1) repair: relay1 -> relay3 when relay2 dies) and nobody else
  changes neighbours;
* a newly joined relay goes to the tail, where it disturbs no transfer in progress;
* the master is the head. When it dies the next relay becomes master; it already holds the newest
  version (or the prefix that reached it), and the trainer, told of the new head, resumes there.

A relay that was partway through receiving keeps its chunks: its new upstream resumes at the first
missing chunk (see ``transfer.py``).

Epochs count from 1 in each *incarnation* of the manager (a random id it picks at start), and a
view is newer than another when it comes from another incarnation or has a higher epoch. Why not
the epoch alone: a restarted manager counts from 1 again, and followers comparing epochs only
would ignore every view of the new manager until its count passed the old one, never routing
around a relay that died meanwhile. An incarnation has no order; the manager a follower can reach
is the one whose views count, so any view of a new incarnation is taken.
"""

from __future__ import annotations

from collections.abc import Sequence

from .api import RelayInfo


def plan_chain(previous: Sequence[RelayInfo], alive: Sequence[RelayInfo]) -> list[RelayInfo]:
    """The new order: survivors of ``previous`` in their order, then newcomers in given order."""
    by_id = {r.instance: r for r in alive}
    kept = [by_id[r.instance] for r in previous if r.instance in by_id]
    seen = {r.instance for r in kept}
    return kept + [r for r in alive if r.instance not in seen]
