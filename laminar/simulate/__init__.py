"""``laminar simulate``: the paper's scale on one machine, on cost models instead of GPUs.

Built so far (issue 18, in progress):

* :mod:`.costs`: decode roofline (within 10% of the paper's Fig. 4), prefill, training, the
  relay chain (within 13% of Fig. 18), KV transfer;
* :mod:`.engine`: the closed-form rollout engine (continuous batching with KV capacity,
  watermark and preemption, event to event; equal to a token-by-token loop);
* :mod:`.workload`: the paper's batch, response lengths (Fig. 17) and placements (Table 2);
* :mod:`.batches`: verl, one-step, stream generation and RollPacker's tail batching;
* :mod:`.continuous`: AReaL's partial rollout and Laminar (relay chain, trajectory-level
  versions, repack with the real Algorithm 1 planner);
* :mod:`.cells`: one cell's tokens/s, the paper's metric.

Not yet: the CLI (``laminar simulate sweep|run``), the figure, calibration against the paper's
numbers and against ``benchmarks/schedules.py``, RollMux.
"""
