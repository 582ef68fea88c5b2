"""What a failed role's exit says, and when a failure ends the run (``laminar.proc.exits``,
``laminar.proc.restart``, the supervisor's verdict).

The error-line rule is checked here on what a vLLM rollout printed when its engine refused the
model's head size (its worker's, engine core's and own tracebacks interleaved, recorded from
``laminar run``), the repeat rule exit by exit. What real interpreters print, and a real child
whose last words are written just before it exits, are ``tests/integration/test_run_exits.py``.
"""

from __future__ import annotations

import signal
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from laminar.devmode.supervisor import Supervisor
from laminar.proc.children import Child
from laminar.proc.exits import EX_CONFIG, OOM_WORDS, Exit, OomCounter, OutputTail, error_line
from laminar.proc.restart import EARLY_S, decide, repeats
from laminar.runtime.config import RoleSpec, load_config
from tests.support.devrun import write_run_config
from tests.support.procs import ROOT

FAILING = f"{ROOT / 'tests' / 'support' / 'failing_roles.py'}:Failing"


# -- the error line, on real output ----------------------------------------------------------------


#: What a vLLM rollout printed when its model's head size (40) was one vLLM's CPU attention
#: refuses (``laminar run``, vLLM 0.32, abridged: frames cut, the lines in their order): the
#: worker's root cause, the engine core's wrapper, the rollout's own EngineDeadError (twice: in
#: vLLM's log and in the task group's traceback), interleaved shutdown lines, a warning last.
VLLM_HEAD_SIZE = r"""
(Worker pid=22100) ERROR 12-02 01:56:05 [multiproc_executor.py:1063] WorkerProc hit an exception.
(Worker pid=22100) ERROR 12-02 01:56:05 [multiproc_executor.py:1063] Traceback (most recent call last):
(Worker pid=22100) ERROR 12-02 01:56:05 [multiproc_executor.py:1063]   File "/v/vllm/v1/executor/multiproc_executor.py", line 1055, in _execute_worker_rpc
(Worker pid=22100) ERROR 12-02 01:56:05 [multiproc_executor.py:1063]     output = func(*args, **kwargs)
(EngineCore pid=22036) WARNING 12-02 01:56:05 [torch_utils.py:283] OMP_NUM_THREADS=2 is set
(Worker pid=22100) ERROR 12-02 01:56:05 [multiproc_executor.py:1063]   File "/v/torch/_ops.py", line 1279, in __call__
(Worker pid=22100) ERROR 12-02 01:56:05 [multiproc_executor.py:1063]     return self._op(*args, **kwargs)
(Worker pid=22100) ERROR 12-02 01:56:05 [multiproc_executor.py:1063]            ^^^^^^^^^^^^^^^^^^^^^^^^^
(Worker pid=22100) ERROR 12-02 01:56:05 [multiproc_executor.py:1063] RuntimeError: Unsupported CPU attention configuration: head_dim=40 isa=1 kv_cache_idx=0
(Worker pid=22100) ERROR 12-02 01:56:05 [multiproc_executor.py:1063]
(EngineCore pid=22036) ERROR 12-02 01:56:05 [dump_input.py:81] Dumping scheduler stats: SchedulerStats(num_running_reqs=1, num_waiting_reqs=0)
(EngineCore pid=22036) ERROR 12-02 01:56:05 [core.py:1512] EngineCore encountered a fatal error.
(EngineCore pid=22036) ERROR 12-02 01:56:05 [core.py:1512] Traceback (most recent call last):
(EngineCore pid=22036) ERROR 12-02 01:56:05 [core.py:1512]   File "/v/vllm/v1/engine/core.py", line 1496, in run_engine_core
(EngineCore pid=22036) ERROR 12-02 01:56:05 [core.py:1512]     engine_core.run_busy_loop()
(EngineCore pid=22036) ERROR 12-02 01:56:05 [core.py:1512]   File "/v/vllm/v1/executor/multiproc_executor.py", line 444, in get_response
(EngineCore pid=22036) ERROR 12-02 01:56:05 [core.py:1512]     raise RuntimeError(
(EngineCore pid=22036) ERROR 12-02 01:56:05 [core.py:1512] RuntimeError: Worker failed with error 'Unsupported CPU attention configuration: head_dim=40 isa=1 kv_cache_idx=0', please check the stack trace above for the root cause
(MainProcess pid=21857) ERROR 12-02 01:56:05 [async_llm.py:906] AsyncLLM output_handler failed.
(MainProcess pid=21857) ERROR 12-02 01:56:05 [async_llm.py:906] Traceback (most recent call last):
(MainProcess pid=21857) ERROR 12-02 01:56:05 [async_llm.py:906]   File "/v/vllm/v1/engine/core_client.py", line 1235, in get_output_async
(MainProcess pid=21857) ERROR 12-02 01:56:05 [async_llm.py:906]     raise self._format_exception(outputs) from None
(MainProcess pid=21857) ERROR 12-02 01:56:05 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
  + Exception Group Traceback (most recent call last):
  |   File "/work/main/laminar/cli/serve.py", line 81, in cmd_serve
  |     loop_runner(host.run())
  |   File "/py/asyncio/taskgroups.py", line 145, in __aexit__
(EngineCore pid=22036) INFO 12-02 01:56:05 [multiproc_executor.py:479] [shutdown] Executor: waiting for worker exit count=1
(Worker pid=22100) INFO 12-02 01:56:05 [multiproc_executor.py:843] Parent process exited, terminating worker queues
  |     raise me from None
  | ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception)
  +-+---------------- 1 ----------------
    | Traceback (most recent call last):
    |   File "/work/main/laminar/runtime/service.py", line 213, in run
    |     await service.on_start()
    |   File "/v/vllm/v1/engine/core_client.py", line 1235, in get_output_async
    |     raise self._format_exception(outputs) from None
    | vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.
    +------------------------------------
(MainProcess pid=21857) INFO 12-02 01:56:05 [utils.py:628] [shutdown] Process manager: send sigterm to process EngineCore
/py/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be 1 leaked shared_memory objects to clean up at shutdown
  warnings.warn('resource_tracker: There appear to be %d '
""".strip().splitlines()


