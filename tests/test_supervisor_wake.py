"""The wake of the supervisor's polls (stacks/supervisor_wake.py), rehearsed through the
synthesized state machines: the batches' children park on the wake queue (moto's SQS), the wake
state machine runs in moto's ASL interpreter, and EventBridge's rules are applied as the template
has them to the events the stand-ins' changes make (scripts/rehearsal/wake.py).

With PollSeconds 600 a job's invocations ending, a rank that crashes and a node that dies are
acted on within seconds; with the rules' delivery off (no wake) the same waits run out, as the
polls then wait their full PollSeconds. The history events a timed poll and a woken poll write
are counted in a child's real history against stacks/supervisor_limits.py, and a child woken
more than WAKE_BUDGET times falls back to the plain Wait.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.rehearsal.aws_stand_in import LocalCloud
from scripts.rehearsal.fleet import SimulatedAgents, SimulatedHosts, SimulatedInstances
from scripts.rehearsal.job_queue import matches
from scripts.rehearsal.supervisor import definition as machine_definition
from scripts.rehearsal.supervisor import local_supervisor, map_run_histories
from scripts.rehearsal.wake import invocation_event, terminate_event
from stacks.supervisor_limits import (
    EVENTS_PER_POLL,
    EVENTS_PER_PROGRESS_READ,
    EVENTS_PER_WAKE,
    WAKE_BUDGET,
)
from stacks.supervisor_wake import (
    INVOCATION_ENDED,
    PARK_DELAY,
    RETENTION_SECONDS,
    SETTLE_SECONDS,
    STALE_PER_CHILD,
    WAKE_ROUNDS,
)
from tests.cdk_support import Synth, synth
from tests.test_supervisor import Supervisor, _name, _seconds, default, placeholder_refs, states
from tests.test_supervisor_faults import ended

__all__ = ["default"]  # the default cluster's synth, a fixture of test_supervisor

#: A long poll: without a wake nothing happens for ten minutes.
SLOW = {"PollSeconds": 600, "RetryDelaySeconds": 1, "FailureGraceSeconds": 5}
#: What "within seconds" allows on 2 shared cores: an upper bound only, far below PollSeconds.
PROMPT = 90
#: How long a run without the wake is watched for doing nothing (see its use).
QUIET = 30


@contextlib.contextmanager
def simulated(
    tmp_path: Path, synthesized: Synth, nodes: int, *, wake: bool = True
) -> Iterator[tuple[LocalCloud, SimulatedAgents, Supervisor]]:
    """`nodes` simulated nodes and the synthesized state machines in moto, waits as long as
    they are (no instant waits); `wake` False: the wake's rules deliver nothing."""
    with (
        LocalCloud(
            SimulatedHosts(nodes),  # type: ignore[arg-type]
            tmp_path,
            cluster_name=synthesized.config.cluster_name,
            instances=SimulatedInstances,
        ) as cloud,
        local_supervisor(cloud, synthesized.templates["operations"]) as arn,
        map_run_histories() as map_runs,
    ):
        cloud.wake.enabled = wake
        agents = SimulatedAgents(cloud.instances)  # type: ignore[arg-type]
        agents.attach(cloud)
        try:
            yield cloud, agents, Supervisor(cloud, arn, map_runs)
        finally:
            agents.close()


