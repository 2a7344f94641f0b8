"""The scale rehearsal: one job on a simulated fleet of up to 1,024 nodes, through the same
control plane as the rehearsal (the synthesized state machine in moto's interpreter, the real SSM
documents and their parameter checks, the AWS stand-in) and the operator CLI, with one node
dying mid-job; it measures what grows with the cluster.

    python -m scripts.rehearsal.scale --nodes 64 256 1024

Per size: the seconds from StartExecution to every node running RunTraining, and from a node's
death to every node running it again (the retry: the supervisor's grace, the cancel, the
hand-over, the wait for the replacement, preflight, the new SendCommands); how long `cluster.py
status` and `cluster.py jobs` take while the job runs; the largest state payload in any
execution (the job's and every child's) against the 256 KiB quota; the most history events in
one execution against the 25,000 quota; and every AWS call the supervisor and the CLI made, by
action. The nodes are simulated (scripts/rehearsal/fleet.py); the supervisor polls every 5 seconds
(PollSeconds 5), so the times measure the control plane's own work on this machine, not AWS's
pace.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import resource
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from scripts.cluster_lib.executions import execution_name
from scripts.cluster_lib.job_inputs import prepare
from scripts.cluster_lib.outputs import Stack
from scripts.cluster_lib.queue import JobQueue
from scripts.rehearsal.aws_stand_in import LocalCloud
from scripts.rehearsal.fleet import SimulatedAgents, SimulatedHosts, SimulatedInstances
from scripts.rehearsal.history_pages import whole_history
from scripts.rehearsal.supervisor import local_supervisor, map_run_histories, synthesize_operations

#: Step Functions quotas: the largest input or output of a state (256 KiB) and the most events
#: in one execution's history.
PAYLOAD_LIMIT = 262_144
HISTORY_LIMIT = 25_000
#: The job's supervisor settings: a poll every 5 s (21 batches' children poll at 1,024 nodes,
#: each with two calls, on this machine's two cores) and a short grace once a node has ended.
SETTINGS = {"PollSeconds": 5, "RetryDelaySeconds": 1, "FailureGraceSeconds": 5, "MaxRetries": 1}
CLUSTER_NAME = "scale"
#: Nodes that run RunTraining for real (fleet.py), and the most ranks each starts.
REAL_NODES = 6
REAL_CORES = 16
JOB_ID = "scale-rehearsal"
#: How often a wait for the nodes also looks at the job (seconds).
LOOK_SECONDS = 5.0


@dataclass
class ScaleReport:
    nodes: int
    launch_seconds: float = 0.0
    retry_seconds: float = 0.0
    status_seconds: float = 0.0
    jobs_seconds: float = 0.0
    executions: list[str] = field(default_factory=list)
    final_status: str = ""
    #: The last execution's error and cause, when it did not succeed.
    final_cause: str = ""
    largest_payload: int = 0
    largest_payload_state: str = ""
    job_events: list[int] = field(default_factory=list)
    #: Per Distributed Map run: its children's events together (moto keeps one history per
    #: run; on AWS each child has its own) and the run's number of children.
    map_runs: list[tuple[int, int]] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)
    notifications: list[str] = field(default_factory=list)
    #: The wake executions (one per event: stacks/supervisor_wake.py) by status, and the first
    #: failed one's failure events.
    wakes: dict[str, int] = field(default_factory=dict)
    wake_failure: list[str] = field(default_factory=list)
    #: The real nodes' (--nnodes, --node_rank, position in the host list), both attempts.
    real_ranks: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def most_child_events(self) -> int:
        """The most events one child execution wrote, on average over its map run."""
        return max((-(-events // children) for events, children in self.map_runs), default=0)

    def lines(self) -> list[str]:
        return [
            f"{self.nodes} nodes: job {self.final_status} after {len(self.executions)} executions"
            + (f" ({self.final_cause})" if self.final_cause else ""),
            f"  train to every node launched: {self.launch_seconds:.1f} s ({len(self.real_ranks)}"
            f" launches by the real launch.sh, ranks {sorted(r for _, r, _ in self.real_ranks)})",
            f"  a node's death to every node running again: {self.retry_seconds:.1f} s",
            f"  cluster.py status: {self.status_seconds:.1f} s, jobs: {self.jobs_seconds:.1f} s",
            f"  largest state payload: {self.largest_payload:,} bytes in "
            f"{self.largest_payload_state} (quota {PAYLOAD_LIMIT:,})",
            f"  history events: the job's executions {self.job_events}; a batch's child "
            f"execution at most {self.most_child_events:,} (quota {HISTORY_LIMIT:,} each)",
            "  AWS calls: " + ", ".join(f"{a} {n}" for a, n in sorted(self.calls.items())),
            "  wake executions: " + ", ".join(f"{n} {s}" for s, n in sorted(self.wakes.items())),
            *(f"  a failed wake: {line}" for line in self.wake_failure),
        ]


#: The first state of each Distributed Map's child (one entry per child execution).
CHILD_STARTS = ("ReadBatchNodes", "PreflightSend", "RunTrainingSend")


def _name(event: dict[str, Any]) -> str:
    return str((event.get("stateEnteredEventDetails") or {}).get("name", ""))


def _payloads(events: list[dict[str, Any]]) -> Iterator[tuple[int, str]]:
    """(bytes, state) of every state output and task result in a history."""
    name = ""
    for event in events:
        entered = event.get("stateEnteredEventDetails")
        if entered:
            name = entered["name"]
        for key in ("stateExitedEventDetails", "taskSucceededEventDetails"):
            details = event.get(key)
            if details and "output" in details:
                yield len(details["output"].encode()), details.get("name", name)


def _real_ranks(
    cloud: LocalCloud, agents: SimulatedAgents, commands: frozenset[str]
) -> list[tuple[int, int, int]]:
    """For each real node of this attempt: (--nnodes, --node_rank its torchrun got, its
    address's position in the command's host list)."""
    found = []
    for instance in agents.real_instances():
        for command_id in commands:
            started = instance.root / f"{command_id}.started"
            if not started.is_file():
                continue
            args = started.read_text().split()
            hosts = cloud.ssm.commands[command_id].parameters["Hosts"][0].split(",")
            found.append((int(args[1]), int(args[3]), hosts.index(instance.address)))
    return found


def _timed_cli(cloud: LocalCloud, command: str) -> float:
    from scripts.cluster import main as cluster_main

    started = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = cluster_main([command, "--cluster-name", cloud.cluster_name],
                            session=cloud.session())  # fmt: skip
    if code != 0:
        raise RuntimeError(f"cluster.py {command} exited {code}")
    return time.monotonic() - started


def _follow(client: Any, chain: list[str]) -> dict[str, Any]:
    """The job's latest execution, described; `chain`, its executions so far, grows by each
    successor that an ended one names (ContinuedAs: a retry's or a leg's hand-over). RUNNING
    too while the job queue's dispatcher has yet to start the first."""
    while True:
        try:
            described: dict[str, Any] = client.describe_execution(executionArn=chain[-1])
        except client.exceptions.ExecutionDoesNotExist:
            if len(chain) > 1:
                raise
            return {"status": "RUNNING"}
        successor = json.loads(described.get("output") or "{}").get("ContinuedAs")
        if described["status"] == "RUNNING" or not successor:
            return described
        chain.append(f"{chain[-1].rsplit(':', 1)[0]}:{successor}")


