"""stacks/api_rates.py: the AWS API calls a job makes per minute, by action, against the
documented quotas (Step Functions developer guide, Quotas; Request throttling for the Amazon EC2
API; CloudWatch Logs quotas: the pages are named in the module), and the model cross-checked
against the synthesized state machine at 1,024 nodes, so that it fails when the definition
changes what a loop calls."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

from scripts.cluster_lib.clients import Patience
from scripts.cluster_lib.executions import MAX_LISTED
from scripts.rehearsal.supervisor import definition as machine_definition
from stacks import api_rates as rates
from stacks import supervisor_group, supervisor_wake
from stacks.supervisor_limits import (
    DEFAULT_POLL_SECONDS,
    PROGRESS_READ_SECONDS,
    SEND_BATCH,
    invocation_pages,
    min_poll_seconds,
)
from tests.cdk_support import synth
from tests.test_supervisor import placeholder_refs, states

#: The SDK resource each action is called through (arn:aws:states:::aws-sdk:<service>:<action>).
SDK = "arn:aws:states:::aws-sdk:"


@pytest.fixture(scope="module")
def found() -> dict[str, dict[str, Any]]:
    template = synth(node_count="1024").templates["operations"]
    return dict(states(machine_definition(template, placeholder_refs(template))))


def loop(found: dict[str, dict[str, Any]], start: str) -> list[str]:
    """The states of the loop from `start` back to it, following each state's Next (a Choice's
    Default: the way round when nothing has ended)."""
    names, name = [], start
    while True:
        names.append(name)
        name = found[name].get("Next") or found[name]["Default"]
        if name == start:
            return names


def sdk_calls(found: dict[str, dict[str, Any]], names: list[str]) -> list[str]:
    """The IAM-style actions of the SDK tasks among `names` (ssm:listCommands ...)."""
    return sorted(
        found[n]["Resource"].removeprefix(SDK)
        for n in names
        if found[n]["Type"] == "Task" and found[n]["Resource"].startswith(SDK)
    )


def longest_path(found: dict[str, dict[str, Any]], start: str) -> int:
    """The most states one pass from `start` to an end enters (Next, Choices, Default, Catch)."""

    def successors(state: dict[str, Any]) -> Iterator[str]:
        for key in ("Next", "Default"):
            if state.get(key):
                yield state[key]
        for rule in state.get("Choices", []) + state.get("Catch", []):
            yield rule["Next"]

    return 1 + max((longest_path(found, n) for n in successors(found[start])), default=0)


# ------------------------------------------------------------------ the model's figures
MIN_POLL = {n: min_poll_seconds(n) for n in (64, 256, 1024)}


def test_the_worst_minute_at_64_256_and_1024_nodes() -> None:
    """Every batch's child polls in the same second (the Distributed Maps start them together),
    so a worst minute holds one poll of every batch whatever PollSeconds is (194 s and more):
    the figures are the same at the minimum and the default, but for the wake's, which read
    the stale messages of the waits that ran out (one per child per PollSeconds within the
    queue's retention: more at the shorter poll)."""
    expected = {
        64: {"ssm:SendCommand": 2, "ssm:ListCommands": 3, "ec2:DescribeTags": 1,
             "autoscaling:DescribeAutoScalingInstances": 5, "ec2:DescribeNetworkInterfaces": 3,
             "autoscaling:SetInstanceHealth": 64, "sqs:SendMessage": 2,
             "cloudwatch:GetMetricData": 1, "events:Invocations": 64},
        256: {"ssm:SendCommand": 6, "ssm:ListCommands": 7, "ec2:DescribeTags": 2,
              "autoscaling:DescribeAutoScalingInstances": 17, "ec2:DescribeNetworkInterfaces": 11,
              "autoscaling:SetInstanceHealth": 256, "sqs:SendMessage": 6,
              "cloudwatch:GetMetricData": 1, "events:Invocations": 256},
        1024: {"ssm:SendCommand": 21, "ssm:ListCommands": 22, "ec2:DescribeTags": 5,
               "autoscaling:DescribeAutoScalingInstances": 62, "ec2:DescribeNetworkInterfaces": 41,
               "autoscaling:SetInstanceHealth": 1024, "sqs:SendMessage": 21,
               "cloudwatch:GetMetricData": 1, "events:Invocations": 1024},
    }  # fmt: skip
    # (ReceiveMessage, SendTaskSuccess and DeleteMessage, transitions) at the minimum poll and
    # at the default: stale messages 2 x 20 and 2 x 13 at 64 nodes, 21 x 20 and 21 x 13 at 1,024.
    waking = {
        64: [(133, 42, 1046), (131, 28, 1008)],
        256: [(525, 126, 3894), (521, 84, 3790)],
        1024: [(2093, 441, 15205), (2078, 294, 14836)],
    }
    for nodes, figures in expected.items():
        for poll, wake in zip((MIN_POLL[nodes], DEFAULT_POLL_SECONDS), waking[nodes], strict=True):
            worst = rates.worst_minute(nodes, poll)
            assert {a: worst[a] for a in figures} == figures, (nodes, poll, worst)
            receive, tokens, transitions = wake
            assert worst["sqs:ReceiveMessage"] == receive, (nodes, poll)
            assert worst["states:SendTaskSuccess"] == worst["sqs:DeleteMessage"] == tokens
            assert worst[rates.TRANSITIONS] == transitions, (nodes, poll)
    worst = rates.worst_minute(1024, MIN_POLL[1024])
    # An attempt's end: 1,024 invocations end, EventBridge starts a wake for each (and the
    # job's successor is started), against StartExecution's 150 a second and bucket of 800.
    assert worst[rates.CHILD_START] == 62 and worst["states:StartExecution"] == 1025
    assert worst["dynamodb:UpdateItem"] == 1 and worst["sns:Publish"] == 2
    # A batch's end reads its invocations in two pages of 25 (supervisor_limits.INVOCATIONS_PAGE).
    assert worst["ssm:CancelCommand"] == 21 and worst["ssm:ListCommandInvocations"] == 42


def test_the_steady_minute_falls_with_poll_seconds() -> None:
    """A running command's polls: two calls a batch per PollSeconds."""
    steady = {
        (n, p): round(rates.steady_minute(n, p)["ssm:ListCommands"], 2)
        for n in (64, 256, 1024)
        for p in (MIN_POLL[n], DEFAULT_POLL_SECONDS)
    }
    assert steady == {
        (64, 201): 0.6, (64, 300): 0.4, (256, 201): 1.79, (256, 300): 1.2,
        (1024, 201): 6.27, (1024, 300): 4.2,
    }, steady  # fmt: skip
    # The job's progress: one GetMetricData per ProgressReadSeconds (600 s) or per poll,
    # whichever is longer, whatever the node count (the first batch's reader,
    # stacks/supervisor_progress.py), against CloudWatch's 50 a second.
    for poll in (MIN_POLL[1024], DEFAULT_POLL_SECONDS, 900):
        read = rates.steady_minute(1024, poll)["cloudwatch:GetMetricData"]
        assert read == 60 / max(poll, PROGRESS_READ_SECONDS), (poll, read)
    assert PROGRESS_READ_SECONDS == 600
    assert rates.QUOTAS["cloudwatch:GetMetricData"].per_minute == 3000
    waiting = rates.steady_minute(1024, MIN_POLL[1024], waiting=True)
    assert round(waiting["ec2:DescribeNetworkInterfaces"], 2) == 12.24
    assert round(waiting["ec2:DescribeTags"], 2) == 1.49


def test_at_1024_nodes_and_the_shortest_poll_the_supervisor_keeps_to_every_documented_rate() -> (
    None
):
    """The supervisor, and the supervisor with `train` following it (a job's load: one job at a
    time), stay within every documented rate. Where no rate could be confirmed (Systems Manager,
    Auto Scaling) the check holds them to ASSUMED_FLOOR_PER_SECOND; what goes over that is a
    flag: the SetInstanceHealth of a preflight in which every node exits 3, and a retry whose
    next poll for nodes falls in the minute of RunTraining's last poll."""
    found = rates.excesses(1024, MIN_POLL[1024])
    documented = [str(e) for e in found if e.confirmed and e.caller.startswith("supervisor")]
    assert documented == [], documented
    flagged = sorted(
        (e.caller, e.action, round(e.calls_per_minute)) for e in found if not e.confirmed
    )
    assert flagged == [
        ("supervisor", "autoscaling:DescribeAutoScalingInstances", 62),
        ("supervisor", "autoscaling:SetInstanceHealth", 1024),
        ("supervisor", "sqs:DeleteMessage", 441),
        ("supervisor", "sqs:ReceiveMessage", 2093),
        ("supervisor + train", "autoscaling:DescribeAutoScalingInstances", 62),
        ("supervisor + train", "autoscaling:SetInstanceHealth", 1024),
        ("supervisor + train", "sqs:DeleteMessage", 441),
        ("supervisor + train", "sqs:ReceiveMessage", 2093),
    ], flagged
    for action, calls in rates.worst_minute(1024, MIN_POLL[1024]).items():
        if rates.QUOTAS[action].confirmed:
            assert calls <= rates.QUOTAS[action].per_minute, action


def test_the_cli_calls_that_go_over_a_documented_rate_at_1024_nodes() -> None:
    """One `jobs` that reads MAX_LISTED executions describes each. `logs --follow` without
    --node reads the nodes' job-log streams in turn, half of CloudWatch Logs' rate a poll (it
    read all 1,024 every 10 s, ten times the rate)."""
    over = sorted(
        (e.caller, e.action, round(e.calls_per_minute), round(e.factor, 1))
        for e in rates.excesses(1024, MIN_POLL[1024])
        if e.confirmed
    )
    assert over == [
        ("cluster.py jobs", "states:DescribeExecution", 1000, 1.7),
    ], over
    assert rates.cli_logs_follow(1024, one_node=True)["logs:GetLogEvents"] == 6
    assert rates.cli_logs_follow(1024)["logs:GetLogEvents"] == 300 == 60 * 5


def test_every_action_has_a_named_source() -> None:
    for action, quota in rates.QUOTAS.items():
        assert quota.source and quota.url.startswith("https://docs.aws.amazon.com/"), action
        assert quota.confirmed or "confirm" in quota.note, action
    table = rates.table()
    assert "| autoscaling:SetInstanceHealth | 64 | 256 | 1,024 | not confirmed |" in table


# ------------------------------------------------- the model against the definition
def test_the_model_counts_what_the_definition_calls(found: dict[str, dict[str, Any]]) -> None:
    """Each loop's states and SDK calls, as the synthesized definition has them at 1,024
    nodes: a poll of a running command, a round of the node-wait loop, a further page of IDs, a
    ReadNodes child, an invocation's classification; and the maps' concurrency."""
    for doc in ("Preflight", "RunTraining"):
        # The way round when the wait ran its full PollSeconds: the callback's States.Timeout
        # catcher goes to the poll (stacks/supervisor_wake.py).
        poll = loop(found, f"{doc}Wait")
        assert poll[:3] == [f"{doc}Wait", f"{doc}WaitForWake", f"{doc}Woken"], poll
        (timeout,) = [c["Next"] for c in found[f"{doc}WaitForWake"]["Catch"]
                      if c["ErrorEquals"] == ["States.Timeout"]]  # fmt: skip
        assert timeout == poll[3] == f"{doc}Poll"
        assert found[f"{doc}WaitForWake"]["Resource"].endswith(":sqs:sendMessage.waitForTaskToken")
        poll.remove(f"{doc}Woken")
        assert len(poll) == rates.POLL_STATES, poll
        assert sdk_calls(found, poll) == [
            "autoscaling:describeAutoScalingInstances", "ssm:listCommands",
        ]  # fmt: skip
        assert longest_path(found, f"{doc}Classify") == rates.CLASSIFY_STATES[doc]
        # Every batch's child starts at once: the maps set no MaxConcurrency.
        assert "MaxConcurrency" not in found[f"{doc}Batches"], found[f"{doc}Batches"]
        ends = [f"{doc}{s}" for s in ("CancelRest", "Results", "Send")]
        assert sdk_calls(found, ends) == [
            "ssm:cancelCommand", "ssm:listCommandInvocations", "ssm:sendCommand",
        ]  # fmt: skip
        # A batch's invocations, a page at a time: each page read, classified and joined to
        # the classes so far, until no NextToken is left.
        page = [f"{doc}{s}" for s in ("ResultsPage", "EachInvocation", "AddResultsPage",
                                      "JoinResultsPage", "MoreResults")]  # fmt: skip
        assert [found[s]["Next"] for s in page[:-1]] == page[1:], page
        assert found[page[-1]]["Choices"][0]["Next"] == page[0]
        assert len(page) == rates.RESULTS_PAGE_STATES
        assert sdk_calls(found, page) == ["ssm:listCommandInvocations"]
        size = found[f"{doc}Results"]["Parameters"]["MaxResults"]
        assert size == found[f"{doc}ResultsPage"]["Parameters"]["MaxResults"]
        assert math.ceil(SEND_BATCH / size) == invocation_pages() == 2
    wait = loop(found, "WaitForNodes")
    assert len(wait) == rates.NODE_WAIT_STATES, wait
    assert sdk_calls(found, wait) == ["ec2:describeTags"]
    page = ["ReadGroupPage", "AddGroupPage", "JoinGroupPage", "MoreOfGroup"]
    assert len(page) == rates.TAG_PAGE_STATES and sdk_calls(found, page) == ["ec2:describeTags"]
    child = list(found["ReadNodes"]["ItemProcessor"]["States"])
    assert longest_path(found, "ReadBatchNodes") == rates.READ_CHILD_STATES, child
    assert sdk_calls(found, child) == [
        "autoscaling:describeAutoScalingInstances", "ec2:describeNetworkInterfaces",
    ]  # fmt: skip
    assert found["ReadNodes"]["MaxConcurrency"] == rates.READ_CONCURRENCY
    assert rates.READ_CONCURRENCY == supervisor_group.READ_CONCURRENCY
    assert sdk_calls(found, ["PreflightMarkUnhealthy"]) == ["autoscaling:setInstanceHealth"]


def test_every_sdk_call_of_the_definition_has_a_quota(found: dict[str, dict[str, Any]]) -> None:
    """A new SDK call in the definition must come with its quota (and a place in the model)."""
    called = {
        tuple(s["Resource"].removeprefix(SDK).split(":"))
        for s in found.values()
        if s["Type"] == "Task" and s["Resource"].startswith(SDK)
    }
    iam = {"sfn": "states"}
    actions = {f"{iam.get(svc, svc)}:{act[0].upper()}{act[1:]}" for svc, act in called}
    assert actions <= set(rates.QUOTAS), actions - set(rates.QUOTAS)


def test_the_cli_figures_are_the_clis() -> None:
    assert Patience().poll_interval == rates.CLI_INTERVAL
    assert rates.MAX_LISTED == MAX_LISTED


def test_the_model_counts_what_the_wake_calls() -> None:
    """The wake's states and calls as the synthesized wake definition has them: a wake that
    finds the queue empty, a round that received messages, a message (stacks/supervisor_wake.py);
    and every call it makes has a quota."""
    template = synth(node_count="1024").templates["operations"]
    wake = machine_definition(template, placeholder_refs(template), construct="JobSupervisorWake")
    found = wake["States"]
    empty = ["FirstRound", "Receive", "AnyMessages", "Settled", "SettleReceive", "AnyMessages",
             "Woken"]  # fmt: skip
    assert [found[a].get("Next") or found[a].get("Default") for a in empty[:5]] == empty[1:6]
    settled = [c["Next"] for c in found["AnyMessages"]["Choices"]
               if c.get("Variable") == "$.Settled"]  # fmt: skip
    assert settled == ["Woken"] and found["Woken"]["Type"] == "Succeed"
    # The second look is a long poll: SQS answers as soon as a message comes, or after 20 s.
    assert found["Receive"]["Parameters"]["WaitTimeSeconds"] == 1
    assert found["SettleReceive"]["Parameters"]["WaitTimeSeconds"] == 20
    assert len(empty) == rates.WAKE_EMPTY_STATES
    assert sum(s.endswith("Receive") for s in empty) == rates.WAKE_EMPTY_RECEIVES
    each = [c["Next"] for c in found["AnyMessages"]["Choices"]
            if c.get("Variable") == "$.Received.Messages[0]"]  # fmt: skip
    assert each == ["WakeEach"]
    round_ = ["WakeEach", "CountRound", "MoreRounds"]
    assert [found[a]["Next"] for a in round_[:2]] == round_[1:]
    assert found["MoreRounds"]["Choices"][0]["Next"] == "Receive"
    assert len(round_) + 2 == rates.WAKE_ROUND_STATES  # and Receive, AnyMessages again
    per_message = found["WakeEach"]["ItemProcessor"]["States"]
    assert sorted(per_message) == ["DeleteMessage", "SendTaskSuccess"]
    assert len(per_message) == rates.WAKE_TOKEN_STATES
    size = found["Receive"]["Parameters"]["MaxNumberOfMessages"]
    assert size == rates.RECEIVE_MAX == supervisor_wake.RECEIVE_MAX
    calls = {found["Receive"]["Resource"], *(s["Resource"] for s in per_message.values())}
    assert calls == {f"{SDK}sqs:receiveMessage", f"{SDK}sqs:deleteMessage",
                     f"{SDK}sfn:sendTaskSuccess"}  # fmt: skip
    for action in ("sqs:ReceiveMessage", "sqs:DeleteMessage", "states:SendTaskSuccess",
                   "events:Invocations", "states:StartExecution"):  # fmt: skip
        assert action in rates.QUOTAS, action
    # One wake per event, the parked children's messages once.
    assert rates.wake(1024, 21) == {
        "events:Invocations": 1024, "states:StartExecution": 1024,
        "sqs:ReceiveMessage": 2 * 1024 + 3, "states:SendTaskSuccess": 21,
        "sqs:DeleteMessage": 21, rates.TRANSITIONS: 7 * 1024 + 5 * 3 + 2 * 21,
    }  # fmt: skip
    # Stale messages (waits that ran out) are received, refused and deleted as parked ones are:
    # at the default poll, 13 a child within the queue's retention.
    assert rates.WAKE_RETENTION_SECONDS == supervisor_wake.RETENTION_SECONDS
    assert rates.stale_messages(1024, 300) == 21 * 13
    assert rates.wake(1024, 21, 21 * 13)["sqs:ReceiveMessage"] == 2 * 1024 + 30
    assert rates.wake(1024, 21, 21 * 13)["states:SendTaskSuccess"] == 21 * 14
    # The wake drains them all at the default poll (WAKE_ROUNDS, with one empty round).
    assert math.ceil((rates.stale_messages(1024, 300) + 21) / 10) + 1 == supervisor_wake.WAKE_ROUNDS
