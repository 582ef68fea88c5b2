"""The trainer role: RL updates on the policy, checkpoints, and new weight versions.

One loop (``loop``: batches, staleness, screening, checkpoint cadence, the schedule's publish
gate, records) runs either compute behind the ``step.Compute`` protocol: ``torch_compute`` (the
``trainer`` role, ``service``) or ``sim_compute`` (the emulated ``sim_trainer`` role, ``sim``).
``compute`` (one rank's torch work), ``dp`` (data-parallel ranks), ``checkpoint`` (atomic
save/resume), ``batches`` (gathering a batch from the data role), ``integrity`` (what was not
learnt from), ``config`` (settings).
"""