def test_a_vllm_rollout_gives_its_workers_root_cause() -> None:
    assert error_line(VLLM_HEAD_SIZE) == (
        "RuntimeError: Unsupported CPU attention configuration: head_dim=40 isa=1 kv_cache_idx=0"
    )


def test_only_pointers_left_give_the_last_pointer() -> None:
    """The worker's lines fell out of the tail: the wrapper that quotes it is the next best."""
    rest = [line for line in VLLM_HEAD_SIZE if "Worker pid" not in line]
    assert error_line(rest) == (
        "RuntimeError: Worker failed with error 'Unsupported CPU attention configuration: "
        "head_dim=40 isa=1 kv_cache_idx=0', please check the stack trace above for the root cause"
    )


def test_the_tail_is_bounded_in_lines_and_characters() -> None:
    tail = OutputTail(lines=5, chars=100)
    for i in range(20):
        tail.add(f"line {i}")
    assert tail.lines() == [f"line {i}" for i in range(15, 20)]
    tail.add("x" * 80)
    assert tail.lines() == ["line 18", "line 19", "x" * 80]  # 7 + 7 + 80 <= 100 < 3 * 7 + 80
    tail.add("y" * 150)  # alone over the bound: kept, as the one line there is
    assert tail.lines() == ["y" * 150]


def test_a_killed_process_has_no_error_line_even_with_an_old_traceback() -> None:
    tail = OutputTail()
    for line in ["Traceback (most recent call last):", '  File "x.py"', "ValueError: old"]:
        tail.add(line)
    assert tail.error_line(-signal.SIGKILL) is None
    assert tail.error_line(-signal.SIGTERM) is None
    assert tail.error_line(1) == "ValueError: old"
    assert tail.error_line(-signal.SIGABRT) == "ValueError: old"


# -- OOM kills -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entries", "file", "text"),
    [
        ("0::/user.slice/run-1.scope\n", "user.slice/run-1.scope/memory.events",
         "low 0\nhigh 0\nmax 4\noom 1\noom_kill {}\noom_group_kill 0\n"),
        ("1:name=systemd:/\n0::/job/7\n", "unified/job/7/memory.events", "oom 0\noom_kill {}\n"),
        ("4:memory:/process_api/abc\n3:cpuset:/\n0::/\n",
         "memory/process_api/abc/memory.oom_control",
         "oom_kill_disable 0\nunder_oom 0\noom_kill {}\n"),
    ],
    ids=["v2", "hybrid-v2", "v1"],
)  # fmt: skip
def test_the_oom_kill_count_is_read_from_the_memory_cgroup(
    tmp_path: Path, entries: str, file: str, text: str
) -> None:
    path = tmp_path / file
    path.parent.mkdir(parents=True)
    path.write_text(text.format(2))
    counter = OomCounter.from_entries(entries, root=tmp_path)
    assert counter is not None and counter.path == path and counter.start == 2
    assert counter.rose() is False
    path.write_text(text.format(3))
    assert counter.rose() is True
    path.unlink()
    assert counter.rose() is None


