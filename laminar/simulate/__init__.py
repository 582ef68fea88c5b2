"""``laminar simulate``: the paper's scale on one machine, on cost models instead of GPUs.

Built so far: the cost models (:mod:`.costs`: decode roofline checked against the paper's Fig. 4,
prefill, training, the relay chain checked against Fig. 18) and the closed-form rollout engine
(:mod:`.engine`: continuous batching with KV capacity and preemption, event to event). The
systems (Laminar and the paper's baselines), the sweep and the CLI come next (issue 18).
"""
