"""Jobs under the cluster's job supervisor: start, follow, list and stop them.

A job is one execution of the operations stack's Step Functions state machine
(stacks/supervisor.py, output `JobStateMachineArn`), or a chain of them (executions.py reads
them). The execution waits for the nodes, runs preflight, sends RunTraining, retries with resume
and continues legs on the AWS side; the CLI only starts it and reads what it does, so closing
the terminal (or Ctrl-C) never ends a job and never leaves one without supervision. There is no
retry loop on the operator's machine.

What the CLI prints while following comes from the execution's own history: the states it
enters (waiting for nodes, preflight, RunTraining) and the notifications it publishes to the
cluster's SNS topic (started, retries, continues, stopped, failed, finished), so the terminal
and the topic's subscribers read the same account of the job.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.clients import aws_errors, error_code
from scripts.cluster_lib.cluster import Cluster
from scripts.cluster_lib.command_history import latest_attempt
from scripts.cluster_lib.costs import Price, attempt_lines, attempts, idle_line, node_hours
from scripts.cluster_lib.documents import CLI_LABELS, job_parameters, load
from scripts.cluster_lib.executions import (
    UNKNOWN_FIELD,
    Executions,
    Pair,
    continued_as,
    execution_name,
    job_of,
)
from scripts.cluster_lib.fleet import Node
from scripts.cluster_lib.job_inputs import JobInputs
from scripts.cluster_lib.logs import LogFollower, job_output_window, metrics_stream
from scripts.cluster_lib.progress import Progress, duration, read, summarize
from scripts.cluster_lib.queue import JobQueue
from scripts.cluster_lib.stragglers import behind_line, read_nodes
from stacks import supervisor_limits as limits

#: The failure names the state machine ends with (stacks/supervisor.py).
REFUSED, FAILED, STOPPED = "JobNotDispatched", "JobFailed", "JobStopped"
MIXED_FLEET = "NodesRunDifferentSoftware"
#: `stop` lists the job's running executions again after this many seconds (a successor that
#: an execution started just before it was stopped), at most STOP_ROUNDS times.
HANDOVER_SECONDS, STOP_ROUNDS = 2.0, 5
#: The lines of rank 0's metrics stream `jobs` reads per job (progress.py summarize).
METRICS_EVENTS = 100
#: States worth a line of their own while following (the rest shows in notifications).
#: The states that read the group while the supervisor waits for nodes (stacks/
#: supervisor_workflow.py, wait_for_nodes): passing through them is not news.
GROUP_READ_STATES = frozenset(
    {"ReadGroup", "MoreOfGroup", "ReadGroupPage", "AddGroupPage", "JoinGroupPage",
     "PartitionGroup", "ReadNodes", "CountNodes"}
)  # fmt: skip
STATE_LINES = {
    "WaitForNodes": "waiting for a full set of InService, healthy nodes",
    "PreflightBatches": "preflight on every node",
    "RunTrainingBatches": "RunTraining on every node",
}


@dataclass
class JobRow:
    """One line of `cluster.py jobs`."""

    job_id: str
    status: str
    started: datetime
    duration: str
    attempts: str = "-"
    retries: str = "-"
    legs: str = "-"
    #: The step of the total, step rate, time left and the job's own metrics (progress.py).
    progress: Progress = field(default_factory=Progress)
    #: What the job's node-hours cost (costs.py), each attempt's line, and the idle time
    #: before it with no job.
    cost: str = "-"
    costs: list[str] = field(default_factory=list)
    #: When its last execution ended (None: it runs, or it is queued).
    ended: datetime | None = None
    execution: str = ""
    #: What happened, oldest first: each retry with its causes, each new leg, each long wait
    #: for nodes, and the failure that ended the job (story_of).
    story: list[str] = field(default_factory=list)
    #: While it runs: the nodes whose progress lags the others' (stragglers.py), or None.
    behind: str | None = None


def story_of(chain: list[Pair]) -> list[str]:
    """Why a job's executions (a chain, newest first: Executions.chains) handed it over or
    ended, oldest first, each with the time it happened: the `Why` of a hand-over's output (a
    retry and what happened on each node, a new leg, a long wait for nodes) and the cause of a
    failed job (stacks/supervisor_outcomes.py)."""
    lines = []
    for listed, described in reversed(chain):
        ended = listed.get("stopDate")
        when = f"{ended:%Y-%m-%d %H:%M}" if ended else "-"
        why = None
        if continued_as(described):
            with contextlib.suppress(ValueError, AttributeError):
                why = json.loads(described.get("output") or "{}").get("Why")
        elif described.get("error") == FAILED:
            why = f"failed: {described.get('cause', '')}"
        if why:
            lines.append(f"{when}  {why}")
    return lines


class Jobs:
    """The cluster's jobs, as executions of its state machine."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.executions = Executions(cluster.clients.stepfunctions, cluster.stack)
        self.sfn = self.executions.sfn
        self.out = cluster.patience.out
        self.chains = self.executions.chains
        self.queue = JobQueue(cluster.clients.dynamodb, self.sfn, cluster.stack)

    # ----------------------------------------------------------------- starting
    def poll_seconds(self, requested: int | None) -> int:
        """The supervisor's PollSeconds for this cluster: `requested`, unless one attempt
        polled that often could outgrow an execution's history (stacks/supervisor_limits.py);
        by default 300 seconds or that minimum, whichever is longer."""
        nodes = self.cluster.outputs().node_count
        minimum = limits.min_poll_seconds(nodes)
        if requested is None:
            return max(limits.DEFAULT_POLL_SECONDS, minimum)
        if requested < minimum:
            raise ClusterError(
                f"--check-every {requested} is too short for {nodes} nodes: an attempt of up to "
                f"{limits.LEG_SECONDS // 3600} hours checked that often would outgrow the "
                f"{limits.HISTORY_EVENTS:,} history events a supervisor execution keeps; use "
                f"at least {minimum}"
            )
        return requested

    def start(
        self,
        job_id: str,
        train_args: list[str],
        inputs: JobInputs,
        *,
        master_port: str = "29500",
        nproc_per_node: str = "auto",
        max_retries: int = 2,
        retry_delay: float = 60,
        options: dict[str, Any] | None = None,
    ) -> str:
        """Queues the job and starts the job queue's dispatcher, which starts the job's
        execution once no other job holds the cluster (stacks/job_queue.py); refuses, in one
        line, a job ID that is queued or running already. Returns the execution's ARN (it
        exists once the job starts)."""
        parameters = job_parameters(
            job_id, train_args, master_port=master_port, nproc_per_node=nproc_per_node,
            **inputs.parameters(),
        )  # fmt: skip
        load("RunTraining").check(parameters, CLI_LABELS)
        arn = self.executions.state_machine
        # Not while `roll` replaces nodes (the supervisor itself does not look at refreshes:
        # a retry during a refresh waits for a full set of InService nodes like any other).
        self.cluster.wait_for_refresh()
        for queued in self.queue.queued():
            if queued.job_id == job_id:
                raise ClusterError(
                    f"job {job_id} is queued already (position {queued.position}): follow it "
                    f"with `cluster.py jobs`, or take it off with `cluster.py stop --job-id "
                    f"{job_id}`"
                )
        running = self.executions.running(job_id)
        if running or self.queue.slot().get("JobId") == job_id:
            name = running[0]["name"] if running else self.queue.slot().get("ExecutionName")
            raise ClusterError(
                f"job {job_id} runs already (execution {name}): follow it with `cluster.py "
                f"logs --job-id {job_id} --follow`, or stop it with `cluster.py stop --job-id "
                f"{job_id}`"
            )
        job = {
            **parameters,
            "MaxRetries": max_retries,
            "RetryDelaySeconds": int(retry_delay),
            **(options or {}),
        }
        name = execution_name(job_id, datetime.now(UTC))
        self.queue.enqueue(job_id, name, job)
        self.queue.dispatch()
        # arn:aws:states:<region>:<account>:stateMachine:<machine> → …:execution:<machine>:<name>
        return f"{arn.replace(':stateMachine:', ':execution:', 1)}:{name}"

    def run(
        self, execution: str, job_id: str, *, detach: bool = False, stream: bool = True
    ) -> None:
        """After `start`: says so, then follows the execution unless `detach`. Ctrl-C from here
        on detaches: the job goes on under its supervisor."""
        try:
            name = execution.rsplit(":", 1)[-1]
            machine = execution.rsplit(":", 2)[-2]
            self.out(
                f"job {job_id}: queued; it starts as execution {name} of {machine} when no "
                "other job holds the cluster (its supervisor in AWS waits for the nodes, runs "
                "preflight, retries and resumes)"
            )
            if detach:
                self.out(f"job {job_id} starts and runs in AWS without this terminal; follow it:")
                self.out(f"  python scripts/cluster.py logs --job-id {job_id} --follow")
                return
            self.wait_for_start(execution, job_id)
            self.follow(execution, job_id, stream=stream)
        except KeyboardInterrupt:
            self.out(self.detached(job_id))
        except Detached as detached:
            self.out(str(detached))

    def wait_for_start(self, execution: str, job_id: str) -> None:
        """Until the dispatcher started the job's execution: its position in the queue, each
        time it changes. A job taken off the queue (`stop`) ends the wait with one line."""
        said = None
        while True:
            try:
                self.sfn.describe_execution(executionArn=execution)
                return
            except ClientError as error:
                if error_code(error) != "ExecutionDoesNotExist":
                    raise ClusterError(f"following the job failed: {error}") from None
            name = execution.rsplit(":", 1)[-1]
            position = next((q.position for q in self.queue.queued() if q.job_id == job_id), None)
            if position is None and self.queue.slot().get("ExecutionName") == name:
                position = 0  # the dispatcher took it off the queue and starts it
            elif position is None:
                with contextlib.suppress(ClientError):
                    self.sfn.describe_execution(executionArn=execution)
                    return  # taken off the queue and started meanwhile
                raise ClusterError(f"job {job_id} was taken off the queue before it started")
            if position != said and position:
                self.out(f"job {job_id}: queued at position {position}")
            said = position
            self.cluster.patience.pause()

    @staticmethod
    def detached(job_id: str) -> str:
        return (
            f"detached from job {job_id}; it goes on in AWS under its supervisor. Follow it "
            f"again with `cluster.py logs --job-id {job_id} --follow`, list jobs with "
            f"`cluster.py jobs`, stop it with `cluster.py stop --job-id {job_id}`"
        )

    # ---------------------------------------------------------------- following
    def follow(self, execution: str, job_id: str, *, stream: bool = True) -> None:
        """Prints what the execution does until it ends; returns when it succeeded, raises a
        ClusterError otherwise. Ctrl-C detaches (the job goes on) and raises Detached."""
        seen = 0
        last_state = ""
        last_message = ""
        followers: list[LogFollower] = []
        training_since: datetime | None = None
        hint = (
            f"the job goes on in AWS: `cluster.py jobs`, `cluster.py logs --job-id {job_id} "
            f"--follow`, `cluster.py stop --job-id {job_id}`"
        )

        def read_history() -> None:
            nonlocal seen, last_state, last_message, followers, training_since
            after, arn = seen, execution
            events = self.cluster.patience.patiently(
                "following the job", lambda: self.executions.history(arn, after), hint=hint
            )
            for event in events or []:
                seen = max(seen, event["id"])
                entered = event.get("stateEnteredEventDetails")
                if entered:
                    state = entered["name"]
                    if state in STATE_LINES and state != last_state:
                        self.out(f"job {job_id}: {STATE_LINES[state]}")
                    if state == "RunTrainingBatches":
                        training_since = event["timestamp"]
                        followers = []
                    if state not in GROUP_READ_STATES:
                        last_state = state
                message = self._notification(event)
                if message:
                    last_message = message
                    self.out(f"job {job_id}: {message}")

        try:
            while True:
                read_history()
                if stream and training_since is not None and not followers:
                    followers = self._rank0_followers(job_id, training_since)
                for follower in followers:
                    follower.poll()
                described = self.cluster.patience.patiently(
                    "following the job",
                    lambda arn=execution: self.sfn.describe_execution(executionArn=arn),  # type: ignore[misc]
                    hint=hint,
                )
                if described and described["status"] != "RUNNING":
                    # What happened between the last read and the end (the final
                    # notification among it) is in the history by now.
                    read_history()
                    successor = continued_as(described)
                    if successor:
                        # The supervisor handed the job over to a new execution (its history
                        # budget, stacks/supervisor_limits.py): follow that one.
                        execution = f"{execution.rsplit(':', 1)[0]}:{successor}"
                        self.out(f"job {job_id}: continues in execution {successor}")
                        seen = 0
                        continue
                    for follower in followers:
                        follower.poll()
                    self._ended(described, job_id, last_message)
                    return
                self.cluster.patience.pause()
        except KeyboardInterrupt:
            raise Detached(self.detached(job_id)) from None

    @staticmethod
    def _notification(event: dict[str, Any]) -> str | None:
        """The message of an SNS notification the workflow sends, if the event is one."""
        details = event.get("taskScheduledEventDetails")
        if not details or not str(details.get("resourceType", "")).endswith(":sns"):
            return None
        try:
            message = json.loads(details.get("parameters") or "{}").get("Message")
        except ValueError:
            return None
        return str(message) if message else None

    def _rank0_followers(self, job_id: str, since: datetime) -> list[LogFollower]:
        """Followers of rank 0's output in the job's RunTraining commands sent at or after
        `since` (none yet: the workflow has not sent them; try again at the next poll)."""
        try:
            commands = self.cluster.history.latest_command_details(job_id)
        except (ClusterError, ClientError, BotoCoreError):
            return []
        commands = [c for c in commands if c.get("RequestedDateTime", since) >= since]
        if not commands:
            return []
        hosts = commands[0].get("Parameters", {}).get("Hosts", [""])[0].split(",")
        nodes, _ = self.cluster.running_nodes()
        rank0 = next((n for n in nodes if n.address == hosts[0]), None)
        if rank0 is None:
            return []
        # Rank 0's output is the job's, in its node's job-log stream (logs.py): one follower,
        # from the batch that went to rank 0.
        command = next(
            (c for c in commands if rank0.instance_id in c.get("InstanceIds", [])), commands[0]
        )
        self.out(f"job {job_id}: output of rank 0 ({rank0.instance_id}, {rank0.address}):")
        return [
            self.cluster.logs.follower(
                command["CommandId"], rank0.instance_id,
                job_output_since=command.get("RequestedDateTime", since),
            )
        ]  # fmt: skip

    def _ended(self, described: dict[str, Any], job_id: str, last_message: str) -> None:
        status = described["status"]
        name = described.get("name", "")
        if status == "SUCCEEDED":
            self.out(f"job {job_id} finished (execution {name})")
            return
        error, cause = described.get("error", ""), described.get("cause", "")
        logs = f"read its output with `cluster.py logs --job-id {job_id}`"
        if error == REFUSED:
            raise ClusterError(f"job {job_id} was refused: {cause}")
        if error == STOPPED or status == "ABORTED":
            raise ClusterError(f"job {job_id} was stopped (execution {name} {status.lower()})")
        if error == MIXED_FLEET:
            raise ClusterError(
                f"job {job_id} cannot run: {cause} (`cluster.py status` shows who runs what)"
            )
        if error == FAILED:
            said = (last_message or cause).rstrip(".")
            raise ClusterError(
                f"job {job_id} failed: {said}" + ("" if "cluster.py logs" in said else f"; {logs}")
            )
        raise ClusterError(
            f"the supervisor of job {job_id} ended {status}"
            + (f" ({error}: {cause})" if error or cause else "")
            + f"; {logs}"
        )

    # ------------------------------------------------------------------ listing
    def rows(self, limit: int = 10) -> list[JobRow]:
        """The newest `limit` jobs with status, duration, attempts and the progress rank 0
        reported in its metrics file (where its node and output are still there). A job that its
        supervisor handed over from execution to execution is one row: the status and
        counters of the newest execution, the time since the oldest one started, and under it
        why each execution handed the job over or ended it (story_of)."""
        now = datetime.now(UTC)
        rows: list[JobRow] = []
        chains = self.chains(limit)
        by_job: dict[str, list[dict[str, Any]]] = {}
        for sent in self.cluster.history.commands("RunTraining") if chains else []:
            by_job.setdefault(sent.get("Parameters", {}).get("JobId", [""])[0], []).append(sent)
        latest = {job: latest_attempt(mine)[0] for job, mine in by_job.items() if job}
        price = Price.of(self.cluster.outputs())
        nodes_count = self.cluster.outputs().node_count
        nodes = {n.address: n for n in self.cluster.running_nodes()[0]} if chains else {}
        for chain in chains:
            (newest, described), (oldest, _) = chain[0], chain[-1]
            started = oldest["startDate"]
            ended = newest.get("stopDate") or now
            status = newest["status"]
            if continued_as(described):
                status = "CONTINUED"  # its successor is not listed (yet)
            row = JobRow(
                job_id=job_of(newest["name"]),
                status=status,
                started=started,
                duration=duration((ended - started).total_seconds()),
                execution=newest["name"],
                story=story_of(chain),
            )
            row.ended = newest.get("stopDate")
            row.cost = price.usd(node_hours(started, ended, nodes_count))
            mine = [c for c in by_job.get(row.job_id, []) if c["RequestedDateTime"] >= started]
            row.costs = attempt_lines(attempts(mine, ended), price) if mine else []
            with contextlib.suppress(*UNKNOWN_FIELD):
                counters = self.executions.counters(newest["executionArn"])
                if counters:
                    row.attempts = str(counters.get("Attempts", "-"))
                    row.retries = str(counters.get("Retries", "-"))
                    row.legs = str(counters.get("Legs", "-"))
            command = latest.get(row.job_id)
            if command and command.get("RequestedDateTime", now) >= started:
                hosts = command.get("Parameters", {}).get("Hosts", [""])[0].split(",")
                node = nodes.get(hosts[0])
                if node is not None:
                    window = job_output_window(command, latest.values())
                    with contextlib.suppress(*UNKNOWN_FIELD):
                        row.progress = self._progress(node, window)
                    if status == "RUNNING":
                        row.behind = self._behind(window)
            rows.append(row)
        # The time between one job's end and the next one's start, with the group's nodes.
        for newer, older in itertools.pairwise(rows):
            if older.ended is not None and newer.started > older.ended:
                hours = node_hours(older.ended, newer.started, nodes_count)
                newer.costs.insert(
                    0,
                    f"idle before it: {duration((newer.started - older.ended).total_seconds())}"
                    f" with no job, up to {hours:,.1f} node-hours ({price.usd(hours)}) with "
                    f"the group's {nodes_count} nodes up",
                )
        return rows

    def idle_warning_now(self, now: datetime | None = None) -> str | None:
        """For `status`: the idle warning from the queue and the newest execution alone (one
        ListExecutions call of one execution)."""
        with aws_errors("listing the cluster's jobs"):
            page = self.sfn.list_executions(
                stateMachineArn=self.executions.state_machine, maxResults=1
            )
        newest = [
            JobRow(job_of(e["name"]), e["status"], e["startDate"], "-", ended=e.get("stopDate"))
            for e in page["executions"][:1]
        ]
        return self.idle_warning(self.queued_rows() + newest, now)

    def idle_warning(self, rows: list[JobRow], now: datetime | None = None) -> str | None:
        """A line when the nodes running now have had no job for longer than the threshold
        (costs.py idle_line): none runs or waits in the queue, and the last one ended (or the
        nodes launched, where later) that long ago."""
        price = Price.of(self.cluster.outputs())
        if not price.idle_warning_minutes or any(r.ended is None for r in rows):
            return None
        nodes = self.cluster.running_nodes()[0]
        launched = [n.launch_time for n in nodes if n.launch_time is not None]
        moments = [r.ended for r in rows if r.ended is not None]
        if launched:
            moments.append(min(launched))
        return idle_line(
            nodes_up=len(nodes),
            since=max(moments) if moments else None,
            now=now or datetime.now(UTC),
            price=price,
        )

    def _progress(self, node: Node, window: tuple[int, int | None]) -> Progress:
        """Rank 0's progress over a command's time `window`: the last METRICS_EVENTS lines of
        its node's metrics stream (the job's TRAINIUM_METRICS_FILE, which the CloudWatch agent
        ships; logs.py job_output_window bounds it by the next job's latest attempt). Lines
        that break the schema (progress.py) are skipped."""
        log_group = self.cluster.outputs()["TrainingLogGroupName"]
        events = self.cluster.logs.last_events(
            log_group, metrics_stream(node.instance_id), METRICS_EVENTS, window
        )
        records, _ = read(event["message"] for event in events)
        return summarize(records)

    def _behind(self, window: tuple[int, int | None]) -> str | None:
        """The line naming the nodes whose progress lags the others' in a running job's
        `window` (one CloudWatch Logs Insights query: stragglers.py), or None."""
        log_group = self.cluster.outputs()["TrainingLogGroupName"]
        with aws_errors("querying the nodes' progress"):
            nodes = read_nodes(
                self.cluster.logs.client,
                log_group,
                window,
                now=time.time,
                sleep=self.cluster.patience.sleep,
            )
        return behind_line(nodes)

    def queued_rows(self) -> list[JobRow]:
        """One row per queued job, next to start first: status QUEUED and its position."""
        return [
            JobRow(
                job_id=q.job_id,
                status=f"QUEUED {q.position}",
                started=datetime.strptime(q.submitted_at, "%Y-%m-%dT%H:%M:%S.%fZ").replace(
                    tzinfo=UTC
                ),
                duration="-",
            )
            for q in self.queue.queued()
        ]

    # ----------------------------------------------------------------- stopping
    def stop(self, job_id: str) -> list[str]:
        """Stops the job's running executions (the supervisor neither retries nor starts
        another leg); returns their names. The caller then ends the processes on the nodes.
        An execution stopped in the middle of handing the job over (a new leg, a retry) may
        just have started its successor: the executions are listed again, a moment later,
        until none of the job's runs."""
        stopped: list[str] = []
        for _ in range(STOP_ROUNDS):
            running = [e for e in self.executions.running(job_id) if e["name"] not in stopped]
            if not running:
                break
            for execution in running:
                with aws_errors("stopping the job's execution"):
                    try:
                        self.sfn.stop_execution(
                            executionArn=execution["executionArn"],
                            error="StoppedByOperator",
                            cause=f"cluster.py stop --job-id {job_id}",
                        )
                    except ClientError as error:
                        if error_code(error) != "ExecutionDoesNotExist":
                            raise
                self.out(f"job {job_id}: stopped execution {execution['name']} (no retry follows)")
                stopped.append(execution["name"])
            self.cluster.patience.sleep(HANDOVER_SECONDS)
        return stopped

    def refuse_unknown(self, job_id: str) -> None:
        """One line for `stop` of a job ID that has no running execution and no command SSM
        still runs: nothing of it to stop. It names the jobs that do run (a mistyped ID)."""
        running = sorted({job_of(e["name"]) for e in self.executions.running()})
        others = f" (running: {', '.join(running)})" if running else ""
        raise ClusterError(f"job {job_id} is neither running nor queued{others}")


class Detached(Exception):
    """Ctrl-C while following: the job goes on; the message says how to find it again."""


def rows_text(rows: list[JobRow]) -> Iterator[str]:
    yield (
        f"{'JOB':<24} {'STATUS':<10} {'STARTED (UTC)':<16} {'DURATION':>8} {'ATTEMPTS':>8} "
        f"{'RETRIES':>7} {'LEGS':>4} {'STEP':>12} {'RATE':>8} {'ETA':>8} {'COST':>11}  METRICS"
    )
    for r in rows:
        p = r.progress
        yield (
            f"{r.job_id:<24} {r.status:<10} {r.started:%Y-%m-%d %H:%M} {r.duration:>8} "
            f"{r.attempts:>8} {r.retries:>7} {r.legs:>4} {p.step:>12} {p.rate:>8} {p.eta:>8} "
            f"{r.cost:>11}  {p.metrics}"
        )
        if r.behind:
            yield f"    {r.behind}"
        for line in r.story:
            yield f"    {line}"
        for line in r.costs:
            yield f"    {line}"
