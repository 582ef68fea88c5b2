"""What a check reports, and the two ways ``laminar doctor`` prints a report (lines, JSON).

One shape for every check keeps the report uniform and lets ``laminar run`` decide to refuse
from severities alone."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

#: ``blocker``: the run cannot work; ``warning``: it works worse, or something optional is
#: missing; ``ok``: checked and fine
Severity = Literal["blocker", "warning", "ok"]
#: what the machine is checked for: ``laminar run`` (all of run.roles) or ``laminar serve``
Mode = Literal["run", "serve"]


@dataclass(frozen=True)
class Finding:
    """One check's result: ``found`` says what is there, ``fix`` what to do (empty when ok)."""

    severity: Severity
    name: str
    found: str
    fix: str = ""

    def line(self) -> str:
        label = {"blocker": "BLOCKER", "warning": "warning", "ok": "ok"}[self.severity]
        fix = f"  fix: {self.fix}" if self.fix and self.severity != "ok" else ""
        return f"{label:<8} {self.name:<9} {self.found}{fix}"


def blockers(findings: Iterable[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "blocker"]


def summary(findings: Sequence[Finding], mode: Mode = "run") -> str:
    counts = {s: sum(f.severity == s for f in findings) for s in ("blocker", "warning", "ok")}

    def n(count: int, word: str) -> str:
        return f"{count} {word}{'' if count == 1 else 's'}"

    text = f"{n(counts['blocker'], 'blocker')}, {n(counts['warning'], 'warning')}"
    text += f", {counts['ok']} ok"
    if counts["blocker"]:
        return f"{text}: " + (
            "`laminar run` would refuse to start" if mode == "run" else "fix them before serving"
        )
    return text


def findings_json(findings: Sequence[Finding], mode: Mode = "run") -> dict[str, Any]:
    return {
        "findings": [asdict(f) for f in findings],
        "blockers": len(blockers(findings)),
        "warnings": sum(f.severity == "warning" for f in findings),
        "summary": summary(findings, mode),
    }
