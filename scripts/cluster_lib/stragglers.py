"""Naming a straggler: a node whose progress lags the others', for `cluster.py jobs`.

Global rank 0's lines are the job's progress (docs/job-contract.md). An entry point may also
expose per-node progress: each node's local rank 0 appends the same kind of line to its own
node's TRAINIUM_METRICS_FILE, which the CloudWatch agent ships to that node's
`<instance-id>/metrics` stream of the training log group. `jobs` reads every node's newest step
and time in the running job's window with one CloudWatch Logs Insights query over the group
(QUERY; StartQuery, then GetQueryResults until the query completes), whatever the node count:
reading each node's stream instead would be a GetLogEvents a node, 1,024 of them against
CloudWatch Logs' 10 a second (stacks/api_rates.py).

A node is named when its newest step is below the leading node's and its newest line is at
least BEHIND_SECONDS older than the leader's: its lines stopped while the others' went on (a
node stuck in I/O, or still loading while the others train). Nodes that write their lines at
the same steps, as in synchronous data parallelism where every node ends a step together, are
never named: their newest lines are the same step within seconds. A job whose nodes other than
rank 0's write no lines has one stream in the answer and nothing to compare.

The query's language (CloudWatch Logs user guide, "CloudWatch Logs Insights language query
syntax"): `filter` with `like /regex/` on the stream's name and `ispresent`, `stats` with
`max(...) as name by @logStream`; the fields of a JSON log event are discovered by name. Its
answer (botocore's logs model, GetQueryResults): `status` (Scheduled, Running, Complete,
Failed, Cancelled, Timeout, Unknown) and `results`, a list of rows, each a list of
{field, value} with every value a string.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scripts.cluster_lib import ClusterError

#: Every node's newest step and the newest line's own time (the line's `time`, unix seconds:
#: the schema's, scripts/cluster_lib/progress.py), from the nodes' metrics streams only.
QUERY = (
    "fields @logStream, step, time"
    " | filter @logStream like /\\/metrics$/ and ispresent(step)"
    " | stats max(step) as step, max(time) as at by @logStream"
)
#: The suffix of a node's metrics stream (logs.py metrics_stream).
STREAM_SUFFIX = "/metrics"
#: A node is behind when its newest line is at least this much older than the leader's.
BEHIND_SECONDS = 120.0
#: The most rows the query returns (StartQuery's limit: 1 to 10,000, botocore's logs model);
#: one a node, and MAX_NODES is 1,024.
MAX_ROWS = 10_000
#: How long `jobs` waits for the query (an upper bound: it polls its status every POLL_SECONDS).
QUERY_SECONDS = 60.0
POLL_SECONDS = 2.0
#: The nodes named on a line; the rest are counted.
NAMED = 5
#: GetQueryResults' statuses after which a query changes no more, less Complete.
UNFINISHED_ENDS = ("Failed", "Cancelled", "Timeout", "Unknown")


@dataclass(frozen=True)
class NodeProgress:
    """A node's newest step in the window and its newest line's time (None: no `time`)."""

    instance_id: str
    step: int
    at: float | None


def parse_rows(rows: list[list[dict[str, str]]]) -> list[NodeProgress]:
    """The query's rows as NodeProgress, one a node's metrics stream."""
    nodes = []
    for row in rows:
        fields = {f.get("field"): f.get("value") for f in row}
        stream, step, at = fields.get("@logStream"), fields.get("step"), fields.get("at")
        if not stream or not stream.endswith(STREAM_SUFFIX) or step in (None, ""):
            continue
        try:
            nodes.append(
                NodeProgress(
                    stream.removesuffix(STREAM_SUFFIX),
                    int(float(step)),
                    float(at) if at not in (None, "") else None,
                )
            )
        except ValueError:
            continue  # a line that breaks the schema (`jobs` skips those too)
    return nodes


def behind(nodes: list[NodeProgress], seconds: float = BEHIND_SECONDS) -> list[NodeProgress]:
    """The nodes behind the leader (the highest step, its newest line the newest among those),
    slowest first."""
    timed = [n for n in nodes if n.at is not None]
    if len(timed) < 2:
        return []
    leader = max(timed, key=lambda n: (n.step, n.at))
    assert leader.at is not None
    late = [
        n
        for n in timed
        if n.step < leader.step and n.at is not None and leader.at - n.at >= seconds
    ]
    return sorted(late, key=lambda n: (n.step, n.at or 0.0, n.instance_id))


def behind_line(nodes: list[NodeProgress], seconds: float = BEHIND_SECONDS) -> str | None:
    """`jobs`' line under a running job naming the nodes behind, or None."""
    late = behind(nodes, seconds)
    if not late:
        return None
    leader = max((n for n in nodes if n.at is not None), key=lambda n: (n.step, n.at))
    assert leader.at is not None
    named = ", ".join(
        f"{n.instance_id} at step {n.step} ({_ago(leader.at - (n.at or 0.0))} before the leader)"
        for n in late[:NAMED]
    )
    more = f" and {len(late) - NAMED} more" if len(late) > NAMED else ""
    return (
        f"behind: {named}{more}; the leader {leader.instance_id} is at step {leader.step} "
        f"({len(nodes)} nodes report progress)"
    )


def _ago(seconds: float) -> str:
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest:02d}s"


def read_nodes(
    client: Any,
    log_group: str,
    window: tuple[int, int | None],
    now: Callable[[], float],
    sleep: Callable[[float], None],
) -> list[NodeProgress]:
    """Every node's newest progress in `window` (CloudWatch Logs milliseconds; open: up to
    `now`): one Insights query, followed until it completes, at most QUERY_SECONDS."""
    start, end = window
    began = now()
    query_id = client.start_query(
        logGroupName=log_group,
        startTime=start // 1000,
        endTime=(end if end is not None else int(began * 1000)) // 1000,
        queryString=QUERY,
        limit=MAX_ROWS,
    )["queryId"]
    while True:
        answer = client.get_query_results(queryId=query_id)
        status = answer.get("status")
        if status == "Complete":
            return parse_rows(answer.get("results", []))
        if status in UNFINISHED_ENDS:
            raise ClusterError(f"the query for the nodes' progress ended {status}")
        if now() - began >= QUERY_SECONDS:
            raise ClusterError(
                f"the query for the nodes' progress did not complete in {QUERY_SECONDS:.0f} s "
                f"(status {status})"
            )
        sleep(POLL_SECONDS)
