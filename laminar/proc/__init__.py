"""Processes on one machine: how a role is started, watched and ended.

``spawn`` (the one launcher: a role's ``laminar serve`` command line, its environment, its ready
line, its output), ``children`` (a supervised child: restarts, exit codes), ``exitwait`` (seeing
its exit whatever holds its pipes), ``exits`` (what an exit says: the child's error line, an OOM
kill), ``restart`` (the policy both launchers share, and which failures end a run), ``procfs``
(finding a role's processes by their launch mark, ending a session), ``cpus`` (which cores each
role gets), ``linesplit`` (bounded line splitting of child output). Used by the dev mode
(:mod:`laminar.devmode`), the harnesses (:mod:`laminar.harness`) and the vLLM engine (whose
worker processes carry the marks). Imports nothing of the dev mode or the harnesses.
"""
