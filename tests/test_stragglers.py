"""Naming a straggler in `cluster.py jobs` (scripts/cluster_lib/stragglers.py): every node's
newest progress from one CloudWatch Logs Insights query, the nodes behind the leader, and the
line `jobs` prints under a running job. The query runs against the logs stand-in over the
nodes' metrics files as the CloudWatch agent ships them (scripts/rehearsal/logs_stand_in.py),
each request checked against botocore's input shape and each answer against its output shape."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import botocore.session
import pytest
from botocore.validate import validate_parameters

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.stragglers import (
    BEHIND_SECONDS,
    NAMED,
    QUERY,
    NodeProgress,
    behind,
    behind_line,
    parse_rows,
    read_nodes,
)
from scripts.rehearsal.aws_stand_in import validate_answer

GROUP = "/trainium-cluster/rehearsal/training"
T0 = 1_764_120_000.0


def node(n: int, step: int, at: float | None) -> NodeProgress:
    return NodeProgress(f"i-{n:017x}", step, at)


# --------------------------------------------------------------------------- who is behind
def test_nodes_that_end_each_step_together_are_never_named() -> None:
    """Synchronous data parallelism: every node writes the same steps within seconds."""
    nodes = [node(n, 1200, T0 + n % 7) for n in range(64)]
    assert behind(nodes) == [] and behind_line(nodes) is None


def test_a_node_whose_lines_stopped_while_the_others_go_on_is_named() -> None:
    nodes = [node(n, 1200, T0 + 600) for n in range(7)] + [node(7, 900, T0)]
    assert behind(nodes) == [node(7, 900, T0)]
    line = behind_line(nodes)
    assert line == (
        "behind: i-00000000000000007 at step 900 (10m00s before the leader); the leader "
        "i-00000000000000000 is at step 1200 (8 nodes report progress)"
    ), line


def test_behind_in_step_but_recent_is_not_named() -> None:
    """A node one line behind, written less than BEHIND_SECONDS before the leader's."""
    nodes = [node(0, 1210, T0 + BEHIND_SECONDS - 1), node(1, 1200, T0)]
    assert behind(nodes) == []
    assert behind([node(0, 1210, T0 + BEHIND_SECONDS), node(1, 1200, T0)]) == [node(1, 1200, T0)]


def test_lines_without_a_time_are_not_compared_and_one_node_has_no_peer() -> None:
    assert behind([node(0, 1200, T0 + 900), node(1, 10, None)]) == []
    assert behind([node(0, 1200, T0)]) == []
    assert behind([]) == []


def test_many_behind_are_named_up_to_a_few_and_counted() -> None:
    nodes = [node(0, 5000, T0 + 3600)] + [node(n, 100 + n, T0) for n in range(1, 9)]
    line = behind_line(nodes)
    assert line is not None
    assert line.count(" at step ") == NAMED + 1  # NAMED nodes and the leader
    assert f"and {8 - NAMED} more" in line
    assert line.startswith("behind: i-00000000000000001 at step 101 (60m00s before the leader)")


def test_rows_that_break_the_schema_are_skipped() -> None:
    rows = [
        [{"field": "@logStream", "value": "i-0a/metrics"}, {"field": "step", "value": "40"},
         {"field": "at", "value": "1764120000.5"}],
        [{"field": "@logStream", "value": "i-0b/metrics"}, {"field": "step", "value": "12.0"}],
        [{"field": "@logStream", "value": "i-0c/metrics"}, {"field": "step", "value": "many"}],
        [{"field": "@logStream", "value": "i-0d/jobs"}, {"field": "step", "value": "3"}],
        [{"field": "step", "value": "3"}],
    ]  # fmt: skip
    assert parse_rows(rows) == [
        NodeProgress("i-0a", 40, 1764120000.5),
        NodeProgress("i-0b", 12, None),
    ]


# ------------------------------------------------------------------ the query, stand-in
class _Instances:
    """What LogsStandIn reads of the instances: their IDs and each one's upper folder."""

    def __init__(self, root: Path, ids: list[str]) -> None:
        self.root = root
        self.cluster_name = "rehearsal"
        self.instances = [SimpleNamespace(instance_id=i) for i in ids]

    def upper(self, instance: Any, path: str) -> Path:
        return self.root / instance.instance_id / path.strip("/")


class _Client:
    """The logs client the CLI holds, answered by the stand-in: requests checked against
    botocore's input shapes, answers against its output shapes."""

    def __init__(self, stand_in: Any) -> None:
        self.stand_in = stand_in
        self.model = botocore.session.get_session().get_service_model("logs")
        self.calls: list[str] = []

    def _call(self, operation: str, params: dict[str, Any]) -> dict[str, Any]:
        model = self.model.operation_model(operation)
        validate_parameters(params, model.input_shape)
        self.calls.append(operation)
        answer: dict[str, Any] = getattr(self.stand_in, f"_logs_{operation}")(params)
        validate_answer(model, answer)
        return answer

    def start_query(self, **params: Any) -> dict[str, Any]:
        return self._call("StartQuery", params)

    def get_query_results(self, **params: Any) -> dict[str, Any]:
        return self._call("GetQueryResults", params)


