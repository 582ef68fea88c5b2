"""laminar.proc.placement: ``give_way`` (every thread of the process, and what they start later)
and ``keep_off_bound_cores``, each in a child process: niceness cannot be lowered again without a
privilege, and the test runner's cores are not for a test to move. The pure parts are
``tests/unit/test_placement.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, os, subprocess, sys, threading
from laminar.proc.placement import give_way, niceness

os.setpriority(os.PRIO_PROCESS, 0, 2)  # this (main) thread starts at 2
ready, done = threading.Barrier(3), threading.Event()
tids = {}

def idle(name, nice=None):
    if nice is not None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    tids[name] = threading.get_native_id()
    ready.wait()
    done.wait()

before = threading.Thread(target=idle, args=("before",))
nicer = threading.Thread(target=idle, args=("nicer", 15))
before.start(); nicer.start(); ready.wait()
changed = give_way(int(sys.argv[1]))
ready = threading.Barrier(2)
after = threading.Thread(target=idle, args=("after",)); after.start(); ready.wait()
child = subprocess.run([sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
                       capture_output=True, text=True, check=True).stdout
done.set()
out = {name: niceness(tid) for name, tid in tids.items()}
out["main"] = niceness(threading.get_native_id())
out["changed"], out["process"] = changed, int(child)
print(json.dumps(out))
"""


def run_child(nice: int) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(nice)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    out: dict[str, int] = json.loads(done.stdout)
    return out


def test_every_thread_and_what_they_start_later_runs_at_least_that_nice() -> None:
    out = run_child(10)
    # main and "before" raised; "nicer" (15) left alone; a later thread and process inherit 10
    assert out == {
        "before": 10,
        "nicer": 15,
        "after": 10,
        "main": 10,
        "changed": 2,
        "process": 10,
    }


def test_a_nicer_process_is_never_made_less_nice() -> None:
    out = run_child(1)
    assert out["main"] == 2 and out["before"] == 2 and out["nicer"] == 15
    assert out["changed"] == 0


MOVER = r"""
import json, os, subprocess, sys, time
from laminar.proc.placement import keep_off_bound_cores, thread_ids

ours = sorted(os.sched_getaffinity(0))
first = ours[0]
sleeper = "import time; time.sleep(60)"
bound = subprocess.Popen([sys.executable, "-c",
    f"import os, time; os.sched_setaffinity(0, {{{first}}}); print(flush=True); time.sleep(60)"],
    stdout=subprocess.PIPE, text=True)
bound.stdout.readline()  # it has bound itself
free = subprocess.Popen([sys.executable, "-c", sleeper])
try:
    placed = keep_off_bound_cores()
    out = {
        "ours": ours,
        "spare": list(placed.cores),
        "bound_cores": list(placed.bound),
        "self": sorted({c for t in thread_ids() for c in os.sched_getaffinity(t)}),
        "free": sorted(os.sched_getaffinity(free.pid)),
        "bound": sorted(os.sched_getaffinity(bound.pid)),
        "first": first,
    }
finally:
    bound.kill(); free.kill(); bound.wait(); free.wait()
print(json.dumps(out))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to share out")
def test_a_role_moves_itself_and_its_unbound_processes_off_a_bound_child() -> None:
    done = subprocess.run([sys.executable, "-c", MOVER], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    rest = [c for c in out["ours"] if c != out["first"]]
    assert out["spare"] == rest and out["bound_cores"] == [out["first"]]
    assert out["self"] == rest and out["free"] == rest  # this process and the unbound child
    assert out["bound"] == [out["first"]]  # the bound child keeps its core