def _rules(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (machine,) = [
        k
        for k, v in template["Resources"].items()
        if v["Type"] == "AWS::StepFunctions::StateMachine" and k.startswith("JobSupervisorWake")
    ]
    return {
        k: v["Properties"]
        for k, v in template["Resources"].items()
        if v["Type"] == "AWS::Events::Rule"
        and any(t.get("Arn") == {"Ref": machine} for t in v["Properties"]["Targets"])
    }


def test_the_rules_match_the_events_that_end_a_wait_and_no_others(default: Synth) -> None:
    """The synthesized rules' patterns, applied to events shaped as the services send them
    (EventBridge event examples for Systems Manager, Run Command; Amazon EC2 Auto Scaling event
    reference, scale-in lifecycle action): an ended invocation of RunTraining or Preflight and
    a node the group terminates start the wake; an invocation that starts, another document's
    and another group's node do not."""
    template = default.templates["operations"]
    rules = list(_rules(template).values())
    assert len(rules) == 2
    documents = {
        k: v for k, v in template["Resources"].items() if v["Type"] == "AWS::SSM::Document"
    }
    # The documents' names are CloudFormation's (the template names none): any will do.
    refs = {k: f"deployed-{k}" for k in documents}

    def resolve(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {"Ref"}:
                return refs[value["Ref"]]
            return {k: resolve(v) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v) for v in value]
        return value

    patterns = [resolve(r["EventPattern"]) for r in rules]
    cluster = default.config.cluster_name

    class _Instance:
        instance_id = "i-0000000000000000a"

    class _Invocation:
        instance = _Instance()

    class _Command:
        command_id = "c0ffee00-0000-4000-8000-000000000000"
        requested = __import__("datetime").datetime(2026, 11, 26)

        def __init__(self, document: str) -> None:
            self.document = document

    def woken(event: dict[str, Any]) -> bool:
        return any(matches(p, event) for p in patterns)

    for document in ("RunTraining", "Preflight"):
        command = _Command(refs[f"{document}Document"])
        for status in INVOCATION_ENDED:
            assert woken(invocation_event(command, _Invocation(), status, "us-east-1"))
        assert not woken(invocation_event(command, _Invocation(), "InProgress", "us-east-1"))
    stop = _Command(refs["StopTrainingDocument"])
    assert not woken(invocation_event(stop, _Invocation(), "Success", "us-east-1"))
    group = default.config.auto_scaling_group_name
    assert woken(terminate_event(group, f"{cluster}-terminating", "i-1", "us-east-1"))
    assert not woken(terminate_event("other", "hook", "i-1", "us-east-1"))


def test_the_wake_reads_every_parked_child_of_the_largest_cluster() -> None:
    """1,024 nodes are 21 batches, each a child parked with one message and, at the default
    PollSeconds (300 s), up to 13 stale ones: one per wait that ran out within the queue's
    retention (3,900 s: the longest PollSeconds, 3,600 s, and 300). Older messages come first,
    so the wake reads them all: 21 x 14 = 294 messages, 30 rounds of 10, and one that finds
    the queue empty. The definition's loop allows that many (MoreRounds)."""
    assert (RETENTION_SECONDS, STALE_PER_CHILD) == (3900, 13)
    assert WAKE_ROUNDS == 31
    template = synth(node_count="1024").templates["operations"]
    wake = machine_definition(template, placeholder_refs(template), construct="JobSupervisorWake")
    (more,) = wake["States"]["MoreRounds"]["Choices"]
    assert more["NumericLessThan"] == WAKE_ROUNDS


def test_every_park_is_delayed_less_than_the_wake_settles(default: Synth) -> None:
    """Every wait on the wake queue (the polls' and the grace's, of both documents) sends its
    message with DelaySeconds PARK_DELAY, within SQS's 0 to 900, and shorter than the wake's
    long poll once the queue was empty (SETTLE_SECONDS, its WaitTimeSeconds)."""
    template = default.templates["operations"]
    machine = machine_definition(template, placeholder_refs(template))
    parks = {
        name: state
        for name, state in states(machine)
        if state.get("Resource") == "arn:aws:states:::sqs:sendMessage.waitForTaskToken"
    }
    assert sorted(parks) == sorted(
        f"{d}{w}" for d in ("Preflight", "RunTraining") for w in ("WaitForWake", "GraceForWake")
    )
    assert {s["Parameters"]["DelaySeconds"] for s in parks.values()} == {PARK_DELAY}
    assert 0 < PARK_DELAY <= 900 and PARK_DELAY < SETTLE_SECONDS
    wake = machine_definition(template, placeholder_refs(template), construct="JobSupervisorWake")
    assert wake["States"]["SettleReceive"]["Parameters"]["WaitTimeSeconds"] == SETTLE_SECONDS


def test_a_wait_no_longer_than_the_park_delay_is_plain(default: Synth) -> None:
    """Each park's Choice sends a wait of PARK_DELAY or less (its own seconds: PollSeconds, or
    FailureGraceSeconds for the grace) to the plain Wait, as it does a child past its budget:
    no wake could end such a wait early, and each would leave a stale message behind (one a
    second at PollSeconds 1) for every wake to read and refuse."""
    template = default.templates["operations"]
    found = dict(states(machine_definition(template, placeholder_refs(template))))
    for document in ("Preflight", "RunTraining"):
        for choice, plain, seconds in (
            ("Wait", "WaitPlain", "$.Job.PollSeconds"),
            ("GraceWait", "WaitGrace", "$.Job.FailureGraceSeconds"),
        ):
            (rule,) = found[f"{document}{choice}"]["Choices"]
            assert rule["Next"] == f"{document}{plain}", rule
            assert {"Variable": seconds, "NumericLessThanEquals": PARK_DELAY} in rule["Or"], rule
            assert {"Variable": "$.Alive.Woken", "NumericGreaterThanEquals": WAKE_BUDGET} in (
                rule["Or"]
            ), rule


@pytest.mark.slow
def test_a_short_poll_never_parks_on_the_queue(tmp_path: Path, default: Synth) -> None:
    """PollSeconds and FailureGraceSeconds 5 (PARK_DELAY): a crash ends the job through plain
    waits only, and the queue never holds a message."""
    nodes = default.config.node_count
    with simulated(tmp_path, default, nodes) as (cloud, agents, supervisor):
        settings = {"PollSeconds": 5, "RetryDelaySeconds": 1, "FailureGraceSeconds": 5}
        execution = supervisor.start("short", MaxRetries=0, **settings)
        agents.wait_launched(nodes, PROMPT)
        agents.fail(cloud.running()[-1], 1)
        assert ended(supervisor, execution, PROMPT) == "FAILED", supervisor.trace(execution)
        entered = [_name(e) for events in supervisor.child_events() for e in events]
        assert "RunTrainingWaitPlain" in entered and "RunTrainingWaitGrace" in entered
        assert not [n for n in entered if n and n.endswith(("ForWake", "Woken"))], entered
        sqs = cloud.session().client("sqs", region_name=cloud.region)
        (url,) = sqs.list_queues()["QueueUrls"]
        counts = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["All"])["Attributes"]
        assert counts["ApproximateNumberOfMessages"] == "0", counts
        assert counts["ApproximateNumberOfMessagesNotVisible"] == "0", counts
        assert counts["ApproximateNumberOfMessagesDelayed"] == "0", counts