def _fleet(tmp_path: Path, lines: dict[str, list[Any]], written: float) -> _Client:
    """Each node's metrics file with `lines` (dicts as JSON, strings as they are), written at
    unix time `written`, behind the logs stand-in."""
    from scripts.rehearsal.logs_stand_in import LogsStandIn

    for instance_id, mine in lines.items():
        folder = tmp_path / instance_id / "var/log/trainium-cluster/metrics"
        folder.mkdir(parents=True)
        path = folder / "bert-1.jsonl"
        path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in mine))
        os.utime(path, (written, written))
    ssm = SimpleNamespace(instances=_Instances(tmp_path, list(lines)), commands={})
    return _Client(LogsStandIn(ssm, training_log_group=GROUP))  # type: ignore[arg-type]


def _line(step: int, at: float) -> dict[str, Any]:
    return {"step": step, "total_steps": 4000, "time": at, "phase": "training"}


def test_jobs_names_the_node_behind_from_one_query_over_every_metrics_stream(
    tmp_path: Path,
) -> None:
    """Three nodes write per-node progress; the third stopped 5 minutes before the others'
    newest line. `jobs` asks once (StartQuery), waits while the query runs, and prints the
    line under the running job's row; a log line and a line without `time` do not count."""
    from scripts.cluster_lib.jobs import JobRow, Jobs, rows_text

    lines = {
        "i-0000000000000000a": [_line(100, T0), "step 110 loss 0.4 (text)", _line(400, T0 + 300)],
        "i-0000000000000000b": [_line(100, T0 + 1), _line(400, T0 + 301)],
        "i-0000000000000000c": [_line(100, T0 + 2), {"step": 110}],
    }  # fmt: skip
    client = _fleet(tmp_path, lines, written=T0 + 310)
    slept: list[float] = []
    jobs = object.__new__(Jobs)
    jobs.cluster = SimpleNamespace(  # type: ignore[assignment]
        outputs=lambda: {"TrainingLogGroupName": GROUP},
        logs=SimpleNamespace(client=client),
        patience=SimpleNamespace(sleep=slept.append),
    )
    line = jobs._behind((int(T0 * 1000), None))
    assert line == (
        "behind: i-0000000000000000c at step 110 (4m59s before the leader); the leader "
        "i-0000000000000000b is at step 400 (3 nodes report progress)"
    ), line
    assert client.calls == ["StartQuery", "GetQueryResults", "GetQueryResults"]
    assert slept == [2.0]
    row = JobRow("bert-1", "RUNNING", datetime(2026, 11, 26, tzinfo=UTC), "1h00m", behind=line)
    assert list(rows_text([row]))[2] == f"    {line}"
    # The window is the job's: lines written before it are not read.
    assert jobs._behind((int((T0 + 400) * 1000), None)) is None


def test_the_stand_in_refuses_a_query_it_cannot_evaluate(tmp_path: Path) -> None:
    from scripts.rehearsal.ssm_stand_in import LocalError

    client = _fleet(tmp_path, {"i-0000000000000000a": [_line(1, T0)]}, written=T0)
    with pytest.raises(LocalError, match="MalformedQueryException"):
        client.start_query(
            logGroupName=GROUP, startTime=0, endTime=int(T0) + 10,
            queryString=QUERY.replace("max(step)", "min(step)"),
        )  # fmt: skip


def test_a_query_that_never_completes_is_one_line() -> None:
    class Stuck:
        def start_query(self, **_: Any) -> dict[str, Any]:
            return {"queryId": "q"}

        def get_query_results(self, **_: Any) -> dict[str, Any]:
            return {"status": "Running", "results": []}

    clock = iter(range(0, 1000, 10))
    with pytest.raises(ClusterError, match="did not complete in 60 s \\(status Running\\)"):
        read_nodes(Stuck(), GROUP, (0, None), now=lambda: float(next(clock)), sleep=lambda _: None)

    class Failed(Stuck):
        def get_query_results(self, **_: Any) -> dict[str, Any]:
            return {"status": "Failed", "results": []}

    with pytest.raises(ClusterError, match="ended Failed"):
        read_nodes(Failed(), GROUP, (0, None), now=lambda: 0.0, sleep=lambda _: None)


def test_the_request_rates_count_jobs_query() -> None:
    """stacks/api_rates.py counts one StartQuery and the polls of GetQueryResults per `jobs`,
    under the floor it holds unconfirmed rates to (CloudWatch Logs publishes no figure for
    them on the page it cites)."""
    from scripts.cluster_lib import stragglers
    from stacks import api_rates as rates

    assert rates.STRAGGLER_QUERY_SECONDS == stragglers.QUERY_SECONDS
    assert rates.STRAGGLER_QUERY_POLL == stragglers.POLL_SECONDS
    jobs = rates.cli_jobs()
    assert jobs["logs:StartQuery"] == 1 and jobs["logs:GetQueryResults"] == 31
    for action in ("logs:StartQuery", "logs:GetQueryResults"):
        assert jobs[action] <= rates.QUOTAS[action].per_minute, action