def test_no_readable_counter_means_unknown(tmp_path: Path) -> None:
    assert OomCounter.from_entries("0::/gone\n4:memory:/gone\n", root=tmp_path) is None
    assert OomCounter.of(pid=2**22 + 1) is None  # no such process


def test_a_sigkill_is_said_as_an_oom_kill_only_when_the_count_rose() -> None:
    kill = -signal.SIGKILL
    assert Exit(kill, oom=True).words() == f"signal 9 (SIGKILL): {OOM_WORDS}"
    assert Exit(kill, oom=False).words() == "signal 9 (SIGKILL)"
    assert Exit(kill, oom=False).hint() is None
    unknown = Exit(kill, oom=None)
    assert unknown.words() == "signal 9 (SIGKILL)" and "OOM killer may have" in str(unknown.hint())
    engine = Exit(1, error="EngineDeadError: EngineCore encountered an issue.", oom=True)
    assert "OOM killer killed a process of its memory cgroup meanwhile" in engine.words()
    assert Exit(0, oom=True).words() == "code 0"


# -- the repeat rule -------------------------------------------------------------------------------


def child(restart: str = "on-failure", max_restarts: int = 3) -> Child:
    spec = RoleSpec(role="rollout", restart=restart, max_restarts=max_restarts)  # type: ignore[arg-type]
    return Child("rollout-0", "rollout", "rollout", spec, "cyan")


def run_exits(c: Child, exits: list[Exit]) -> tuple[list[bool], list[str]]:
    said: list[str] = []
    decisions = [decide(c, e, lambda message, style="": said.append(message)) for e in exits]
    return decisions, said


HEAD = "RuntimeError: Unsupported CPU attention configuration: head_dim=40 (pid {})"


def test_the_same_failure_at_start_twice_ends_it_with_the_reason() -> None:
    c = child()
    decisions, said = run_exits(c, [Exit(1, HEAD.format(101)), Exit(1, HEAD.format(202))])
    assert decisions == [True, False]
    assert said[0] == f"rollout-0 exited with code 1: {HEAD.format(101)}; restarting (1/3)"
    assert said[1] == (
        f"rollout-0 exited with code 1: {HEAD.format(202)}; not restarting: it failed the same "
        "way twice in a row, before it was ready (a restart would fail again)"
    )
    assert c.fatal == "rollout-0 fails the same way at every start"
    assert c.dead == f"exited with code 1: {HEAD.format(202)}"


def test_a_late_first_failure_then_the_same_one_soon_after_a_restart_ends_it() -> None:
    """A rollout that dies at its first weight update (minutes in), then again seconds after
    its restart became ready (the update was waiting for it)."""
    c = child()
    exits = [Exit(1, "KeyError: lm_head", ready_s=600.0), Exit(1, "KeyError: lm_head", ready_s=2.0)]
    decisions, said = run_exits(c, exits)
    assert decisions == [True, False]
    assert "twice in a row, 2 s after it was ready" in said[1] and c.fatal is not None


@pytest.mark.parametrize(
    "second",
    [
        Exit(1, "KeyError: lm_head", ready_s=EARLY_S + 1),  # it ran a while: worth another go
        Exit(1, "KeyError: embed_tokens"),  # another reason
        Exit(2, "KeyError: lm_head"),  # another status
        Exit(1, None),  # no reason known
    ],
    ids=["late", "other-reason", "other-status", "no-reason"],
)
def test_failures_not_the_same_at_start_are_restarted(second: Exit) -> None:
    c = child()
    decisions, _ = run_exits(c, [Exit(1, "KeyError: lm_head"), second])
    assert decisions == [True, True] and c.fatal is None and c.dead is None


def test_kills_without_an_oom_count_are_restarted_until_max_restarts() -> None:
    c = child(max_restarts=2)
    kill = Exit(-signal.SIGKILL, oom=False)
    decisions, said = run_exits(c, [kill, kill, kill])
    assert decisions == [True, True, False]
    assert said[-1] == (
        "rollout-0 exited with signal 9 (SIGKILL); not restarting (policy on-failure, 2 restarts)"
    )
    assert c.fatal is None and c.dead == "exited with signal 9 (SIGKILL)"


def test_two_oom_kills_in_a_row_at_start_end_it() -> None:
    c = child()
    decisions, said = run_exits(c, [Exit(-signal.SIGKILL, oom=True)] * 2)
    assert decisions == [True, False] and OOM_WORDS in said[1] and c.fatal is not None


