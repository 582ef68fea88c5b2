"""Laminar roles: one service class per role (the names the runtime knows them by are in
``laminar.roles_registry.BUILTIN``)."""
