"""Faults the job supervisor rides out, rehearsed through its synthesized state machine (moto's
ASL interpreter, scripts/rehearsal/supervisor.py) against the AWS stand-in over a simulated
fleet (scripts/rehearsal/fleet.py: the nodes' agents answer every invocation as the test tells
them, no process runs on a node): the wait for nodes that never ends, a stop that reaches the
nodes while the supervisor runs, an agent cut off from SSM, a SendCommand that fails after SSM
accepted it, and a new job racing a hand-over.

The waits of the state machine (PollSeconds, the grace, the retry delay) pass at once here
(`instant_waits`): a job's hours of waiting take seconds, and nothing in these tests depends on
how long a wait takes, only on how many there were (the supervisor counts its waits in
PollSeconds, stacks/supervisor_workflow.py).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest

from scripts.rehearsal.aws_stand_in import LocalCloud
from scripts.rehearsal.fleet import SimulatedAgents, SimulatedHosts, SimulatedInstances
from scripts.rehearsal.supervisor import definition as machine_definition
from scripts.rehearsal.supervisor import local_supervisor, map_run_histories
from stacks.supervisor_limits import LEG_SECONDS, MAX_NODE_WAITS
from tests.cdk_support import Synth
from tests.test_supervisor import Supervisor, default, placeholder_refs, states

__all__ = ["default"]  # the default cluster's synth, a fixture of test_supervisor

#: The default cluster's job settings in these rehearsals: waits pass at once (instant_waits),
#: so PollSeconds only says how much waiting each poll counts for. The simulated agents write
#: no progress line, and the counted seconds run far ahead of the test's clock: the hang limits
#: lie past RunTraining's own poll limit, so the progress reader (stacks/supervisor_progress.py)
#: never ends an attempt here while the test is still acting on it (at the defaults it did after
#: 15 instant polls: CompileHangSeconds 10800 / 720).
SETTINGS = {
    "PollSeconds": 720, "RetryDelaySeconds": 1, "FailureGraceSeconds": 5,
    "HangSeconds": 2 * LEG_SECONDS, "CompileHangSeconds": 2 * LEG_SECONDS,
}  # fmt: skip


@contextlib.contextmanager
def instant_waits() -> Iterator[None]:
    """Every Wait state of moto's interpreter (moto/stepfunctions/parser/asl/component/state/
    wait/wait_function/wait_function.py, WaitFunction._wait_interval) passes at once, and so
    does every callback wait's time limit (the polls' WaitForWake: StateTaskServiceCallback.
    _wait_for_task_token_timeout, in state_task/service/state_task_service_callback.py)."""
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_callback import (  # noqa: E501
        StateTaskServiceCallback,
    )
    from moto.stepfunctions.parser.asl.component.state.wait.wait_function.wait_function import (
        WaitFunction,
    )

    def at_once(self: Any, env: Any, wait_seconds: int) -> None:
        env.program_state_event.wait(0.005)

    original = StateTaskServiceCallback._wait_for_task_token_timeout

    def callback_at_once(self: Any, timeout_seconds: int, callback_endpoint: Any) -> Any:
        return original(self, 0.005, callback_endpoint)  # type: ignore[arg-type]

    with (
        patch.object(WaitFunction, "_wait_interval", at_once),
        patch.object(StateTaskServiceCallback, "_wait_for_task_token_timeout", callback_at_once),
    ):
        yield


@contextlib.contextmanager
def simulated(
    tmp_path: Path, synthesized: Synth, nodes: int
) -> Iterator[tuple[LocalCloud, SimulatedAgents, Supervisor]]:
    """`nodes` simulated nodes (any number: the cluster's node_count is the synthesized one),
    their agents, and the synthesized state machine in moto's interpreter."""
    with (
        LocalCloud(
            SimulatedHosts(nodes),  # type: ignore[arg-type]
            tmp_path,
            cluster_name=synthesized.config.cluster_name,
            instances=SimulatedInstances,
        ) as cloud,
        local_supervisor(cloud, synthesized.templates["operations"]) as arn,
        map_run_histories() as map_runs,
        instant_waits(),
    ):
        agents = SimulatedAgents(cloud.instances)  # type: ignore[arg-type]
        agents.attach(cloud)
        try:
            yield cloud, agents, Supervisor(cloud, arn, map_runs)
        finally:
            agents.close()


def ended(supervisor: Supervisor, execution: str, timeout: float, most: int = 4) -> str:
    """The status of the job's last execution once the chain ended; fails once the job has
    gone through more than `most` executions (a wait that never ends hands itself over
    forever) or after `timeout` seconds (an upper bound only)."""
    deadline = time.monotonic() + timeout
    while True:
        chain = supervisor.chain(execution)
        assert len(chain) <= most, f"the job went on through {len(chain)} executions"
        status = supervisor.status(chain[-1])
        if status != "RUNNING" and supervisor.successor(chain[-1]) is None:
            return status
        assert time.monotonic() < deadline, supervisor.trace(execution)
        time.sleep(0.2)


def subjects(cloud: LocalCloud) -> list[str]:
    return [n["Subject"].split(" ", 3)[-1] for n in cloud.notifications]


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


# ------------------------------------------------------------------ the wait for nodes


@pytest.mark.slow
def test_a_wait_for_nodes_that_never_ends_tells_the_operator_and_fails_at_its_limit(
    tmp_path: Path, default: Synth
) -> None:
    """No capacity: one of the cluster's two nodes runs (a Capacity Block scaled to 0 has
    none). The supervisor polls for nodes, hands the job over after MAX_NODE_WAITS polls and
    says so on the topic, and once it has waited node_wait_hours in all (counted over the
    hand-over) ends FAILED, naming how many nodes it saw of how many it needs: the EventBridge
    rule on FAILED executions (stacks/supervisor.py) then reaches the operator too. Before,
    the job handed itself over forever and no one heard of it after the start."""
    config = default.config
    limit = config.node_wait_hours * 3600
    polls = -(-limit // SETTINGS["PollSeconds"])
    assert MAX_NODE_WAITS < polls < 2 * MAX_NODE_WAITS  # one hand-over, then the limit
    with simulated(tmp_path, default, 1) as (cloud, _, supervisor):
        execution = supervisor.start("no-capacity", **SETTINGS)
        assert ended(supervisor, execution, 600) == "FAILED"
        chain = supervisor.chain(execution)
        assert len(chain) == 2, chain
        failed = supervisor.describe(chain[-1])
        assert failed["error"] == "JobFailed"
        said = f"1 of {config.node_count} nodes InService and healthy after {polls * 720} s"
        assert said in failed["cause"], failed["cause"]
        assert subjects(cloud) == ["started", "waits for nodes", "failed"], subjects(cloud)
        waiting = cloud.notifications[1]["Message"]
        assert f"1 of {config.node_count} nodes InService and healthy after " in waiting
        assert f"{MAX_NODE_WAITS} polls" in waiting and "fails after 24 hours" in waiting
        assert said in cloud.notifications[2]["Message"]
        handed = json.loads(supervisor.describe(chain[0])["output"])
        assert handed["Why"] in waiting
        # The successor carried the time waited: it failed after the rest of it, not 24 h more.
        successor = json.loads(supervisor.describe(chain[1])["input"])
        assert successor["NodeWaited"] == MAX_NODE_WAITS * SETTINGS["PollSeconds"]
        assert not cloud.commands, "no command may be sent without a full set"


@pytest.mark.slow
def test_more_healthy_nodes_than_the_job_needs_run_it_on_node_count_of_them(
    tmp_path: Path, default: Synth
) -> None:
    """Three InService, healthy nodes in a cluster of two (a group scaled out by hand, a
    replacement launched before the old node left): the job runs on the first two the group
    read, the same two for the same answers, and finishes. Before, FullSet asked for exactly
    node_count and the job waited for ever."""
    nodes = default.config.node_count
    with simulated(tmp_path, default, nodes + 1) as (cloud, agents, supervisor):
        execution = supervisor.start("more-nodes", **SETTINGS)
        commands = agents.wait_launched(nodes, 300)
        agents.finish()
        assert ended(supervisor, execution, 300) == "SUCCEEDED", supervisor.trace(execution)
        (training,) = [cloud.commands[c] for c in commands]
        chosen = [i.instance_id for i in cloud.running()[:nodes]]
        assert list(training.invocations) == chosen
        hosts = training.parameters["Hosts"][0].split(",")
        assert hosts == [i.address for i in cloud.running()[:nodes]]
        assert subjects(cloud) == ["started", "finished"], subjects(cloud)


# ------------------------------------------------------------------------------ a stop


def send_stops(cloud: LocalCloud, job_ids: list[str]) -> None:
    """StopTraining for each of `job_ids` in turn, on every node (as `cluster.py stop` sends it,
    scripts/cluster_lib/node_operations.py), through the stand-in's SSM."""
    ssm = cloud.client("ssm")
    nodes = [i.instance_id for i in cloud.running()]
    for job_id in job_ids:
        ssm.send_command(
            DocumentName=f"{cloud.cluster_name}-StopTraining",
            InstanceIds=nodes,
            Parameters={"JobId": [job_id]},
            Comment=f"{job_id} stop",
        )


@pytest.mark.slow
def test_a_stop_that_reaches_the_nodes_while_the_supervisor_runs_is_reported_as_a_stop(
    tmp_path: Path, default: Synth
) -> None:
    """StopTraining reaches the nodes while the job's execution still runs (`cluster.py stop`
    missed it: a successor that an execution started just as it was stopped). The trainers
    save and exit 0 (workload/stop.py), so every invocation ends Success; the supervisor finds
    the job's StopTraining command (ListCommands, sent since the nodes were ready) and ends
    the job stopped, not finished. Before, the job was announced finished."""
    nodes = default.config.node_count
    with simulated(tmp_path, default, nodes) as (cloud, agents, supervisor):
        execution = supervisor.start("stopped", **SETTINGS)
        agents.wait_launched(nodes, 300)
        send_stops(cloud, ["stopped"])
        agents.finish()
        assert ended(supervisor, execution, 300) == "FAILED", supervisor.trace(execution)
        assert supervisor.describe(supervisor.chain(execution)[-1])["error"] == "JobStopped"
        assert subjects(cloud) == ["started", "stopped"], subjects(cloud)


@pytest.mark.slow
def test_the_stop_check_reads_every_page_of_stop_commands(tmp_path: Path, default: Synth) -> None:
    """The job's StopTraining command, then 55 for other jobs (an operator clearing old jobs'
    processes): ListCommands lists newest first, 50 a page at most (SSM API reference,
    ListCommands MaxResults), so the job's own is on a later page. A node then fails; the
    supervisor reads every page and finds the stop: the job ends stopped. Before, it read one
    page and took the stopped job for a failed one."""
    nodes = default.config.node_count
    with simulated(tmp_path, default, nodes) as (cloud, agents, supervisor):
        execution = supervisor.start("paged", MaxRetries=0, **SETTINGS)
        agents.wait_launched(nodes, 300)
        send_stops(cloud, ["paged"] + [f"old-{n}" for n in range(55)])
        agents.fail(cloud.running()[0])
        assert ended(supervisor, execution, 300) == "FAILED", supervisor.trace(execution)
        assert supervisor.describe(supervisor.chain(execution)[-1])["error"] == "JobStopped"
        assert subjects(cloud) == ["started", "stopped"], subjects(cloud)


# ------------------------------------------------------------ statuses against the model


def _status_rules(rule: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(variable, value) of every StringEquals in a Choice rule, nested ones included."""
    if "StringEquals" in rule:
        yield rule["Variable"], rule["StringEquals"]
    for key in ("And", "Or"):
        for inner in rule.get(key, []):
            yield from _status_rules(inner)
    if "Not" in rule:
        yield from _status_rules(rule["Not"])


def test_every_status_the_supervisor_compares_is_one_ssm_gives(default: Synth) -> None:
    """Each Choice that compares a command's or an invocation's Status compares it with a value
    of the enum botocore's SSM model gives that field (Command.Status: CommandStatus,
    CommandInvocation.Status: CommandInvocationStatus); a value outside it can never match.
    "DeliveryTimedOut" was one: a StatusDetails text, not a Status."""
    import botocore.session

    model = botocore.session.get_session().get_service_model("ssm")
    enums = {
        "$.Poll.Command.Status": set(model.shape_for("CommandStatus").enum),
        "$.Invocation.Status": set(model.shape_for("CommandInvocationStatus").enum),
    }
    template = default.templates["operations"]
    compared = [
        (variable, value)
        for _, state in states(machine_definition(template, placeholder_refs(template)))
        if state["Type"] == "Choice"
        for rule in state["Choices"]
        for variable, value in _status_rules(rule)
        if variable.endswith(".Status")
    ]
    assert {variable for variable, _ in compared} == set(enums), compared
    wrong = [(v, value) for v, value in compared if value not in enums[v]]
    assert not wrong, wrong


# ------------------------------------------------------------ an agent cut off from SSM


def test_the_poll_limit_of_each_document_is_its_timeout_and_a_margin(default: Synth) -> None:
    """A batch's poll loop counts the command's waits (PollSeconds each) and ends at the
    document's own timeout (the agent's executionTimeout: Preflight's timeoutSeconds,
    RunTraining's ExecutionTimeout default, which the supervisor does not override) plus
    POLL_LIMIT_MARGIN: the limit the agent enforces, and no longer."""
    from scripts.cluster_lib.documents import load
    from stacks.supervisor_limits import POLL_LIMIT_MARGIN
    from stacks.supervisor_run import execution_timeout

    template = default.templates["operations"]
    found = dict(states(machine_definition(template, placeholder_refs(template))))
    timeouts = {"Preflight": 1800, "RunTraining": 172_800}
    for document, timeout in timeouts.items():
        assert execution_timeout(load(document).content) == timeout
        limit = [c for c in found[f"{document}Ended"]["Choices"]
                 if c.get("Variable") == "$.Alive.Waited"]  # fmt: skip
        assert limit == [{"Variable": "$.Alive.Waited", "NumericGreaterThanEquals":
                          timeout + POLL_LIMIT_MARGIN, "Next": f"{document}PollLimit"}]  # fmt: skip
        # Then the invocations as they stand (stacks/supervisor_results.py).
        assert found[f"{document}PollLimit"]["Next"] == f"{document}NoResultsYet"


@pytest.mark.slow
def test_an_agent_cut_off_from_ssm_does_not_hold_the_job(tmp_path: Path, default: Synth) -> None:
    """One node's agent takes Preflight and is then cut off from SSM: its invocation stays
    InProgress, and the cancel never reaches it (Cancelling, for ever: SSM hears from the agent
    only). Its node still runs, so the poll's check of the nodes in service cannot see it.
    The batch's child stops polling once it has waited Preflight's timeout and the margin,
    reads the invocations as they stand and classifies the cut-off node's as bad; the job
    (no retries left) fails naming it. Before, the child polled until its history ran out
    (about 49 hours for RunTraining)."""
    nodes = default.config.node_count
    with simulated(tmp_path, default, nodes) as (cloud, agents, supervisor):
        cut_off = cloud.running()[-1]
        start = agents._start

        def deliver(command_id: str, document: str, invocation: Any) -> None:
            if invocation.instance is not cut_off:
                start(command_id, document, invocation)
                return
            # Delivered, then nothing more: the agent's last word was InProgress.
            invocation.folder.mkdir(parents=True, exist_ok=True)
            status = {"status": "InProgress", "started": time.time()}
            (invocation.folder / "status.json").write_text(json.dumps(status))

        agents._start = deliver  # type: ignore[method-assign]
        execution = supervisor.start("cut-off", MaxRetries=0, **SETTINGS)
        assert ended(supervisor, execution, 300) == "FAILED", supervisor.trace(execution)
        failed = supervisor.describe(supervisor.chain(execution)[-1])
        assert failed["error"] == "JobFailed"
        assert f"{cut_off.instance_id}: Preflight ended Cancelling" in failed["cause"], failed
        assert "PreflightPollLimit" in supervisor.entered(execution)
        (preflight,) = cloud.commands.values()
        assert preflight.invocations[cut_off.instance_id].status()["status"] == "Cancelling"
        assert subjects(cloud) == ["started", "failed"], subjects(cloud)


# ------------------------------------------------------ a send that fails after acceptance


@pytest.mark.slow
def test_a_send_that_fails_after_ssm_accepted_it_is_followed_not_sent_again(
    tmp_path: Path, default: Synth
) -> None:
    """SSM accepts the first RunTraining SendCommand (its nodes start it), then the call fails
    (InternalServerError, one of SendCommand's errors in botocore's SSM model). The supervisor
    does not send it again: it finds the command (ListCommands for the batch's first node since
    the nodes were ready), follows it, and the job finishes with one RunTraining command.
    Before, the task's Retry sent a second command, and the first ran on unfollowed."""
    from scripts.rehearsal.ssm_stand_in import LocalError

    nodes = default.config.node_count
    with simulated(tmp_path, default, nodes) as (cloud, agents, supervisor):
        send = cloud.ssm._ssm_SendCommand
        failed: list[str] = []

        def accepted_then_failed(params: dict[str, Any]) -> dict[str, Any]:
            answer: dict[str, Any] = send(params)
            if params["DocumentName"].endswith("RunTraining") and not failed:
                failed.append(answer["Command"]["CommandId"])
                raise LocalError("InternalServerError", "the request failed after acceptance")
            return answer

        cloud.ssm._ssm_SendCommand = accepted_then_failed  # type: ignore[method-assign]
        execution = supervisor.start("sent-once", **SETTINGS)
        commands = agents.wait_launched(nodes, 300)
        assert set(commands) == set(failed)
        agents.finish()
        assert ended(supervisor, execution, 300) == "SUCCEEDED", supervisor.trace(execution)
        training = [c for c in cloud.commands if cloud.commands[c].document.endswith("Training")]
        assert training == failed, training
        assert "RunTrainingSentAnyway" in supervisor.entered(execution)
        assert subjects(cloud) == ["started", "finished"], subjects(cloud)