def _launched(
    agents: SimulatedAgents, client: Any, chain: list[str], *, nodes: int, timeout: float,
    waiting_for: str, after: frozenset[str] = frozenset(),
) -> frozenset[str]:  # fmt: skip
    """`agents.wait_launched`, LOOK_SECONDS at a time: fails at once, with the job's status and
    cause, where the job ended meanwhile, and after `timeout` (an upper bound only) naming
    `waiting_for`."""
    deadline = time.monotonic() + timeout
    while True:
        left = max(deadline - time.monotonic(), 0.0)
        try:
            return agents.wait_launched(nodes, min(LOOK_SECONDS, left), after=after)
        except TimeoutError as error:
            described = _follow(client, chain)
            if described["status"] != "RUNNING":
                why = ": ".join(
                    str(described[key])[:1000] for key in ("error", "cause") if described.get(key)
                )
                raise RuntimeError(
                    f"the job ended {described['status']} while the rehearsal waited for "
                    f"{waiting_for} ({error}){': ' + why if why else ''}"
                ) from None
            if left <= 0:
                raise TimeoutError(f"waited {timeout} s for {waiting_for}: {error}") from None


def rehearse(
    nodes: int,
    output: Path,
    *,
    timeout: float = 1200,
    synthesized: tuple[str, dict[str, Any]] | None = None,
) -> ScaleReport:
    """One job on `nodes` simulated nodes, one of which dies once every node runs it.
    `synthesized`: a cluster's name and its operations template, synthesized elsewhere with
    cdk.json's context and node_count=`nodes` (a test session's cached synth); by default
    the cluster `scale` is synthesized here."""
    report = ScaleReport(nodes)
    cluster_name, template = synthesized or (
        CLUSTER_NAME,
        synthesize_operations(CLUSTER_NAME, nodes),
    )
    hosts: Any = SimulatedHosts(nodes)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    room = REAL_CORES if hard == resource.RLIM_INFINITY else (hard - 1024) // nodes

    class Fleet(SimulatedInstances):
        # The first, the middle (the one that dies) and the last node, and a few between,
        # run RunTraining for real; as many ranks a node as the open-file hard limit of this
        # machine leaves room for (launch.sh refuses a job that needs more, in one line).
        real_slots = frozenset(
            {round(i * (nodes - 1) / (REAL_NODES - 1)) for i in range(REAL_NODES)} | {nodes // 2}
        )
        real_cores = max(1, min(REAL_CORES, room))

    with (
        LocalCloud(hosts, output, cluster_name=cluster_name, instances=Fleet) as cloud,
        local_supervisor(cloud, template) as arn,
        map_run_histories() as children,
        contextlib.ExitStack() as stack,
    ):
        agents = SimulatedAgents(cloud.instances)  # type: ignore[arg-type]
        stack.callback(agents.close)
        agents.attach(cloud)
        client = cloud.client("stepfunctions")
        # The job's code, uploaded as `train` uploads it (the real nodes run it).
        inputs = prepare(
            cloud.client("s3"), cloud.data_bucket, code=None, script=None,
            module=None, data=None, out=lambda _: None,
        )  # fmt: skip
        first_call = len(cloud.calls)
        started = time.monotonic()
        # As `train` starts a job: queued, then started by the job queue's dispatcher.
        clients = cloud.clients()
        queue = JobQueue(clients.dynamodb, clients.stepfunctions, Stack(
            clients.cloudformation, cloud.cluster_name))  # fmt: skip
        name = execution_name(JOB_ID, datetime.now(UTC))
        queue.enqueue(JOB_ID, name, {"JobId": JOB_ID, **inputs.parameters(), **SETTINGS})
        queue.dispatch()
        execution = f"{arn.replace(':stateMachine:', ':execution:', 1)}:{name}"
        chain = [execution]
        first = _launched(agents, client, chain, nodes=nodes, timeout=timeout,
                          waiting_for="every node to launch")  # fmt: skip
        report.launch_seconds = time.monotonic() - started
        report.real_ranks = _real_ranks(cloud, agents, first)
        report.status_seconds = _timed_cli(cloud, "status")
        report.jobs_seconds = _timed_cli(cloud, "jobs")

        (victim,) = [i for i in cloud.running() if i.slot == nodes // 2]
        died = time.monotonic()
        agents.die(victim)
        second = _launched(agents, client, chain, nodes=nodes, timeout=timeout, after=first,
                           waiting_for="every node to launch again after the death")  # fmt: skip
        report.retry_seconds = time.monotonic() - died
        report.real_ranks += _real_ranks(cloud, agents, second)
        agents.finish()

        deadline = time.monotonic() + timeout
        while (described := _follow(client, chain))["status"] == "RUNNING":
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout} s for the job to end: it still runs")
            time.sleep(0.2)
        report.final_status = described["status"]
        if described["status"] != "SUCCEEDED":
            report.final_cause = f"{described.get('error', '')}: {described.get('cause', '')}"
        report.executions = [a.rsplit(":", 1)[1] for a in chain]
        histories = {a.rsplit(":", 1)[1]: whole_history(client, a) for a in chain}
        histories.update(
            (f"child {n}", list(m.get_event_history())) for n, m in enumerate(children)
        )
        report.job_events = [len(histories[a.rsplit(":", 1)[1]]) for a in chain]
        for manager in children:
            events = list(manager.get_event_history())
            starts = sum(1 for e in events if _name(e) in CHILD_STARTS)
            report.map_runs.append((len(events), max(starts, 1)))
        for events in histories.values():
            for size, state in _payloads(events):
                if size > report.largest_payload:
                    report.largest_payload, report.largest_payload_state = size, state
        report.calls = dict(Counter(itertools.islice(cloud.calls, first_call, None)))
        report.notifications = [n["Subject"] for n in cloud.notifications]
        if cloud.wake is not None:
            outcomes = cloud.wake.outcomes()
            report.wakes = dict(Counter(outcome.status for outcome in outcomes))
            failed = [outcome for outcome in outcomes if outcome.failed]
            if failed:
                report.wake_failure = failed[0].lines()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 1024])
    args = parser.parse_args(argv)
    for count in args.nodes:
        if not 2 <= count <= 1024:
            parser.error(f"--nodes {count} is not allowed: use 2 to 1024")
    for count in args.nodes:
        with tempfile.TemporaryDirectory(prefix="scale-rehearsal-") as folder:
            report = rehearse(count, Path(folder))
        print("\n".join(report.lines()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