@pytest.mark.slow
def test_a_burst_of_events_wakes_a_child_at_most_once_per_park_delay(
    tmp_path: Path, default: Synth
) -> None:
    """Twelve nodes' invocations end one after another, half a second apart, at PollSeconds and
    FailureGraceSeconds 600:
    twelve events, twelve wakes. Each woken wait of RunTraining's child lasted at least
    PARK_DELAY (its message was invisible until then), so the burst costs the child a few polls,
    not its WAKE_BUDGET; and the job ends within PROMPT of the last end. Without the delay each
    wake woke the child again every round it received the message it had just parked with:
    wakes milliseconds apart, the budget spent within the burst, and the last end seen only at
    the next timed poll, ten minutes later."""
    nodes = 12
    cluster = synth(node_count=str(nodes))
    with simulated(tmp_path, cluster, nodes) as (cloud, agents, supervisor):
        # Only events end a wait here: a grace as long as the poll.
        execution = supervisor.start("burst", MaxRetries=0, **{**SLOW, "FailureGraceSeconds": 600})
        agents.wait_launched(nodes, PROMPT)
        for instance in cloud.running():
            agents.fail(instance, 0)  # a node whose training ended well
            time.sleep(0.5)  # the burst's pace: what the wake must cope with, not a bound
        last = time.monotonic()
        assert ended(supervisor, execution, PROMPT) == "SUCCEEDED", supervisor.trace(execution)
        seconds = time.monotonic() - last
        (events,) = supervisor.child_events("RunTraining")
        entered = [(e, _name(e)) for e in events if e["type"].endswith("StateEntered")]
        parked = None
        waits = []
        for event, name in entered:
            # The polls' waits, and the grace's once the first node's invocation has ended.
            if name in ("RunTrainingWaitForWake", "RunTrainingGraceForWake"):
                parked = _seconds(event["timestamp"])
            elif name in ("RunTrainingWoken", "RunTrainingGraceWoken") and parked is not None:
                waits.append(_seconds(event["timestamp"]) - parked)
                parked = None
        assert waits, "the child was never woken"
        assert min(waits) >= PARK_DELAY, waits
        assert len(waits) < WAKE_BUDGET
        assert len(cloud.wake.delivered) >= nodes
        print(f"\n{len(cloud.wake.delivered)} events, the child woken {len(waits)} times "
              f"(waits {', '.join(f'{w:.1f}' for w in waits)} s); the job ended {seconds:.1f} s "
              f"after the last node's end at PollSeconds 600")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("wake", [True, False], ids=["woken", "timed"])
