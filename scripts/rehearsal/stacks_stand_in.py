"""CloudFormation's DescribeStacks answered from synthesized templates: what `deploy` reads.

Each stack is the template `npx cdk synth` wrote for it, as deployed: its outputs are the
template's, an output whose value is literal text in the template (the `Settings` record, the
cluster's name, the instance type) answered with that text; a bucket's `Ref` with the name
CloudFormation gives a bucket without a BucketName (the stack's name, the logical ID and a
suffix, lowercase), through another stack's export (`Fn::ImportValue`) too; any other intrinsic
function (an ARN) with a placeholder naming the output, since no account resolved it. A stack
not given does not exist, with CloudFormation's error for it. Every answer is checked against
botocore's output shape for DescribeStacks (aws_stand_in.validate_answer).
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

from scripts.rehearsal.aws_stand_in import validate_answer
from scripts.rehearsal.sessions import stand_in_session

REGION = "us-east-1"


class DeployedStacks:
    """Stacks by name, each a synthesized template; `session()` answers DescribeStacks."""

    def __init__(self, templates: dict[str, dict[str, Any]], status: str = "UPDATE_COMPLETE"):
        self.templates = templates
        self.status = status
        self.calls: list[str] = []

    def session(self, region: str = REGION) -> Any:
        session = stand_in_session("stand-in", region)
        session.events.register("before-parameter-build.*.*", self._keep_params)
        session.events.register("before-call.*.*", self._answer)
        return session

    @staticmethod
    def _keep_params(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        context["stand_in_params"] = dict(params)

    def _answer(self, model: Any, context: dict[str, Any], **_: Any) -> tuple[Any, dict[str, Any]]:
        from botocore.awsrequest import AWSResponse

        service = model.service_model.service_name
        name = f"{service}.{model.name}"
        self.calls.append(name)
        metadata = {"RequestId": "stand-in", "HTTPStatusCode": 200, "HTTPHeaders": {}}
        if name != "cloudformation.DescribeStacks":
            raise AssertionError(f"the stacks stand-in does not serve {name}")
        stack_name = context.get("stand_in_params", {}).get("StackName", "")
        template = self.templates.get(stack_name)
        if template is None:
            metadata["HTTPStatusCode"] = 400
            error = {
                "Error": {
                    "Code": "ValidationError",
                    "Message": f"Stack with id {stack_name} does not exist",
                },
                "ResponseMetadata": metadata,
            }
            return AWSResponse("https://stand-in.local", 400, {}, None), error
        body: dict[str, Any] = {"Stacks": [self._stack(stack_name, template)]}
        validate_answer(model, body)
        body["ResponseMetadata"] = metadata
        return AWSResponse("https://stand-in.local", 200, {}, None), body

    def bucket_name(self, stack_name: str, logical_id: str) -> str:
        """The name CloudFormation generates for a bucket of a stack (same on every call)."""
        suffix = hashlib.sha256(f"{stack_name}/{logical_id}".encode()).hexdigest()[:12]
        return f"{stack_name}-{logical_id}-{suffix}".lower()

    def _resolve(self, stack_name: str, value: Any) -> str | None:
        if isinstance(value, str):
            return value
        resources = self.templates[stack_name]["Resources"]
        if isinstance(value, dict) and set(value) == {"Ref"}:
            resource = resources.get(value["Ref"], {})
            if resource.get("Type") == "AWS::S3::Bucket":
                return self.bucket_name(stack_name, value["Ref"])
        if isinstance(value, dict) and set(value) == {"Fn::ImportValue"}:
            for name, template in self.templates.items():
                for output in template.get("Outputs", {}).values():
                    if output.get("Export", {}).get("Name") == value["Fn::ImportValue"]:
                        return self._resolve(name, output["Value"])
        return None

    def _stack(self, stack_name: str, template: dict[str, Any]) -> dict[str, Any]:
        outputs = []
        for key, output in template.get("Outputs", {}).items():
            text = self._resolve(stack_name, output["Value"])
            outputs.append({"OutputKey": key, "OutputValue": text or f"<{key}: an account's>"})
        return {
            "StackName": stack_name,
            "StackStatus": self.status,
            "CreationTime": datetime.now(UTC),
            "Outputs": outputs,
        }