def test_a_refused_configuration_ends_it_at_once_whatever_the_policy() -> None:
    c = child(restart="always")
    line = "laminar serve: prompts.jsonl: record 1: prompt id 'a/b' must not contain '/'"
    decisions, said = run_exits(c, [Exit(EX_CONFIG, line)])
    assert decisions == [False] and c.restarts == 0
    assert said == [
        f"rollout-0 exited with code 78: {line}; not restarting: its configuration was refused "
        "(a restart would be refused the same way)"
    ]
    assert c.fatal == "rollout-0's configuration was refused"


def test_a_clean_exit_in_between_breaks_the_series() -> None:
    c = child(restart="always")
    decisions, _ = run_exits(c, [Exit(1, "E: x"), Exit(0), Exit(1, "E: x")])
    assert decisions == [True, True, True] and c.fatal is None


@given(
    # not a clean exit, not a refused configuration, not SIGKILL (whose words are never the
    # child's own: without an OOM count it has no reason, so it never repeats)
    code=st.integers(-64, 255).filter(lambda c: c not in (0, EX_CONFIG, -9)),
    words=st.text(st.characters(codec="ascii", exclude_categories=("Cc",)), min_size=1),
    first=st.integers(0, 10**9),
    second=st.integers(0, 10**9),
    ready_s=st.one_of(st.none(), st.floats(0, EARLY_S - 0.001)),
)
def test_numbers_alone_never_make_two_failures_differ(
    code: int, words: str, first: int, second: int, ready_s: float | None
) -> None:
    a = Exit(code, f"E: {words} {first}")
    b = Exit(code, f"E: {words} {second}", ready_s=ready_s)
    assert repeats(a, b)
    assert not repeats(a, Exit(code, f"E: {words}! {second}", ready_s=ready_s))


# -- the supervisor's verdict ----------------------------------------------------------------------


def supervisor(tmp_path: Path, roles: list[dict[str, Any]]) -> tuple[Supervisor, StringIO]:
    """A supervisor of ``roles`` beside the manager (nothing started), and its console."""
    out = StringIO()
    config = load_config(str(write_run_config(tmp_path, roles)), [])
    sup = Supervisor(config, [], Console(file=out, width=400, highlight=False))
    return sup, out


def lines_of(out: StringIO) -> list[str]:
    return out.getvalue().splitlines()


def given_up(c: Child, dead: str | None, fatal: str | None = None) -> Child:
    c.dead, c.fatal, c.done = dead, fatal, True
    return c


def test_losing_one_of_two_instances_goes_on_and_fails_the_run(tmp_path: Path) -> None:
    sup, out = supervisor(tmp_path, [{"role": FAILING, "count": 2}])
    bad = sup.children[1]
    sup._gave_up(given_up(bad, "exited with code 1: RuntimeError: x"))
    assert not sup.stopping.is_set() and sup.exit_code == 1 and sup.ended is None
    assert lines_of(out) == [
        "supervisor | the run goes on without failing-0 (1 of 2 "
        f"{FAILING} instances left); it will end with status 1"
    ]
    sup._verdict()
    assert lines_of(out)[-2:] == [
        "supervisor | failing-0 ended dead: exited with code 1: RuntimeError: x",
        "supervisor | run failed (exit status 1): 1 role instance(s) ended dead",
    ]


def test_losing_every_instance_of_a_role_ends_the_run(tmp_path: Path) -> None:
    sup, out = supervisor(tmp_path, [{"role": FAILING, "count": 2}])
    for c in sup.children[1:]:
        sup._gave_up(given_up(c, "exited with code 1"))
    assert sup.stopping.is_set() and sup.exit_code == 1
    assert sup.ended == f"no {FAILING} instance left (failing-0, failing-1 ended dead)"
    assert lines_of(out)[-1] == f"supervisor | ending the run: {sup.ended}"


def test_a_fatal_failure_ends_the_run_and_a_clean_end_does_not(tmp_path: Path) -> None:
    sup, _ = supervisor(tmp_path, [{"role": FAILING, "count": 2}])
    first, second = sup.children[1:]
    sup._gave_up(given_up(first, None))  # exited 0, not restarted: nothing lost
    assert not sup.stopping.is_set() and sup.exit_code == 0
    sup._gave_up(given_up(second, "exited with code 78", "failing-1's configuration was refused"))
    assert sup.stopping.is_set() and sup.exit_code == 1
    assert sup.ended == "failing-1's configuration was refused"


def test_the_manager_given_up_ends_the_run(tmp_path: Path) -> None:
    sup, _ = supervisor(tmp_path, [])
    sup._gave_up(given_up(sup.children[0], None))
    assert sup.stopping.is_set() and sup.exit_code == 1
    assert sup.ended == "the manager (manager-0) ended"


# -- a real child: its last words are read before the decision -------------------------------------
