"""The simulator example's task: a reward for sim-engine output.

The sim engine emits hashed token ids, not answers, so no reward can mean anything here; this one
is cheap and deterministic and gives groups differing rewards (so a ``drop_constant_groups``
filter drops few). Throughput, staleness and trainer load do not depend on its values.
"""

from __future__ import annotations


def reward(record: dict, response: str) -> float:
    return float(len(response) % 7) / 7.0
