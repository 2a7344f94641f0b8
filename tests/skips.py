"""Skips that CI does not accept.

The end-to-end tests need tools and privileges a developer's machine may lack (root and
iproute2 for network namespaces, shellcheck, gpg, strace): there they skip, so that the rest of
the suite still runs. CI installs all of them (`make setup`), so there a skip means a test that
did not run while the run stays green. With TRAINIUM_CLUSTER_REQUIRE_ALL=1 (set by .ci/run)
every skip, whether from `pytest.skip`, a `skipif` marker or `pytest.importorskip`, in a test
or at collection, is reported as a failure that names the skip's reason.

A test whose premise does not hold on a machine, which no tool could change (a check that
`--device cuda` is refused, on a machine that has a CUDA device), skips with
`not_applicable(reason)`: that skip stays a skip.

tests/conftest.py loads these hooks; tests/test_skips.py runs pytest on small test files
with them.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any, NoReturn

import pytest

REQUIRE_ALL = "TRAINIUM_CLUSTER_REQUIRE_ALL"


class NotApplicable(pytest.skip.Exception):  # type: ignore[misc,name-defined]
    """A skip that no installed tool or privilege could avoid."""


def not_applicable(reason: str) -> NoReturn:
    """Skips the test because its premise does not hold here (stays a skip under REQUIRE_ALL)."""
    raise NotApplicable(reason)


def required() -> bool:
    return os.environ.get(REQUIRE_ALL, "") not in ("", "0")


def _reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _fail(report: Any, where: str) -> None:
    report.outcome = "failed"
    report.longrepr = (
        f"{REQUIRE_ALL}=1: {where} skipped, and a skip for want of a tool or privilege fails "
        f"here (make setup installs the tools; run as root for network namespaces): "
        f"{_reason(report)}"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[Any]:
    report = yield
    if report.skipped and required() and not hasattr(report, "wasxfail"):
        excinfo = call.excinfo
        if excinfo is None or not isinstance(excinfo.value, NotApplicable):
            _fail(report, item.nodeid)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[Any]:
    report = yield
    if report.skipped and required():
        _fail(report, collector.nodeid or "collection")
    return report