def test_a_crashed_rank_is_acted_on_within_seconds_at_a_600_s_poll(
    tmp_path: Path, default: Synth, wake: bool
) -> None:
    """PollSeconds 600: preflight's invocations end and wake the poll, RunTraining starts;
    one node's trainer crashes (its invocation Failed), the wake polls at once, the grace
    passes, the rest is cancelled and the job (no retries) fails naming the node, all within
    PROMPT seconds. Without the wake the preflight's first poll is ten minutes away: the same
    wait runs out."""
    nodes = default.config.node_count
    with simulated(tmp_path, default, nodes, wake=wake) as (cloud, agents, supervisor):
        execution = supervisor.start("crash", MaxRetries=0, **SLOW)
        if not wake:
            # Three times what the woken run takes to launch here (about 10 s on 2 shared cores),
            # a twentieth of PollSeconds: what the wait without a wake is shown not to do.
            with pytest.raises(TimeoutError):
                agents.wait_launched(nodes, QUIET)
            return
        agents.wait_launched(nodes, PROMPT)
        victim = cloud.running()[-1]
        crashed = time.monotonic()
        agents.fail(victim, 1)
        assert ended(supervisor, execution, PROMPT) == "FAILED", supervisor.trace(execution)
        seconds = time.monotonic() - crashed
        cause = supervisor.describe(supervisor.chain(execution)[-1])["cause"]
        assert f"{victim.instance_id}: RunTraining failed with status 1" in cause, cause
        assert cloud.wake.delivered, "no event started the wake"
        print(f"\ncrash to the job's end at PollSeconds 600: {seconds:.1f} s")


@pytest.mark.slow
def test_a_dead_node_is_acted_on_within_seconds_at_a_600_s_poll(
    tmp_path: Path, default: Synth
) -> None:
    """A node dies while RunTraining runs: its invocation never ends, but the group's
    termination of it (the lifecycle action event) wakes the poll, which finds the node gone;
    the grace passes and the job (no retries) fails naming the node, within PROMPT seconds at
    PollSeconds 600."""
    nodes = default.config.node_count
    with simulated(tmp_path, default, nodes) as (cloud, agents, supervisor):
        execution = supervisor.start("dead", MaxRetries=0, **SLOW)
        agents.wait_launched(nodes, PROMPT)
        victim = cloud.running()[-1]
        died = time.monotonic()
        agents.die(victim)
        assert ended(supervisor, execution, PROMPT) == "FAILED", supervisor.trace(execution)
        seconds = time.monotonic() - died
        cause = supervisor.describe(supervisor.chain(execution)[-1])["cause"]
        assert f"{victim.instance_id}: node gone" in cause, cause
        kinds = {e["detail-type"] for e in cloud.wake.delivered}
        assert "EC2 Instance-terminate Lifecycle Action" in kinds, kinds
        print(f"\ndeath to the job's end at PollSeconds 600: {seconds:.1f} s")


