"""Jobs under the cluster's job supervisor: start, follow, list and stop them.

A job is one execution of the operations stack's Step Functions state machine
(stacks/supervisor.py, output `JobStateMachineArn`). The execution waits for the nodes, runs
preflight, sends RunTraining, retries with resume and continues legs on the AWS side; the CLI
only starts it and reads what it does, so closing the terminal (or Ctrl-C) never ends a job and
never leaves one without supervision. There is no retry loop on the operator's machine.

What the CLI prints while following comes from the execution's own history: the states it
enters (waiting for nodes, preflight, RunTraining) and the notifications it publishes to the
cluster's SNS topic (started, retries, continues, stopped, failed, finished), so the terminal
and the topic's subscribers read the same account of the job.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.aws import Cluster, Node, _LogFollower, aws_errors, error_code
from scripts.cluster_lib.documents import join_train_args, load
from stacks import supervisor_limits as limits

#: The operations stack's output naming the state machine.
JOB_STATE_MACHINE_OUTPUT = "JobStateMachineArn"
#: Execution names are the job ID and the start time. StartExecution's name: "Length
#: Constraints: Minimum length of 1. Maximum length of 80." (Step Functions API reference);
#: a 64-character job ID, "-" and the 15-character stamp make exactly 80. Names stay unique
#: for 90 days per state machine, so a job resumed later gets a new execution.
EXECUTION_STAMP = "%Y%m%d-%H%M%S"
EXECUTION_NAME = re.compile(r"^(?P<job>.+)-[0-9]{8}-[0-9]{6}$")
#: The failure names the state machine ends with (stacks/supervisor.py).
REFUSED, FAILED, STOPPED = "JobAlreadyRunning", "JobFailed", "JobStopped"
MIXED_FLEET = "NodesRunDifferentSoftware"
#: `jobs` reads at most this many executions to put the newest jobs' chains together.
MAX_LISTED = 1000
#: `stop` lists the job's running executions again after this many seconds (a successor that
#: an execution started just before it was stopped), at most STOP_ROUNDS times.
HANDOVER_SECONDS, STOP_ROUNDS = 2.0, 5
#: What the trainer prints on rank 0 (workload/train.py progress lines).
STEP_LINE = re.compile(r"\bstep (?P<step>[0-9]+)/(?P<total>[0-9]+) loss ")
EVAL_LINE = re.compile(r"\beval at step (?P<step>[0-9]+): loss \S+ accuracy (?P<accuracy>[0-9.]+)")
#: States worth a line of their own while following (the rest shows in notifications).
STATE_LINES = {
    "WaitForNodes": "waiting for a full set of InService, healthy nodes",
    "PreflightBatches": "preflight on every node",
    "RunTrainingBatches": "RunTraining on every node",
}


def execution_name(job_id: str, now: datetime) -> str:
    return f"{job_id}-{now.astimezone(UTC):{EXECUTION_STAMP}}"


def job_of(name: str) -> str:
    """The job ID of an execution name (one started by hand may be the job ID itself)."""
    match = EXECUTION_NAME.match(name)
    return match.group("job") if match else name


def _json_field(text: str | None, key: str) -> str | None:
    """`key` of the JSON object `text` (an execution's input or output), if set."""
    try:
        found = json.loads(text or "{}")
    except ValueError:
        return None
    value = found.get(key) if isinstance(found, dict) else None
    return str(value) if value else None


def continued_from(described: dict[str, Any]) -> str | None:
    """The ARN of the execution that handed its job over to this one, if one did."""
    return _json_field(described.get("input"), "ContinuedFrom")


def continued_as(described: dict[str, Any]) -> str | None:
    """The name of the execution a SUCCEEDED execution handed its job over to, if it did."""
    if described.get("status") != "SUCCEEDED":
        return None
    return _json_field(described.get("output"), "ContinuedAs")


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{seconds:02d}s"


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
    step: str = "-"
    accuracy: str = "-"
    execution: str = ""


class Jobs:
    """The cluster's jobs, as executions of its state machine."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.sfn = cluster.clients.stepfunctions

    @property
    def out(self) -> Any:
        return self.cluster.out

    @property
    def state_machine(self) -> str:
        outputs = self.cluster.outputs()
        arn = outputs.values.get(JOB_STATE_MACHINE_OUTPUT)
        if not arn:
            raise ClusterError(
                f"stack {outputs.stack_name} has no {JOB_STATE_MACHINE_OUTPUT} output (the job "
                "supervisor): redeploy the operations stack from this version of the project"
            )
        return arn

    # ------------------------------------------------------------------ reading
    def running(self, job_id: str | None = None) -> list[dict[str, Any]]:
        """The state machine's running executions (of `job_id`), newest first."""
        found: list[dict[str, Any]] = []
        with aws_errors("listing the cluster's jobs"):
            for page in self.sfn.get_paginator("list_executions").paginate(
                stateMachineArn=self.state_machine, statusFilter="RUNNING"
            ):
                found.extend(page["executions"])
        return [e for e in found if job_id is None or job_of(e["name"]) == job_id]

    def history(self, arn: str, after: int = 0, *, newest: int | None = None) -> list[dict]:
        """The execution's events with an ID above `after`, oldest first. They are asked for
        newest first (reverseOrder), so that following a long execution costs one call per
        poll; the order the pages come in is not relied on (the IDs are). `newest` keeps only
        that many of the newest."""
        found: dict[int, dict[str, Any]] = {}
        kwargs: dict[str, Any] = {"executionArn": arn, "reverseOrder": True, "maxResults": 100}
        while True:
            page = self.sfn.get_execution_history(**kwargs)
            reached = False
            for event in page["events"]:
                if event["id"] <= after:
                    reached = True
                else:
                    found[event["id"]] = event
            if reached or "nextToken" not in page or (newest and len(found) >= newest):
                break
            kwargs["nextToken"] = page["nextToken"]
        events = [found[i] for i in sorted(found)]
        return events[-newest:] if newest else events

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
        *,
        master_port: str = "29500",
        nproc_per_node: str = "auto",
        max_retries: int = 2,
        retry_delay: float = 60,
        options: dict[str, Any] | None = None,
    ) -> str:
        """Starts the job's execution; refuses, in one line, while another job runs."""
        parameters = {
            "JobId": job_id,
            "MasterPort": master_port,
            "NprocPerNode": nproc_per_node,
            "TrainArgs": join_train_args(train_args),
        }
        load("RunTraining").check(
            parameters,
            {
                "JobId": "--job-id",
                "MasterPort": "--master-port",
                "NprocPerNode": "--nproc-per-node",
                "TrainArgs": "train arguments",
            },
        )
        arn = self.state_machine
        # Not while `roll` replaces nodes (the supervisor itself does not look at refreshes:
        # a retry during a refresh waits for a full set of InService nodes like any other).
        self.cluster.wait_for_refresh()
        running = self.running()
        if running:
            other = running[0]
            raise ClusterError(
                f"job {job_of(other['name'])} runs on this cluster (execution {other['name']}, "
                f"started {other['startDate']:%Y-%m-%d %H:%M} UTC); one job at a time: wait for "
                f"it, or stop it with `cluster.py stop --job-id {job_of(other['name'])}`"
            )
        job = {
            **parameters,
            "MaxRetries": max_retries,
            "RetryDelaySeconds": int(retry_delay),
            **(options or {}),
        }
        name = execution_name(job_id, datetime.now(UTC))
        try:
            with aws_errors("starting the job's execution"):
                started = self.sfn.start_execution(
                    stateMachineArn=arn, name=name, input=json.dumps(job)
                )
        except ClusterError as error:
            if "ExecutionAlreadyExists" in str(error):
                raise ClusterError(
                    f"an execution named {name} exists already: start the job again in a second"
                ) from None
            raise
        execution: str = started["executionArn"]
        return execution

    def run(
        self, execution: str, job_id: str, *, detach: bool = False, stream: bool = True
    ) -> None:
        """After `start`: says so, then follows the execution unless `detach`. Ctrl-C from here
        on detaches: the job goes on under its supervisor."""
        try:
            name = execution.rsplit(":", 1)[-1]
            machine = execution.rsplit(":", 2)[-2]
            self.out(
                f"job {job_id}: started execution {name} of {machine} (its supervisor in AWS "
                "waits for the nodes, runs preflight, retries and resumes)"
            )
            if detach:
                self.out(f"job {job_id} runs under its supervisor; follow it with")
                self.out(f"  python scripts/cluster.py logs --job-id {job_id} --follow")
                return
            self.follow(execution, job_id, stream=stream)
        except KeyboardInterrupt:
            self.out(self.detached(job_id))
        except Detached as detached:
            self.out(str(detached))

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
        followers: list[_LogFollower] = []
        training_since: datetime | None = None
        hint = (
            f"the job goes on in AWS: `cluster.py jobs`, `cluster.py logs --job-id {job_id} "
            f"--follow`, `cluster.py stop --job-id {job_id}`"
        )

        def read_history() -> None:
            nonlocal seen, last_state, last_message, followers, training_since
            after, arn = seen, execution
            events = self.cluster.patiently(
                "following the job", lambda: self.history(arn, after), hint=hint
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
                    if state not in ("ReadGroup", "SelectHealthy", "CountNodes"):
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
                described = self.cluster.patiently(
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
                self.cluster.sleep(self.cluster.poll_interval)
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

    def _rank0_followers(self, job_id: str, since: datetime) -> list[_LogFollower]:
        """Followers of rank 0's output in the job's RunTraining commands sent at or after
        `since` (none yet: the workflow has not sent them; try again at the next poll)."""
        try:
            commands = self.cluster.latest_command_details(job_id)
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
        self.out(f"job {job_id}: output of rank 0 ({rank0.instance_id}, {rank0.address}):")
        return [_LogFollower(self.cluster, c["CommandId"], rank0) for c in commands]

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
    def chains(self, limit: int = 10) -> list[list[tuple[dict[str, Any], dict[str, Any]]]]:
        """The newest `limit` jobs, each the chain of executions that ran it, newest first
        (an execution that handed its job over, ContinuedAs, joins the chain of the one it
        started), as (listed, described) pairs. At most MAX_LISTED executions are read."""
        chains: list[list[tuple[dict[str, Any], dict[str, Any]]]] = []
        # The chain of an execution that continued another, by its name, until that other
        # one is read.
        waiting: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
        read = 0
        with aws_errors("listing the cluster's jobs"):
            pages = self.sfn.get_paginator("list_executions").paginate(
                stateMachineArn=self.state_machine
            )
            for page in pages:
                for execution in page["executions"]:
                    if (len(chains) >= limit and not waiting) or read >= MAX_LISTED:
                        return chains
                    read += 1
                    described: dict[str, Any] = {}
                    with contextlib.suppress(*UNKNOWN_FIELD):
                        arn = execution["executionArn"]
                        described = self.sfn.describe_execution(executionArn=arn)
                    successor = continued_as(described)
                    chain = waiting.pop(successor, None) if successor else None
                    if chain is None:
                        if len(chains) >= limit:
                            continue  # an older job's execution
                        chain = []
                        chains.append(chain)
                    chain.append((execution, described))
                    if continued_from(described):
                        waiting[execution["name"]] = chain
        return chains

    def rows(self, limit: int = 10) -> list[JobRow]:
        """The newest `limit` jobs with status, duration, attempts and the last step and
        accuracy rank 0 reported (where its node and output are still there). A job that its
        supervisor handed over from execution to execution is one row: the status and
        counters of the newest execution, the time since the oldest one started."""
        now = datetime.now(UTC)
        rows: list[JobRow] = []
        chains = self.chains(limit)
        latest = self.cluster.latest_commands_by_job() if chains else {}
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
                duration=_duration((ended - started).total_seconds()),
                execution=newest["name"],
            )
            with contextlib.suppress(*UNKNOWN_FIELD):
                counters = self._counters(newest["executionArn"])
                if counters:
                    row.attempts = str(counters.get("Attempts", "-"))
                    row.retries = str(counters.get("Retries", "-"))
                    row.legs = str(counters.get("Legs", "-"))
            command = latest.get(row.job_id)
            if command and command.get("RequestedDateTime", now) >= started:
                hosts = command.get("Parameters", {}).get("Hosts", [""])[0].split(",")
                node = nodes.get(hosts[0])
                if node is not None:
                    with contextlib.suppress(*UNKNOWN_FIELD):
                        row.step, row.accuracy = self._progress(command["CommandId"], node)
            rows.append(row)
        return rows

    def _counters(self, arn: str) -> dict[str, Any] | None:
        """The attempt, retry and leg counters as the execution last carried them."""
        for event in reversed(self.history(arn, newest=100)):
            for key in ("stateExitedEventDetails", "stateEnteredEventDetails"):
                details = event.get(key) or {}
                text = details.get("output") or details.get("input")
                if not text or '"Counters"' not in text:
                    continue
                try:
                    counters = json.loads(text).get("Counters")
                except ValueError:
                    continue
                if isinstance(counters, dict):
                    return counters
        return None

    def _progress(self, command_id: str, node: Node) -> tuple[str, str]:
        """The last step and evaluation accuracy in rank 0's output of a command."""
        log_group = self.cluster.outputs()["TrainingLogGroupName"]
        step, accuracy = "-", "-"
        for name in self.cluster.log_streams(log_group, f"{command_id}/{node.instance_id}/"):
            events = self.cluster.clients.logs.get_log_events(
                logGroupName=log_group, logStreamName=name, startFromHead=False, limit=500
            )["events"]
            for event in events:
                for found in STEP_LINE.finditer(event["message"]):
                    step = f"{found['step']}/{found['total']}"
                for found in EVAL_LINE.finditer(event["message"]):
                    accuracy = f"{found['accuracy']} (step {found['step']})"
        return step, accuracy

    # ----------------------------------------------------------------- stopping
    def stop(self, job_id: str) -> list[str]:
        """Stops the job's running executions (the supervisor neither retries nor starts
        another leg); returns their names. The caller then ends the processes on the nodes.
        An execution stopped in the middle of handing the job over (a new leg, a retry) may
        just have started its successor: the executions are listed again, a moment later,
        until none of the job's runs."""
        stopped: list[str] = []
        for _ in range(STOP_ROUNDS):
            running = [e for e in self.running(job_id) if e["name"] not in stopped]
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
            self.cluster.sleep(HANDOVER_SECONDS)
        return stopped


#: Errors that leave a field of `jobs` at "-" (AWS cannot tell it; the listing goes on).
UNKNOWN_FIELD = (ClientError, BotoCoreError, ClusterError, KeyError, ValueError)


class Detached(Exception):
    """Ctrl-C while following: the job goes on; the message says how to find it again."""


def rows_text(rows: list[JobRow]) -> Iterator[str]:
    yield (
        f"{'JOB':<24} {'STATUS':<10} {'STARTED (UTC)':<16} {'DURATION':>8} {'ATTEMPTS':>8} "
        f"{'RETRIES':>7} {'LEGS':>4} {'STEP':>12}  ACCURACY"
    )
    for r in rows:
        yield (
            f"{r.job_id:<24} {r.status:<10} {r.started:%Y-%m-%d %H:%M} {r.duration:>8} "
            f"{r.attempts:>8} {r.retries:>7} {r.legs:>4} {r.step:>12}  {r.accuracy}"
        )
