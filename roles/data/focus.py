"""Focus: spend generation on the prompts the policy is still learning from.

Why: with group-relative advantages a group whose members all got the same reward teaches
nothing (``drop_constant_groups`` evicts it), but it was generated all the same. As RL goes on
more of the dataset becomes such groups: the easy prompts all right, the hard ones all wrong.
On the arithmetic example, within 4,000 groups most chain lengths' groups came
out constant nearly always (1-5 steps all right; on some seeds 7-12 steps all wrong), and the
trainer waited for the few informative ones while the rollouts generated the rest
(docs/benchmarks.md, *Learning*, for what focus changed there). Per-prompt pass rates (the usual
online difficulty filter) do not help a run that sees each prompt once or twice; a record field
that classes prompts (a difficulty, a chain length, a source dataset) does: its classes recur all
run long.

What: for each value of the record field ``key`` (a *class*), the outcomes of its last ``window``
complete groups (informative: the rewards differ; constant: they do not). A prompt drawn for the
queue is admitted with probability ``max(floor, (informative + 1) / (groups + 2))``, the
posterior mean of its class's informative rate under a uniform prior (a class with no complete
group yet is always admitted), else skipped: not queued in this epoch (with ``epochs: null`` it
comes back in the next), counted in ``skipped``. ``floor`` keeps every class sampled, so a class
that becomes learnable again (or is forgotten) is noticed. Held-out evaluation is untouched: this
changes which training prompts are generated, not what is measured.

This module is pure (no I/O, no clock): the store asks :meth:`Focus.admit` while it refills the
queue, and the experience buffer tells :meth:`Focus.observe` each complete group it consumes or
filters. The statistics live in memory: a restarted data role starts from "admit everything" and
relearns within ``window`` groups per class.
"""

from __future__ import annotations

import json
import random
from collections import deque
from collections.abc import Mapping
from typing import Any

#: the class of records that lack the key
MISSING = "<missing>"


class Focus:
    def __init__(self, key: str, *, window: int = 16, floor: float = 0.1, seed: int = 0) -> None:
        if window < 1:
            raise ValueError(f"focus window must be >= 1, got {window}")
        if not 0.0 < floor <= 1.0:
            raise ValueError(f"focus floor must be in (0, 1], got {floor}")
        self.key, self.window, self.floor, self.seed = key, window, floor, seed
        self._recent: dict[str, deque[bool]] = {}
        self.skipped = 0  # prompts drawn and not queued
        self.admitted = 0

    def class_of(self, record: Mapping[str, Any]) -> str:
        if self.key not in record:
            return MISSING
        value = record[self.key]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)

    def admit_probability(self, cls: str) -> float:
        """An unseen class: 1 (nothing says it is uninformative). Seen: the posterior mean of its
        informative rate over its last ``window`` groups (uniform prior), at least ``floor``."""
        recent = self._recent.get(cls)
        if not recent:
            return 1.0
        return max(self.floor, (sum(recent) + 1) / (len(recent) + 2))

    def admit(self, record: Mapping[str, Any], epoch: int, pos: int) -> bool:
        """Queue the prompt at ``pos`` of ``epoch``'s order? The draw is a function of the seed,
        the epoch and the position, so the same statistics make the same choice."""
        p = self.admit_probability(self.class_of(record))
        keep = p >= 1.0 or random.Random(f"{self.seed}:{epoch}:{pos}").random() < p
        if keep:
            self.admitted += 1
        else:
            self.skipped += 1
        return keep

    def observe(self, record: Mapping[str, Any], informative: bool) -> None:
        """A complete group of this record's prompt: informative iff its rewards differ."""
        cls = self.class_of(record)
        recent = self._recent.get(cls)
        if recent is None:
            recent = self._recent[cls] = deque(maxlen=self.window)
        recent.append(informative)

    def rates(self) -> dict[str, float]:
        """Each seen class's admit probability now (``status``), in a stable order."""
        return {cls: round(self.admit_probability(cls), 3) for cls in sorted(self._recent)}
