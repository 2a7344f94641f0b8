"""The operations stack's outputs: how the CLI finds a deployed cluster and its parts.

The stack is `<cluster>-operations` (stacks/operations.py); its CfnOutputs name the Auto
Scaling group, the SSM documents, the log group, the file system and the job supervisor. They
are read once per CLI run and kept (`Stack.outputs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.clients import aws_errors

#: Stack outputs the CLI reads (the operations stack's CfnOutput keys).
REQUIRED_OUTPUTS = (
    "ClusterName",
    "ClusterTagKey",
    "NodeCount",
    "InstanceType",
    "AutoScalingGroupName",
    "RunTrainingDocumentName",
    "PreflightDocumentName",
    "PrecompileDocumentName",
    "StopTrainingDocumentName",
    "TrainingLogGroupName",
)
#: Outputs only `cluster.py export` needs (contract C6): the file system, and the file-system
#: paths of its data repository associations, comma separated.
EXPORT_OUTPUTS = ("FileSystemId", "ExportPaths")
USABLE_STACK_STATES = {"CREATE_COMPLETE", "UPDATE_COMPLETE", "UPDATE_ROLLBACK_COMPLETE"}


@dataclass(frozen=True)
class StackOutputs:
    stack_name: str
    values: dict[str, str]

    def __getitem__(self, key: str) -> str:
        return self.values[key]

    @property
    def node_count(self) -> int:
        return int(self.values["NodeCount"])

    @property
    def data_bucket(self) -> str:
        """The data bucket (linked to /fsx/data): job code snapshots and training data."""
        if "DataBucketName" not in self.values:
            raise ClusterError(
                f"stack {self.stack_name} lacks the output DataBucketName: redeploy it from "
                "this version of the project"
            )
        return self.values["DataBucketName"]

    def document(self, name: str) -> str:
        return self.values[f"{name}DocumentName"]


class Stack:
    """The cluster's operations stack, read through CloudFormation DescribeStacks."""

    def __init__(self, cloudformation: Any, cluster_name: str) -> None:
        self.cloudformation = cloudformation
        self.cluster_name = cluster_name
        self._outputs: StackOutputs | None = None

    @property
    def name(self) -> str:
        return f"{self.cluster_name}-operations"

    def outputs(self) -> StackOutputs:
        """The stack's outputs (read once); one line saying what to do when the stack is not
        deployed, not usable, or older than this CLI."""
        if self._outputs is not None:
            return self._outputs
        try:
            with aws_errors(f"reading stack {self.name}"):
                stacks = self.cloudformation.describe_stacks(StackName=self.name)
        except ClusterError as error:
            if "does not exist" in str(error):
                raise ClusterError(
                    f"stack {self.name} is not deployed in this account and region: "
                    "deploy the cluster with `npx cdk deploy --all`, or pass --cluster-name / "
                    "--region"
                ) from None
            raise
        stack = stacks["Stacks"][0]
        status = stack.get("StackStatus", "")
        if status not in USABLE_STACK_STATES:
            raise ClusterError(
                f"stack {self.name} is in state {status}: wait for the deployment to finish"
            )
        values = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
        missing = [key for key in REQUIRED_OUTPUTS if key not in values]
        if missing:
            raise ClusterError(
                f"stack {self.name} lacks the outputs {', '.join(missing)}: "
                "redeploy it from this version of the project"
            )
        self._outputs = StackOutputs(self.name, values)
        return self._outputs
