"""Unit tests start no processes (``make test-fast`` runs this directory alone, and fast): each
test module's import and every phase of each test here run with the guard of
``tests/support/noprocess.py`` on. Hooks rather than an autouse fixture, so that module- and
session-scoped fixtures and a module's import are covered too."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.support.noprocess import GUARD, MESSAGE

HERE = Path(__file__).parent


def _guarded(path: Path) -> bool:
    return path.is_relative_to(HERE)


def _refused() -> str:
    started = GUARD.take()
    return f"{MESSAGE}; it started: " + "; ".join(started) if started else ""


@contextmanager
def _guarding(path: Path) -> Iterator[None]:
    if not _guarded(path):
        yield
        return
    GUARD.take()  # a thread left over from another test is not this one's doing
    with GUARD.on():
        try:
            yield
        finally:
            refused = _refused()
    if refused:  # also when the code under test caught the error and went on
        pytest.fail(refused, pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, object, object]:
    if not isinstance(collector, pytest.Module) or not _guarded(collector.path):
        return (yield)
    GUARD.take()
    with GUARD.on():
        report = yield
    refused = _refused()
    if refused and isinstance(report, pytest.CollectReport):  # say it even when the import went on
        report.outcome, report.longrepr = "failed", refused
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    with _guarding(item.path):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    with _guarding(item.path):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, object, object]:
    with _guarding(item.path):
        return (yield)
