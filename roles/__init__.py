"""Laminar roles: one service class per role.

``BUILTIN`` maps role names to ``module:Class`` so the runtime can start a role by name without
importing every role (and its heavy dependencies) up front.
"""

BUILTIN: dict[str, str] = {
    "manager": "laminar.roles.manager.service:ManagerService",
    "data": "laminar.roles.data.service:DataService",
    "relay": "laminar.roles.relay:RelayService",
    "rollout": "laminar.roles.rollout.service:RolloutService",
    "trainer": "laminar.roles.trainer.service:TrainerService",
    "sim_trainer": "laminar.roles.trainer.sim:SimTrainerService",  # emulated (sleeps)
}
