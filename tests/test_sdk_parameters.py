"""Every AWS SDK task of the supervisor's state machine names its parameters as Step Functions
takes them: botocore's member names with the first letter upper-cased, at every level (Step
Functions developer guide, "supported-services-awssdk", API naming conventions), checked
against botocore's input shapes (scripts/rehearsal/sdk_parameters.py), in every configuration
of the stack matrix (tests/test_stacks_matrix.py). The rehearsal's interpreter applies the same
rule to each task's resolved Parameters (scripts/rehearsal/supervisor.py): a field Step
Functions refuses ends the task with States.Runtime.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from scripts.rehearsal import sdk_parameters
from stacks.instance_types import CLUSTER_INSTANCE_TYPES, INSTANCE_TYPES
from tests.cdk_support import Synth, alternative, machine_of, odcr, synth


def _instance_type(name: str) -> Callable[[], Synth]:
    spec = INSTANCE_TYPES[name]
    nodes = "2" if spec.supports_multi_node else "1"
    return lambda: synth(instance_type=name, node_count=nodes, region=spec.regions[0])


#: The configurations of the stack matrix, by name.
MATRIX: dict[str, Callable[[], Synth]] = {
    "default": synth,
    "capacity-block-endpoints": alternative,
    "odcr-placement-group": odcr,
    "trn1-1024": lambda: synth(node_count="1024"),
    **{name: _instance_type(name) for name in CLUSTER_INSTANCE_TYPES},
}


def sdk_tasks(states: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every AWS SDK task, those inside Map states and Parallel branches too."""
    for name, state in states.items():
        if state["Type"] == "Task" and state["Resource"].startswith("arn:aws:states:::aws-sdk:"):
            yield name, state
        inner = (state.get("ItemProcessor"), state.get("Iterator"), *state.get("Branches", []))
        for machine in filter(None, inner):
            yield from sdk_tasks(machine["States"])


def definition(synthesized: Synth, construct: str = "JobSupervisor") -> dict[str, Any]:
    """The state machine's definition, references replaced by placeholders."""
    machine = machine_of(synthesized.templates["operations"], construct)
    parts = machine["Properties"]["DefinitionString"]["Fn::Join"][1]
    # A reference stands inside a JSON string (an ARN, a document's name).
    text = "".join(
        p if isinstance(p, str) else "aws" if p == {"Ref": "AWS::Partition"} else "ref"
        for p in parts
    )
    parsed: dict[str, Any] = json.loads(text)
    return parsed


def definition_problems(parsed: dict[str, Any]) -> list[str]:
    found = []
    for name, state in sdk_tasks(parsed["States"]):
        _, _, shape = sdk_parameters.input_shape(state["Resource"])
        parameters = state.get("Parameters", {})
        found += [f"{name}: {p}" for p in sdk_parameters.problems(shape, parameters)]
    return found


@pytest.mark.parametrize(
    "config",
    [pytest.param(n, marks=[] if n == "default" else [pytest.mark.slow]) for n in MATRIX],
)
def test_every_sdk_task_names_its_parameters_as_step_functions_takes_them(config: str) -> None:
    parsed = definition(MATRIX[config]())
    tasks = dict(sdk_tasks(parsed["States"]))
    assert len(tasks) > 20, sorted(tasks)
    # ListCommands' filters among them: botocore's CommandFilter members are `key` and `value`.
    assert any(t["Resource"].endswith("ssm:listCommands") for t in tasks.values())
    assert definition_problems(parsed) == []


def test_the_dispatchers_sdk_tasks_name_their_parameters_as_step_functions_takes_them() -> None:
    """The job queue's dispatcher (stacks/job_queue.py): DynamoDB and Step Functions tasks."""
    parsed = definition(synth(), "JobDispatcher")
    tasks = dict(sdk_tasks(parsed["States"]))
    assert {t["Resource"].rsplit(":", 2)[-2] for t in tasks.values()} == {"dynamodb", "sfn"}
    assert definition_problems(parsed) == []


