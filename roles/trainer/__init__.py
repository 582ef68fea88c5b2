"""The trainer role: RL updates on the policy, checkpoints, and new weight versions.

``service`` (the role), ``compute`` (one rank's torch work), ``dp`` (data-parallel ranks),
``checkpoint`` (atomic save/resume), ``config`` (settings).
"""
