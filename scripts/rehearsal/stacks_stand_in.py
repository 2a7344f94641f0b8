"""CloudFormation's DescribeStacks answered from synthesized templates: what `deploy` reads.

Each stack is the template `npx cdk synth` wrote for it, as deployed: its outputs are the
template's, an output whose value is literal text in the template (the `Settings` record, the
cluster's name, the instance type) answered with that text, and one made of intrinsic functions
(a generated name, an ARN) with a placeholder naming it, since no account resolved it. A stack
not given does not exist, with CloudFormation's error for it. Every answer is checked against
botocore's output shape for DescribeStacks (aws_stand_in.validate_answer).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from scripts.rehearsal.aws_stand_in import validate_answer

REGION = "us-east-1"


class DeployedStacks:
    """Stacks by name, each a synthesized template; `session()` answers DescribeStacks."""

    def __init__(self, templates: dict[str, dict[str, Any]], status: str = "UPDATE_COMPLETE"):
        self.templates = templates
        self.status = status
        self.calls: list[str] = []

    def session(self, region: str = REGION) -> Any:
        import boto3

        session = boto3.Session(
            aws_access_key_id="stand-in", aws_secret_access_key="stand-in", region_name=region
        )
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

    def _stack(self, stack_name: str, template: dict[str, Any]) -> dict[str, Any]:
        outputs = []
        for key, output in template.get("Outputs", {}).items():
            value = output["Value"]
            text = value if isinstance(value, str) else f"<{key}: resolved at deploy>"
            outputs.append({"OutputKey": key, "OutputValue": text})
        return {
            "StackName": stack_name,
            "StackStatus": self.status,
            "CreationTime": datetime.now(UTC),
            "Outputs": outputs,
        }