@pytest.mark.slow
def test_the_grace_ends_once_every_invocation_has_ended(tmp_path: Path, default: Synth) -> None:
    """FailureGraceSeconds 600: one node's trainer crashes, the poll starts the grace and parks
    in it; the other node's invocation ends a moment later (its ranks stopped by the crash, as
    torchrun's agents do), which wakes the grace's wait, and the poll finds the command ended:
    the job (no retries) fails naming both nodes within PROMPT seconds, not after the grace.
    A grace that only timed out (the Wait of before) held the attempt for the full 600 s."""
    nodes = default.config.node_count
    assert nodes >= 2
    settings = {**SLOW, "FailureGraceSeconds": 600}
    with simulated(tmp_path, default, nodes) as (cloud, agents, supervisor):
        execution = supervisor.start("grace", MaxRetries=0, **settings)
        agents.wait_launched(nodes, PROMPT)
        first, *others = cloud.running()
        crashed = time.monotonic()
        agents.fail(first, 1)

        def in_grace() -> bool:
            return any(
                _name(e) == "RunTrainingGraceForWake"
                for events in supervisor.child_events("RunTraining")
                for e in events
            )

        deadline = time.monotonic() + PROMPT
        while not in_grace():
            assert time.monotonic() < deadline, supervisor.trace(execution)
            time.sleep(0.1)
        for other in others:
            agents.fail(other, 1)
        assert ended(supervisor, execution, PROMPT) == "FAILED", supervisor.trace(execution)
        seconds = time.monotonic() - crashed
        cause = supervisor.describe(supervisor.chain(execution)[-1])["cause"]
        for node in [first, *others]:
            assert f"{node.instance_id}: RunTraining failed with status 1" in cause, cause
        (events,) = supervisor.child_events("RunTraining")
        names = [_name(e) for e in events]
        assert "RunTrainingGraceWoken" in names and "RunTrainingCancelRest" not in names, names
        print(f"\ncrash to the job's end with a 600 s grace: {seconds:.1f} s")


def _polls(events: list[dict[str, Any]], document: str) -> list[list[dict[str, Any]]]:
    """A child's history cut at each entry of <Document>Wait: one slice per poll."""
    starts = [i for i, e in enumerate(events) if _name(e) == f"{document}Wait"
              and e["type"].endswith("StateEntered")]  # fmt: skip
    return [events[a:b] for a, b in itertools.pairwise(starts)]


def _parked_tokens(events: list[dict[str, Any]], document: str) -> list[str]:
    """The task tokens a child parked with, in order: each <Document>WaitForWake's message
    (its TaskScheduled event's parameters, with the token resolved)."""
    tokens = []
    for event in events:
        details = event.get("taskScheduledEventDetails")
        if details and '"TaskToken"' in details.get("parameters", ""):
            body = json.loads(details["parameters"])["MessageBody"]
            tokens.append((json.loads(body) if isinstance(body, str) else body)["TaskToken"])
    return tokens