def test_a_definition_with_botocores_own_camel_case_names_is_refused() -> None:
    """The same walk on the default definition with ListCommands' filters written as boto3
    takes them (`key`, `value`): every such task is named."""
    parsed = definition(synth())
    text = json.dumps(parsed).replace('"Key": "DocumentName"', '"key": "DocumentName"')
    found = definition_problems(json.loads(text))
    assert found and all('The field "key" is not supported by Step Functions' in p for p in found)
    listing = {n for n, t in sdk_tasks(parsed["States"]) if t["Resource"].endswith("listCommands")
               and "Filters" in t.get("Parameters", {})}  # fmt: skip
    assert {p.split(":")[0] for p in found} == listing, found


@pytest.mark.parametrize(
    ("parameters", "problem"),
    [
        ({"Filters": [{"Key": "DocumentName", "Value": "x"}], "MaxResults": 5}, None),
        ({"Filters.$": "$.Filters", "NextToken.$": "$.Next[0]"}, None),
        ({"filters": []}, 'The field "filters" is not supported'),
        ({"Filters": [{"key": "DocumentName", "Value": "x"}]}, 'The field "key" is not'),
        ({"Filters": [{"Key": "DocumentName", "value.$": "$.x"}]}, 'The field "value" is not'),
        ({"MaxResults": "5"}, "Parameters.MaxResults: str where CommandMaxResults is a integer"),
        ({"Filters": {"Key": "x"}}, "Parameters.Filters: dict where CommandFilterList is a list"),
    ],
)
def test_the_check_names_each_field_step_functions_refuses(
    parameters: dict[str, Any], problem: str | None
) -> None:
    _, _, shape = sdk_parameters.input_shape("arn:aws:states:::aws-sdk:ssm:listCommands")
    found = sdk_parameters.problems(shape, parameters)
    if problem is None:
        assert found == []
    else:
        assert len(found) == 1 and problem in found[0], found


def _run_in_moto(parameters: dict[str, Any]) -> dict[str, Any]:
    """One ListCommands task in moto's interpreter as the rehearsal runs it."""
    import boto3
    from moto import mock_aws

    from scripts.rehearsal.supervisor import sdk_parameter_names

    task = {"Type": "Task", "Resource": "arn:aws:states:::aws-sdk:ssm:listCommands",
            "Parameters": parameters, "ResultSelector": {"N.$": "States.ArrayLength($.Commands)"},
            "End": True}  # fmt: skip
    machine = {"StartAt": "List", "States": {"List": task}}
    with (
        mock_aws(config={"stepfunctions": {"execute_state_machine": True}}),
        sdk_parameter_names(),
    ):
        client = boto3.client(
            "stepfunctions", region_name="us-east-1", aws_access_key_id="rehearsal",
            aws_secret_access_key="rehearsal",
        )  # fmt: skip
        arn = client.create_state_machine(
            name="sdk", definition=json.dumps(machine), roleArn="arn:aws:iam::123456789012:role/x"
        )["stateMachineArn"]
        execution = client.start_execution(stateMachineArn=arn, input='{"Stage": "Executing"}')
        deadline = time.monotonic() + 60  # an upper bound: the execution ends in well under 1 s
        while time.monotonic() < deadline:
            described: dict[str, Any] = client.describe_execution(
                executionArn=execution["executionArn"]
            )
            if described["status"] != "RUNNING":
                return described
            time.sleep(0.05)
    raise AssertionError("the execution did not end")


def test_the_rehearsals_interpreter_refuses_a_field_step_functions_refuses() -> None:
    good = _run_in_moto({"Filters": [{"Key": "ExecutionStage", "Value.$": "$.Stage"}]})
    assert good["status"] == "SUCCEEDED", good
    bad = _run_in_moto({"Filters": [{"key": "ExecutionStage", "value.$": "$.Stage"}]})
    assert (bad["status"], bad["error"]) == ("FAILED", "States.Runtime"), bad
    assert 'The field "key" is not supported by Step Functions' in bad["cause"], bad["cause"]
