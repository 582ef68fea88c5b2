"""What the admin API and the status views may see of the manager: one small protocol.

Why: the admin server, the ``/v1/status`` assembly and the scrape-time gauges used to take the
whole ``ManagerService`` and read its private state (``_chain``), and importing it closed a cycle
(service -> admin -> cluster_view -> service). They now take a :class:`ManagerView`:

* the live state, read-only: the member table, the relay chain, the event log;
* the repack controller, the one thing they steer (policy, an operator's repack), which owns its
  own state and records every change on the event log;
* the runtime services they call through: the service context (peers, clock, metrics registry,
  cluster token, identity) and the logger.

``ManagerService`` implements it structurally (no base class), so this module imports nothing of
the service, and a test can hand the admin server any object with these attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from laminar.roles.manager.api import ChainView
from laminar.runtime.context import ServiceContext
from laminar.runtime.membership import Member

from .events import EventLog
from .repack import RepackController


class ManagerView(Protocol):
    @property
    def ctx(self) -> ServiceContext: ...

    @property
    def log(self) -> Any: ...

    @property
    def members(self) -> Mapping[str, Member]:
        """Every member the manager knows (alive, dead or left), by instance id."""
        ...

    @property
    def relay_chain(self) -> ChainView:
        """The relay chain as last planned."""
        ...

    @property
    def events(self) -> EventLog: ...

    @property
    def repack(self) -> RepackController: ...