@pytest.mark.slow
def test_polls_and_wakes_write_what_the_history_budget_assumes(
    tmp_path: Path, default: Synth
) -> None:
    """A running RunTraining's child, woken again and again (each token it parks with is sent
    SendTaskSuccess at once, as a herd of wakes would: the wake's own pace is
    test_a_burst_of_events_wakes_a_child_at_most_once_per_park_delay's): each woken poll writes
    EVENTS_PER_WAKE events, each timed one EVENTS_PER_POLL (PollSeconds 8 here), and after
    WAKE_BUDGET wakes the child waits PollSeconds between polls: it parks on the queue no more."""
    nodes = default.config.node_count
    settings = {**SLOW, "PollSeconds": 8}
    with simulated(tmp_path, default, nodes) as (cloud, agents, supervisor):
        execution = supervisor.start("herd", MaxRetries=0, **settings)
        agents.wait_launched(nodes, PROMPT)
        client = cloud.session().client("stepfunctions")

        def child() -> list[dict[str, Any]]:
            (events,) = supervisor.child_events("RunTraining")
            return events

        def timed_poll() -> bool:
            return any(
                all(_name(e) != "RunTrainingWoken" for e in p)
                for p in _polls(child(), "RunTraining")
            )

        # A timed poll first (PollSeconds 8): a whole poll in the history that no wake began.
        deadline = time.monotonic() + PROMPT
        while not timed_poll():
            assert time.monotonic() < deadline, "no timed poll"
            time.sleep(0.1)

        def entered(state: str) -> int:
            return sum(_name(e) == state and e["type"].endswith("StateEntered") for e in child())

        sent: set[str] = set()
        deadline = time.monotonic() + 10 * PROMPT
        while entered("RunTrainingWoken") < WAKE_BUDGET:
            assert time.monotonic() < deadline, f"woken {entered('RunTrainingWoken')} times"
            fresh = [t for t in _parked_tokens(child(), "RunTraining") if t not in sent]
            if not fresh:
                time.sleep(0.05)
                continue
            sent.add(fresh[-1])
            # A token whose wait ran out meanwhile is refused, as it would be a wake's.
            with contextlib.suppress(client.exceptions.TaskTimedOut,
                                     client.exceptions.InvalidToken):  # fmt: skip
                client.send_task_success(taskToken=fresh[-1], output="{}")
        # Past the budget the child parks no more: two plain waits follow, and no token.
        parked = len(_parked_tokens(child(), "RunTraining"))
        deadline = time.monotonic() + PROMPT
        while entered("RunTrainingWaitPlain") < 2:
            assert time.monotonic() < deadline, "no plain wait after the budget"
            time.sleep(0.1)
        assert len(_parked_tokens(child(), "RunTraining")) == parked
        agents.finish()
        assert ended(supervisor, execution, PROMPT) == "SUCCEEDED", supervisor.trace(execution)
        polls = _polls(child(), "RunTraining")
        woken = [p for p in polls if any(_name(e) == "RunTrainingWoken" for e in p)]
        plain = [p for p in polls if any(_name(e) == "RunTrainingWaitPlain" for e in p)]
        timed = [p for p in polls if p not in woken and p not in plain]
        assert len(woken) == WAKE_BUDGET, (len(woken), len(polls))
        # The first batch reads the job's progress at the first poll and then at most once per
        # ProgressReadSeconds (stacks/supervisor_progress.py): EVENTS_PER_PROGRESS_READ more
        # at most, in a timed or a woken poll alike.
        reading = [p for p in polls if any(_name(e) == "RunTrainingReadProgress" for e in p)]
        assert reading, len(polls)
        for p in reading:
            own = EVENTS_PER_WAKE if p in woken else EVENTS_PER_POLL
            assert len(p) <= own + EVENTS_PER_PROGRESS_READ, [str(e["type"]) for e in p]
        woken = [p for p in woken if p not in reading]
        timed = [p for p in timed if p not in reading]
        plain = [p for p in plain if p not in reading]
        assert {len(p) for p in woken} == {EVENTS_PER_WAKE}, [
            [e["type"] for e in p] for p in woken[:1]
        ]
        assert timed and {len(p) for p in timed} == {EVENTS_PER_POLL}, [
            [str(e["type"]) for e in p] for p in timed[:1]
        ]
        assert plain and max(len(p) for p in plain) <= EVENTS_PER_POLL
        print(json.dumps({"woken": len(woken), "timed": len(timed), "plain": len(plain)}))
