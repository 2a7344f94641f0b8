"""The node tests' fake `aws` refuses what the AWS CLI refuses (tests/aws_cli.py): the real
CLI's driver (awscli with botocore's service models) parses each call, and a call it would not
send fails with its message and exit status 252 (AWS CLI user guide, "Return codes"). Every
`aws` call bootstrap.sh makes in tests/test_bootstrap.py goes through it; that module's `node`
fixture fails a test whose scripts made a refused call."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.aws_cli import awscli_path, check_command
from tests.node_support import FakeNode
from tests.test_bootstrap import fake_aws, refused_calls

GLOBAL = ["--region", "us-east-1", "--cli-connect-timeout", "10", "--cli-read-timeout", "30"]
INSTANCE = ["--instance-id", "i-0123456789abcdef0"]
HOOK = ["--lifecycle-hook-name", "trainium-launch", "--auto-scaling-group-name", "nodes"]
METRIC = ["--namespace", "TrainiumCluster/c", "--metric-name", "BootstrapFailures"]
QUERY = "AutoScalingInstances[0].[AutoScalingGroupName,LaunchTemplate.Version]"


def run_aws(node: FakeNode, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["aws", *GLOBAL, *args], capture_output=True, text=True, env=node.env(), timeout=120,
        check=False,
    )  # fmt: skip


@pytest.fixture
def node(tmp_path: Path) -> FakeNode:
    node = FakeNode(tmp_path)
    node.tool("aws", fake_aws())
    return node


@pytest.mark.parametrize(
    "args",
    [
        ["autoscaling", "complete-lifecycle-action", *HOOK, *INSTANCE,
         "--lifecycle-action-result", "CONTINUE"],
        ["autoscaling", "record-lifecycle-action-heartbeat", *HOOK, *INSTANCE],
        ["autoscaling", "set-instance-health", *INSTANCE, "--health-status", "Unhealthy",
         "--no-should-respect-grace-period"],
        ["autoscaling", "describe-auto-scaling-instances", "--instance-ids", "i-1",
         "--query", QUERY, "--output", "text"],
        # put-metric-data's own options are the CLI's customization (awscli/customizations/
        # putmetricdata.py), not members of botocore's PutMetricDataInput.
        ["cloudwatch", "put-metric-data", *METRIC, "--dimensions", "ClusterName=c",
         "--unit", "Count", "--value", "1"],
        ["ssm", "get-parameter", "--name", "/aws/service/x", "--query", "Parameter.Value"],
        ["s3", "cp", "/etc/hostname", "s3://bucket/key", "--only-show-errors"],
    ],
)  # fmt: skip
def test_a_call_the_cli_would_send_passes(node: FakeNode, args: list[str]) -> None:
    result = run_aws(node, *args)
    assert result.returncode == 0, result.stderr
    assert refused_calls(node) == []


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["autoscaling", "complete-lifecycle", *HOOK, *INSTANCE],
         "argument operation: Invalid choice: 'complete-lifecycle', maybe you meant: "
         "* complete-lifecycle-action"),
        (["autoscalin", "set-instance-health", *INSTANCE, "--health-status", "Unhealthy"],
         "argument command: Invalid choice: 'autoscalin'"),
        (["autoscaling", "set-instance-health", *INSTANCE, "--health-status", "Unhealthy",
          "--no-respect-grace-period"], "Unknown options: --no-respect-grace-period"),
        (["autoscaling", "complete-lifecycle-action", *HOOK, *INSTANCE],
         "the following arguments are required: --lifecycle-action-result"),
        (["autoscaling", "describe-auto-scaling-instances", "--max-records", "ten"],
         "invalid literal for int() with base 10: 'ten'"),
        (["cloudwatch", "put-metric-data", *METRIC, "--value", "one"], "ConversionSyntax"),
        (["cloudwatch", "put-metric-data", *METRIC, "--dimensions", "ClusterName",
          "--value", "1"], "not enough values to unpack"),
        # Spelled out, never a prefix (AWS CLI v1's argparse would take a unique one).
        (["cloudwatch", "put-metric-data", *METRIC, "--dimension", "ClusterName=c",
          "--value", "1"], "Unknown options: --dimension, ClusterName=c"),
        (["autoscaling", "describe-auto-scaling-instances", "--query", "AutoScalingInstances[0].["],
         "Bad value for --query AutoScalingInstances[0].[: Invalid jmespath expression"),
        (["autoscaling", "describe-auto-scaling-instances", "--output", "txt"],
         "argument --output: Invalid choice: 'txt', maybe you meant: * text"),
        (["s3", "cp", "/etc/hostname", "s3://bucket/key", "--quiet-please"],
         "Unknown options: --quiet-please"),
    ],
)  # fmt: skip
def test_a_call_the_cli_refuses_fails_with_its_reason(
    node: FakeNode, args: list[str], reason: str
) -> None:
    result = run_aws(node, *args)
    assert result.returncode == 252, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("aws: the AWS CLI refuses `aws --region us-east-1 "), line
    assert reason in line, line
    assert refused_calls(node) == [line]
    assert node.calls() == [f"aws {' '.join([*GLOBAL, *args])}"]


def describe(node: FakeNode, query: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["aws", *GLOBAL, "autoscaling", "describe-auto-scaling-instances", "--instance-ids",
         "i-0123456789abcdef0", "--query", query, "--output", "text"],
        capture_output=True, text=True, env=node.env(**env), timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("env", "query", "printed"),
    [
        ({"FAKE_ASG": "nodes", "FAKE_LT_VERSION": "7"}, QUERY, "nodes\t7\n"),
        # An instance in no group: DescribeAutoScalingInstances answers an empty list.
        ({}, QUERY, "None\n"),
        ({"FAKE_ASG": "nodes"}, QUERY, "nodes\tNone\n"),
        # A query that names a member the answer lacks prints None, as on AWS.
        ({"FAKE_ASG": "nodes", "FAKE_LT_VERSION": "7"},
         "AutoScalingInstances[0].[AutoScalingGroup,LaunchTemplate.Version]", "None\t7\n"),
    ],
)  # fmt: skip
def test_the_answer_is_printed_by_the_cli_through_the_query(
    node: FakeNode, env: dict[str, str], query: str, printed: str
) -> None:
    result = describe(node, query, **env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == printed


def test_an_answer_that_is_not_the_operations_output_shape_fails(node: FakeNode) -> None:
    """The fake's answer is checked as botocore's Stubber checks a response."""
    answer = '{"AutoScalingInstances": [{"AutoScalingGroupName": "nodes"}]}'
    node.tool("aws-answer", f"#!/bin/sh\nAWS_CHECK_RESPONSE='{answer}' {check_command()} \"$@\"\n")
    result = subprocess.run(
        ["aws-answer", *GLOBAL, "autoscaling", "describe-auto-scaling-instances"],
        capture_output=True, text=True, env=node.env(), timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "instances` is not a DescribeAutoScalingInstances response" in result.stderr
    assert 'Missing required parameter in AutoScalingInstances[0]: "InstanceId"' in result.stderr


def test_a_call_accepted_once_is_answered_again_from_what_the_cli_printed(node: FakeNode) -> None:
    """The same words, answer and AWS_* variables: the same output, without starting the CLI
    (here it cannot start: its folder is moved away)."""
    first = describe(node, QUERY, FAKE_ASG="nodes", FAKE_LT_VERSION="7")
    assert (first.returncode, first.stdout) == (0, "nodes\t7\n"), first.stderr
    layer = awscli_path()
    away = layer.with_name("awscli-away")
    layer.rename(away)
    try:
        again = describe(node, QUERY, FAKE_ASG="nodes", FAKE_LT_VERSION="7")
        other = describe(node, QUERY, FAKE_ASG="nodes", FAKE_LT_VERSION="8")
    finally:
        away.rename(layer)
    assert (again.returncode, again.stdout, again.stderr) == (0, first.stdout, first.stderr)
    assert other.returncode != 0, "another answer was printed without the CLI"


@pytest.mark.parametrize(
    ("variables", "printed"),
    [({"AWS_DEFAULT_OUTPUT": "text"}, "nodes\t7\n"),
     ({"AWS_DEFAULT_OUTPUT": "json"}, '[\n    "nodes",\n    "7"\n]\n')],
)  # fmt: skip
def test_the_cli_prints_a_kept_answer_again_only_under_the_same_aws_variables(
    node: FakeNode, variables: dict[str, str], printed: str
) -> None:
    """Both orders, each after the other variable's answer was kept: the CLI reads
    AWS_DEFAULT_OUTPUT, so an answer kept under one value is not printed under the other."""
    other = {"AWS_DEFAULT_OUTPUT": "json" if variables["AWS_DEFAULT_OUTPUT"] == "text" else "text"}
    for env in (other, variables):
        result = subprocess.run(
            ["aws", *GLOBAL, "autoscaling", "describe-auto-scaling-instances", "--instance-ids",
             "i-0123456789abcdef0", "--query", QUERY],
            capture_output=True, text=True, timeout=120, check=False,
            env=node.env(FAKE_ASG="nodes", FAKE_LT_VERSION="7", **env),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    assert result.stdout == printed


def test_a_refusal_is_refused_again(node: FakeNode) -> None:
    args = ["autoscaling", "set-instance-health", *INSTANCE, "--health-status", "Unhealthy",
            "--no-respect-grace-period"]  # fmt: skip
    results = [run_aws(node, *args) for _ in range(2)]
    assert [result.returncode for result in results] == [252, 252]
    assert results[0].stderr == results[1].stderr
