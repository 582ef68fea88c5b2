"""``laminar simulate``: the paper's scale on one machine, on cost models instead of GPUs.

* :mod:`.costs`: what GPU work costs (decode roofline, prefill, training, the relay chain, KV
  transfer), from the paper and first principles;
* :mod:`.engine`: the closed-form rollout engine (continuous batching with KV capacity,
  watermark and preemption, event to event);
* :mod:`.workload`: the paper's batch, response lengths (Fig. 17) and placements (Table 2);
* :mod:`.batches` and :mod:`.continuous`: the systems' schedules (verl, one-step, stream
  generation, RollPacker's tail batching; AReaL's partial rollout and Laminar);
* :mod:`.cells` and :mod:`.sweep`: one cell's tokens/s, the paper's metric, and the sweep;
* :mod:`.cluster` and :mod:`.measure`: ``simulate run``, a config's real roles on virtual time;
* :mod:`.multiplex`: RollMux's two jobs on one pair of pools.

How to run it and how it compares with the paper: docs/simulate.md.
"""
