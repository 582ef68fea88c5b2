"""The chaos benchmark's figures from what the run left: samples, trainer records, the store, logs.

See :mod:`chaos_measure` for the throughput windows and the accounting; this module puts them
together per fault and over the run, decides ``stuck``, and prints and plots the result.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from chaos_cluster import Incarnation
from chaos_measure import (
    Samples,
    account,
    generation_counters,
    rate,
    read_records,
    recovery,
    timeline,
    training_counter,
)

GOAL_RECOVERY_S = 30.0
GOAL_REPAIR_S = 1.0


@dataclass
class Run:
    """What a run left, as ``raw.json`` keeps it (so a run can be analysed again later)."""

    raw: dict[str, Any]
    samples: Samples
    history: dict[str, list[Incarnation]]
    roles: dict[str, str]  # instance -> role

    @classmethod
    def load(cls, raw: dict[str, Any]) -> Run:
        s = raw["samples"]
        samples = Samples(s["members"], s["chain"], s["data"], s["rss"], s["errors"])
        history = {n: [Incarnation(**i) for i in incs] for n, incs in raw["history"].items()}
        return cls(raw, samples, history, raw["roles"])

    def current(self, name: str) -> Incarnation | None:
        return self.history[name][-1] if self.history[name] else None


def analyse(args: argparse.Namespace, raw: dict[str, Any], workdir: Path) -> dict[str, Any]:
    run = Run.load(raw)
    samples = run.samples
    records = read_records(workdir / "trainer.jsonl")
    t0, end = raw["t0"], raw["end"]
    grid = np.arange(t0, end, 0.25)  # samples start at t0 (the roles are ready)
    ready = {inc.pid: inc.ready for incs in run.history.values() for inc in incs if inc.ready}
    per_rollout = generation_counters(samples, ready, grid)
    gen = sum(per_rollout.values(), np.zeros_like(grid))
    train = training_counter(records, grid)

    # the level the cluster settled at before the first fault: a fault whose own pre-fault level
    # is well below it struck while the previous one was still being recovered from
    warm = t0 + args.warmup
    baseline = {
        "gen": rate(grid, gen, warm - args.pre_s, warm),
        "train": rate(grid, train, warm - args.pre_s, warm),
    }
    faults = raw["faults"]
    rows = []
    for i, f in enumerate(faults):
        if f.get("skipped"):
            rows.append({"fault": f["fault"], "target": None, "skipped": f["skipped"]})
            continue
        until = faults[i + 1]["at"] if i + 1 < len(faults) else end
        row = _fault_row(args, f, until, grid, gen, train, run, records, per_rollout)
        for key in ("gen", "train"):
            if baseline[key] > 0 and row[f"{key}_pre"] is not None:
                share = row[f"{key}_pre"] / baseline[key]
                row[f"{key}_pre_vs_baseline"] = round(share, 3)
                if share < 0.9:
                    row.setdefault("notes", []).append(
                        f"{key} pre-fault level {share:.0%} of the baseline: the previous fault "
                        "was not recovered from yet"
                    )
        rows.append(row)
    repairs = [
        r.get("relay_repair_s")
        for r in rows
        if r["fault"] in ("relay", "master_relay") and not r.get("skipped")
    ]
    recoveries: list[float | None] = []
    unrecovered = []
    for r in rows:
        if r.get("skipped"):
            continue
        for key in ("gen_recovery_s", "train_recovery_s"):
            recoveries.append(r[key])
            if r[key] is None:
                unrecovered.append(f"{r['fault']}:{key}")
    acc = account(Path(workdir / "data.sqlite"), records)
    events = acc.pop("events")
    # a trajectory trained again by a restarted trainer is the restart's doing, however late
    starts = [inc.started for inc in run.history.get("trainer", [])[1:]]

    def cause(t: float) -> float:
        return max((s for s in starts if s <= t), default=t)

    for i, row in enumerate(rows):  # what each fault cost, up to the next one
        if row.get("skipped"):
            continue
        since = faults[i]["at"]
        until = faults[i + 1]["at"] if i + 1 < len(faults) else float("inf")
        row["failed"] = sum(1 for t in events["failed_at"] if since <= t < until)
        row["trained_again"] = sum(
            n for t, n in events["trained_again"] if since <= cause(t) < until
        )
    stuck = _stuck(args, run, records, end)
    crashes = [
        {"role": name, "pid": inc.pid, "code": inc.code, "at_s": round(inc.exited - t0, 1)}
        for name, incs in run.history.items()
        for inc in incs
        if inc.exited is not None and not inc.planned
    ]
    relay_repair = None if not repairs or None in repairs else max(repairs)
    max_rec = None if not recoveries or None in recoveries else max(recoveries)  # type: ignore
    report: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "workdir")},
        "network": raw["network"],
        "hosts": raw["hosts"],
        "startup_s": round(raw.get("startup_s", 0.0), 1),
        "baseline_tokens_per_s": {k: round(v, 1) for k, v in baseline.items()},
        "lost": acc["lost"],
        "duplicated": acc["duplicated"],
        "stuck": len(stuck),
        "relay_repair_s": relay_repair,
        "max_recovery_s": max_rec,
        "unrecovered": unrecovered,
        "faults": rows,
        "stuck_roles": stuck,
        "crashes": crashes,
        "restart_failures": raw["failures"],
        "accounting": acc,
        "exit_codes": raw["codes"],
        "versions_trained": len(records),
        "sample_errors": samples.errors,
        "log_alarms": _alarms(workdir / "logs"),
    }
    report["goals"] = {  # None: not measured in this run (no such fault)
        "lost == 0": acc["lost"] == 0,
        "duplicated == 0": acc["duplicated"] == 0,
        "stuck == 0": not stuck,
        "relay repair < 1 s": (relay_repair is not None and relay_repair < GOAL_REPAIR_S)
        if repairs
        else None,
        "recoveries < 30 s": (max_rec is not None and max_rec < GOAL_RECOVERY_S)
        if recoveries
        else None,
    }
    step = 4  # one point a second
    report["series"] = {
        "t": [round(float(t - t0), 2) for t in grid[::step]],
        "gen_tokens_per_s": timeline(grid, gen, args.window_s)[::step],
        "train_tokens_per_s": timeline(grid, train, args.window_s)[::step],
        "faults": [
            {"fault": f["fault"], "t": round(f["at"] - t0, 2)}
            | ({"until": round(f["restored_at"] - t0, 2)} if "restored_at" in f else {})
            for f in faults
        ],
        "gen_tokens": [round(float(x)) for x in gen[::step]],  # cumulative: other windows
        "train_tokens": [round(float(x)) for x in train[::step]],
        "rollout_tokens": {n: [round(float(x)) for x in c[::step]] for n, c in per_rollout.items()},
    }
    report["rss"] = _rss_growth(samples.rss, run, soak=bool(args.soak))
    return report


def _fault_row(args, f, until, grid, gen, train, run, records, per_rollout) -> dict[str, Any]:
    at, samples, raw = f["at"], run.samples, run.raw
    g = recovery(grid, gen, at, until, pre_s=args.pre_s, window_s=args.window_s)
    t = recovery(grid, train, at, until, pre_s=args.pre_s, window_s=args.window_s)
    row: dict[str, Any] = {"fault": f["fault"], "target": f["target"]}
    row["at_s"] = round(at - raw["t0"], 1)
    row["at"] = time.strftime("%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}Z"
    row |= {"gen_pre": g["pre"], "gen_min_ratio": g["min_ratio"], "gen_recovery_s": g["recovery_s"]}
    row |= {"train_pre": t["pre"], "train_min_ratio": t["min_ratio"]}
    row["train_recovery_s"] = t["recovery_s"]
    name = f["target"]
    if f["fault"] == "partition":
        row["cut_s"] = round(f["restored_at"] - at, 2)
    else:
        later = [inc for inc in run.history[name] if inc.started >= at and inc.ready]
        row["back_s"] = round(later[0].ready - at, 2) if later else None
    if f["fault"] != "manager":
        row["detected_s"] = _detected(samples, name, f.get("pid"), at)
    row["members_s"] = _members_back(run, f)
    if f["fault"] in ("rollout", "partition"):  # the victim's own rate at the end, against before
        own = per_rollout.get(name)
        if own is not None:
            before = rate(grid, own, at - args.pre_s, at)
            after = rate(grid, own, until - args.window_s, until)
            row["victim_ratio"] = round(after / before, 3) if before > 0 else None
    row["weights_s"], row["weights_missing"] = _weights(records, raw["loads"], at)
    if f["fault"] in ("relay", "master_relay"):
        row["relay_repair_s"] = f.get("repair_s")
        row["chain_before"] = f.get("chain_before")
        row["chain_after"] = f.get("chain_after")
    return row


def _detected(samples, name: str, pid: int | None, at: float) -> float | None:
    """First sample where the manager no longer has ``name`` alive with its old pid."""
    for t, view in samples.members:
        if t <= at:
            continue
        m = view.get(name)
        if m is None or m["state"] != "alive" or m["pid"] != pid:
            return round(t - at, 2)
    return None


def _members_back(run: Run, f: dict[str, Any]) -> float | None:
    """First sample after the fault (after the link is back, for a cut) where every role is a
    live member with the pid of a process that is running."""
    since = f.get("restored_at", f["at"])
    names = set(run.roles)
    for t, view in run.samples.members:
        if t <= since:
            continue
        ok = all(
            n in view
            and view[n]["state"] == "alive"
            and any(
                inc.pid == view[n]["pid"] and inc.ready and (inc.exited or 1e18) > t
                for inc in run.history[n]
            )
            for n in names
        )
        if ok and (f["fault"] == "partition" or view[f["target"]]["pid"] != f.get("pid")):
            return round(t - f["at"], 2)
    return None


def _weights(records, loads, at: float) -> tuple[float | None, list[str]]:
    """Time until every rollout loaded a version the trainer published after the fault."""
    after = [r for r in records if r.get("published_at", 0) > at]
    if not after:
        return None, ["no version published after the fault"]
    first = min(after, key=lambda r: r["published_at"])["version"]
    times, missing = [], []
    for name, history in loads.items():
        hit = [w["at"] for w in history or [] if w["at"] > at and w["version"] >= first]
        if hit:
            times.append(min(hit) - at)
        else:
            missing.append(name)
    return (round(max(times), 2) if times and not missing else None), missing


def _stuck(args, run: Run, records, end: float) -> list[dict[str, str]]:
    """Roles that are not running, not live members, or made no progress in the last window."""
    samples, raw = run.samples, run.raw
    since = end - args.stuck_window
    out = []
    last = samples.members[-1][1] if samples.members else {}
    recent = [(t, v) for t, v in samples.members if t >= since]
    trained = [r for r in records if r["train_end"] >= since]
    published = [r for r in records if r.get("published_at", 0) >= since - 5]
    for name, role in run.roles.items():
        inc = run.current(name)
        why = None
        if inc is None or inc.exited is not None or name in raw.get("restarting_at_end", []):
            why = "not running at the end"
        elif name not in last or last[name]["state"] != "alive" or last[name]["pid"] != inc.pid:
            got = last.get(name)
            why = f"not a live member at the end (manager has {got and (got['state'], got['pid'])})"
        elif role == "rollout":
            gens = [v[name]["gen"] for _, v in recent if name in v and v[name]["pid"] == inc.pid]
            gens = [g for g in gens if g is not None]
            if len(gens) < 2 or gens[-1] <= gens[0]:
                why = f"generated nothing in the last {args.stuck_window:g} s"
        elif role == "sim_trainer" and not trained:
            why = f"trained nothing in the last {args.stuck_window:g} s"
        elif role == "relay" and published:
            seen = raw["relay_received"].get(name) or {}
            if not any(t >= since - 5 for t in seen.values()):
                why = "received none of the versions published at the end"
        elif role == "data" and not any(t >= since for t, _ in samples.data):
            why = "its status did not answer at the end"
        if why:
            out.append({"role": name, "why": why})
    return out


def _rss_growth(rss, run: Run, soak: bool) -> dict[str, Any]:
    """Per role, over its longest-lived process: resident anonymous memory a minute after it was
    ready (the median of the next minute's samples) against the end (the median of its last
    three samples); resident memory as a whole beside it."""
    out: dict[str, Any] = {}
    end = rss[-1][0] if rss else 0.0
    for name, incs in run.history.items():
        spans = [(inc, (inc.exited or end) - (inc.ready or inc.started)) for inc in incs]
        if not spans:
            continue
        inc, _ = max(spans, key=lambda x: x[1])
        start = (inc.ready or inc.started) + 60.0
        series = [(t, _mem(s[name])) for t, s in rss if name in s and t >= start]
        series = [(t, v) for t, v in series if inc.exited is None or t < inc.exited]
        if len(series) < 4 or series[0][0] >= start + 60.0:
            continue
        row: dict[str, Any] = {"over_s": round(series[-1][0] - series[0][0], 1)}
        for key in ("anon", "rss"):
            base = statistics.median(v[key] for t, v in series if t < start + 60.0)
            final = statistics.median(v[key] for _, v in series[-3:])
            row[f"{key}_base_mib"], row[f"{key}_end_mib"] = round(base, 1), round(final, 1)
            row[f"{key}_growth"] = round(final / base - 1, 4) if base else None
        out[name] = row
    if soak:
        out["goal_anon_growth_under_10pct"] = all(
            (v["anon_growth"] or 0) < 0.10 for v in out.values() if isinstance(v, dict)
        )
    return out


def _mem(v: Any) -> dict[str, float]:
    return v if isinstance(v, dict) else {"rss": v, "anon": 0.0}  # raw.json of an older run


def _alarms(logs: Path, keep: int = 6) -> dict[str, list[str]]:
    """The last error lines (and tracebacks' last lines) of each role's log."""
    pattern = re.compile(r"\[error|\[critical|Traceback|Error:")
    out = {}
    for log in sorted(logs.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        hits = [line[:400] for line in lines if pattern.search(line)]
        if hits:
            out[log.stem] = hits[-keep:]
    return out


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "never"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def print_table(report: dict[str, Any]) -> None:
    cols = [
        ("fault", "fault", 13), ("target", "target", 10), ("t", "at_s", 6),
        ("detect", "detected_s", 7), ("back", "back_s", 6), ("members", "members_s", 8),
        ("repair", "relay_repair_s", 7), ("gen/s", "gen_pre", 7), ("dip", "gen_min_ratio", 5),
        ("gen rec", "gen_recovery_s", 8), ("train/s", "train_pre", 8),
        ("dip", "train_min_ratio", 5), ("train rec", "train_recovery_s", 9),
        ("weights", "weights_s", 8), ("failed", "failed", 6), ("again", "trained_again", 6),
    ]  # fmt: skip
    print(" ".join(h.rjust(w) for h, _, w in cols))
    for row in report["faults"]:
        cells = []
        for _, key, w in cols:
            if row.get("skipped") and key not in ("fault",):
                cells.append(("-" if key != "target" else "skip").rjust(w))
                continue
            v = row.get(key, "")
            digits = 3 if key in ("relay_repair_s", "gen_min_ratio", "train_min_ratio") else 1
            cells.append((_fmt(v, digits) if v != "" else "-").rjust(w))
        print(" ".join(cells))
    for row in report["faults"]:
        for note in row.get("notes", []):
            print(f"  {row['fault']}: {note}")
    measured = {
        "relay_repair_s": report["goals"]["relay repair < 1 s"] is not None,
        "max_recovery_s": report["goals"]["recoveries < 30 s"] is not None,
    }
    keys = ("lost", "duplicated", "stuck", "relay_repair_s", "max_recovery_s")
    print("  ".join(f"{k}={_fmt(report[k], 3) if measured.get(k, True) else '-'}" for k in keys))
    for s in report["stuck_roles"]:
        print(f"  stuck: {s['role']}: {s['why']}")
    for c in report["crashes"]:
        print(f"  crash: {c['role']} exited {c['code']} at t={c['at_s']} s (not a fault)")
    verdict = {True: "ok", False: "MISSED", None: "not measured"}
    print("goals: " + ", ".join(f"{k}: {verdict[v]}" for k, v in report["goals"].items()))


def plot(report: dict[str, Any], path: Path, smooth_s: int = 5) -> Path | None:
    """Generation and training tokens/s against time with the faults marked (like Fig. 15).

    Drawn over ``smooth_s``-second windows, shorter than the recovery windows: a long trailing
    window draws a dip of a few seconds as a trough as wide as the window."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    s = report["series"]
    t = np.asarray(s["t"])  # one point a second

    def rates(cumulative: list[float]) -> np.ndarray:
        c = np.asarray(cumulative, dtype=float)
        return (c - np.interp(t - smooth_s, t, c)) / smooth_s

    fig, ax = plt.subplots(figsize=(11, 4))
    ax.plot(t, rates(s["gen_tokens"]), label="generation tokens/s", lw=1.2)
    ax.plot(t, rates(s["train_tokens"]), label="training tokens/s", lw=1.2)
    top = ax.get_ylim()[1]
    for f in s["faults"]:
        ax.axvline(f["t"], color="red", alpha=0.5, lw=1)
        if "until" in f:  # the link was down in between
            ax.axvspan(f["t"], f["until"], color="red", alpha=0.1)
        ax.text(f["t"] + 1, top * 0.97, f["fault"], rotation=90, va="top", fontsize=8)
    ax.set_xlabel(f"seconds from the first sample (rates over {smooth_s} s windows)")
    ax.set_ylabel("tokens/s")
    ax.set_ylim(0, top)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
