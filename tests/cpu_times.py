"""`--cpu-durations=N`: the N tests that took the most CPU time, beside pytest's wall-clock
`--durations`.

On this project's 2-core machines the suite is CPU-bound (its workers keep the cores busy most
of a run), so a test's wall-clock duration says as much about what ran beside it as about the
test. Its CPU time does not: the test's own process (all its threads: the rehearsals' state
machines, the stand-ins) and every process it waited for (torchrun, the trainers, the node
scripts; POSIX counts a child's time, and its own waited-for children's, once it is reaped:
getrusage(2), RUSAGE_CHILDREN), from the start of the test's setup to the end of its
teardown. A process that outlives the test or is reaped by another (an orphan that init
reaps) is not counted; a thread an earlier test left running in the same process is (its
process's time is one figure). Each is small beside the tests at the top of the table.

Measured in the process that runs the test (an xdist worker, or pytest itself), and sent to the
controller with the test's teardown report (its user_properties), which prints the table.
"""

from __future__ import annotations

import resource
from collections.abc import Generator
from typing import Any

import pytest

#: The user property that carries a test's CPU seconds in its teardown report.
PROPERTY = "cpu_seconds"
_started: dict[str, float] = {}
_measured: dict[str, float] = {}


def _cpu_seconds() -> float:
    # getrusage, not os.times: microseconds, where times(2) counts in clock ticks.
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("terminal reporting").addoption(
        "--cpu-durations", type=int, default=0, metavar="N",
        help="show the N tests that took the most CPU time, with the processes they waited for",
    )  # fmt: skip


def pytest_runtest_logstart(nodeid: str) -> None:
    _started[nodeid] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[Any]:
    outcome = yield
    started = _started.get(item.nodeid)
    if call.when == "teardown" and started is not None:
        report = outcome.get_result()
        report.user_properties.append((PROPERTY, _cpu_seconds() - started))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        for name, value in report.user_properties:
            if name == PROPERTY:
                _measured[report.nodeid] = float(value)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    count = config.getoption("cpu_durations")
    if count <= 0 or not _measured:
        return
    terminalreporter.write_sep("=", f"most CPU time: {count} tests")
    for nodeid, seconds in sorted(_measured.items(), key=lambda kv: -kv[1])[:count]:
        terminalreporter.write_line(f"{seconds:8.2f}s cpu  {nodeid}")
    total = sum(_measured.values())
    terminalreporter.write_line(f"{total:8.0f}s cpu  all {len(_measured)} tests together")
