"""The single-node dev mode (``laminar run``) and ``laminar status``: what a person watches.

``supervisor`` (every role on the local machine, restarted when it dies), ``rundir`` (the run
directory), ``runview`` and ``progress`` (the live progress line and its records), ``plots``
(curves and timelines as PNG), ``status`` (the cluster table). Roles never import this package.
"""

#: A child's output lines worth showing on the console even when children's output goes only to
#: their log files (the local supervisor's ``lines`` display; the Ray launcher passes them on).
ALARMS = ("Traceback", "[error", "[critical", "Error:", "error:", "event loop blocked")
