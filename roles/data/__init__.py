"""The data role: prompt pool, partial-response pool, experience buffer (see ``service``).

Its contract is :mod:`.api`. Nothing is imported here, so the reward worker
(:mod:`.reward_worker`, a process of its own) starts without the role's imports.
"""
