"""The rehearsal's Step Functions interpreter (moto's, adjusted by scripts/rehearsal/supervisor.py
`jayway_json_paths`) reads paths as Step Functions does and parses each JSONPath of a definition
once, not every time a state runs (the tests below the first two: how it reads a definite path).

jsonpath_ng builds its PLY parser anew for every parse (jsonpath_ng/parser.py: `parse` makes a
JsonPathParser, whose constructor runs yacc), and moto parses a state's paths each time the
state runs: InputPath, OutputPath and Parameters' paths through its json_path module (the
extended grammar), ResultPath through jsonpath_ng's plain `parse`
(moto/stepfunctions/parser/asl/component/common/path/result_path.py). The wake's thousands of
executions at 1,024 nodes (scripts/rehearsal/scale.py) each run a ResultPath in most states;
building their parsers was the largest single cost of the scale rehearsal's CPU.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, cast

import boto3
import pytest

from scripts.rehearsal.supervisor import jayway_json_paths

REGION = "us-east-1"
EXECUTIONS = 5
#: Upper bound only: each execution ends within moments.
WAIT = 120
DEFINITION = {
    "StartAt": "Add",
    "States": {
        "Add": {"Type": "Pass", "Result": {"n": 1}, "ResultPath": "$.added.value", "Next": "Copy"},
        "Copy": {"Type": "Pass", "InputPath": "$.added", "ResultPath": "$.copy", "End": True},
    },
}


def _run(
    monkeypatch: pytest.MonkeyPatch,
    adjusted: bool,
    definition: dict[str, Any] = DEFINITION,
    inputs: list[dict[str, Any]] | None = None,
) -> tuple[list[Any], int]:
    """Executions of `definition` in moto's interpreter, one per input (EXECUTIONS of DEFINITION
    by default): their outputs, and how many jsonpath_ng parsers were built while they ran."""
    from jsonpath_ng.parser import JsonPathParser
    from moto import mock_aws

    built = [0]
    original = JsonPathParser.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        built[0] += 1
        original(self, *args, **kwargs)

    monkeypatch.setattr(JsonPathParser, "__init__", counting)
    outputs = []
    with (
        mock_aws(config={"stepfunctions": {"execute_state_machine": True}}),
        jayway_json_paths() if adjusted else contextlib.nullcontext(),
    ):
        sfn = boto3.client("stepfunctions", region_name=REGION)
        machine = sfn.create_state_machine(
            name="paths", definition=json.dumps(definition),
            roleArn="arn:aws:iam::123456789012:role/paths",
        )["stateMachineArn"]  # fmt: skip
        built[0] = 0
        for n, given in enumerate(inputs or [{"i": n} for n in range(EXECUTIONS)]):
            arn = sfn.start_execution(
                stateMachineArn=machine, name=f"run-{n}", input=json.dumps(given)
            )["executionArn"]
            deadline = time.monotonic() + WAIT
            while (described := sfn.describe_execution(executionArn=arn))["status"] == "RUNNING":
                assert time.monotonic() < deadline, "the execution never ended"
                time.sleep(0.02)
            assert described["status"] == "SUCCEEDED", described
            outputs.append(json.loads(described["output"]))
    return outputs, built[0]


def test_each_path_is_parsed_once_and_reads_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    outputs, built = _run(monkeypatch, adjusted=True)
    assert outputs == [
        {"i": n, "added": {"value": {"n": 1}}, "copy": {"value": {"n": 1}}}
        for n in range(EXECUTIONS)
    ]
    # "$.added.value" and "$.copy" (ResultPath, plain grammar), "$.added" (InputPath): at most
    # once each, whatever the number of executions.
    assert built <= 3, built


def test_moto_alone_builds_a_parser_each_time_a_result_path_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the adjustment is for: two ResultPaths in each of EXECUTIONS executions."""
    outputs, built = _run(monkeypatch, adjusted=False)
    assert len(outputs) == EXECUTIONS
    assert built >= 2 * EXECUTIONS, built


#: A definite path through an index, in a ResultSelector-like Parameters and in a Choice, as the
#: drain reads StopTraining's status (stacks/drain.py, ReadStopTraining and StopEnded).
INDEXED = {
    "StartAt": "Read",
    "States": {
        "Read": {
            "Type": "Pass",
            "Parameters": {"Status.$": "$.Commands[0].Status", "Second.$": "$.Ids[1]"},
            "ResultPath": "$.Stop",
            "Next": "Ended",
        },
        "Ended": {
            "Type": "Choice",
            "Choices": [
                {"Variable": "$.Stop.Status", "StringEquals": "InProgress", "Next": "Runs"}
            ],
            "Default": "Over",
        },
        "Runs": {"Type": "Pass", "Result": "runs", "ResultPath": "$.Verdict", "End": True},
        "Over": {"Type": "Pass", "Result": "over", "ResultPath": "$.Verdict", "End": True},
    },
}


def _indexed_output(monkeypatch: pytest.MonkeyPatch, adjusted: bool) -> dict[str, Any]:
    given = {"Commands": [{"Status": "InProgress"}], "Ids": ["i-1", "i-2"]}
    (output,), _ = _run(monkeypatch, adjusted, INDEXED, [given])
    return cast(dict[str, Any], output)


def test_a_definite_path_through_an_index_gives_the_value_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Jayway JsonPath, which Step Functions evaluates paths with, gives a definite path's one
    value: "$.Commands[0].Status" is "InProgress", which the Choice matches."""
    output = _indexed_output(monkeypatch, adjusted=True)
    assert output["Stop"] == {"Status": "InProgress", "Second": "i-2"}
    assert output["Verdict"] == "runs"


def test_moto_alone_wraps_a_value_reached_through_an_index_in_a_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the adjustment is for: moto gives ["InProgress"], and the Choice takes its Default."""
    output = _indexed_output(monkeypatch, adjusted=False)
    assert output["Stop"]["Status"] == ["InProgress"]
    assert output["Verdict"] == "over"
