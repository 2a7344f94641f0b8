"""A batch's invocations, read page by page and classified page by page
(stacks/supervisor_run.py builds the rest of a batch's child execution).

A batch's child reads its command's invocations with ListCommandInvocations and Details, the
only read that carries each invocation's CommandPlugins[0].ResponseCode (3: replace the node, 4:
the nodes run different software, 75: the leg's time limit), which the classification reads
with the invocation's InstanceId, Status and StatusDetails. Details brings each plugin's
Output too: up to 2,500 characters (the SSM agent's limit; botocore CommandPlugin.Output), about
2.9 KB an invocation once JSON-encoded, and JSONPath cannot drop a field from every element of
a list. A page of all SEND_BATCH invocations kept in the state while they are classified made a
state of 179,224 bytes at 1,024 nodes (the scale rehearsal, scripts/rehearsal/scale.py), more
than half of a state's 256 KiB (Step Functions quotas, Maximum input or output size for a task,
state, or execution). So the child reads INVOCATIONS_PAGE invocations at a time
(stacks/supervisor_limits.py), classifies that page, keeps only its classes and causes (under
a hundred bytes a node), and reads the next page with the NextToken.

Why pages and not the other two ways of keeping the outputs out of the state:
- Details False, then GetCommandInvocation for each invocation that did not succeed: a leg's end
  fails every invocation (status 75), so 1,024 more calls at once, far over the rate SSM is held
  to (stacks/api_rates.py), and an invocation that never ran has no plugin to tell it apart.
- A smaller SEND_BATCH: more child executions and more SendCommands, and every poll of a running
  command, for the whole leg, would call ListCommands and DescribeAutoScalingInstances once per
  smaller batch.
Pages add one ListCommandInvocations call per page at a batch's end only.
"""

from __future__ import annotations

from typing import Any

from aws_cdk import aws_stepfunctions as sfn

from stacks.supervisor_limits import INVOCATIONS_PAGE
from stacks.supervisor_tasks import SupervisorTasks


def read_and_classify(
    t: SupervisorTasks, document: str, classify: sfn.IChainable
) -> tuple[sfn.Pass, sfn.Choice]:
    """The states from a batch's ended command to its classes: <Document>NoResultsYet, then per
    page <Document>Results (or <Document>ResultsPage), <Document>EachInvocation (`classify` for
    each invocation, with $.Running: the IDs of the batch's nodes that still ran at the last
    poll, and $.NoRetry: the job's NoRetryStatuses), <Document>AddResultsPage and
    <Document>JoinResultsPage, which leave every class so far
    in $.Sorted.Classes ({"Class": ..., "Cause": ...} each), and <Document>MoreResults, the
    Choice returned last, whose `otherwise` the caller sets."""
    p = document
    command_id = {"CommandId": sfn.JsonPath.string_at("$.Command.CommandId")}

    def page(construct_id: str, more: bool) -> sfn.TaskStateBase:
        parameters: dict[str, Any] = {**command_id, "Details": True, "MaxResults": INVOCATIONS_PAGE}
        if more:
            parameters["NextToken"] = sfn.JsonPath.string_at("$.Results.Next[0]")
        return t.sdk(
            construct_id, "ssm", "listCommandInvocations", parameters, ["*"],
            iam_action="ssm:ListCommandInvocations",
            result_selector={
                "Invocations": sfn.JsonPath.list_at("$.CommandInvocations"),
                "Next": sfn.JsonPath.list_at("$..NextToken"),
            },
            result_path="$.Results",
        )  # fmt: skip

    start = sfn.Pass(
        t.scope, f"{p}NoResultsYet", result=sfn.Result.from_object({"Classes": []}),
        result_path="$.Sorted",
    )  # fmt: skip
    first, more = page(f"{p}Results", False), page(f"{p}ResultsPage", True)
    each = sfn.Map(
        t.scope,
        f"{p}EachInvocation",
        items_path="$.Results.Invocations",
        # Each invocation with the IDs of the batch's nodes that still ran at the last poll.
        item_selector={
            "Invocation": sfn.JsonPath.object_at("$$.Map.Item.Value"),
            "Running": sfn.JsonPath.list_at("$.Alive.Ids"),
            # The statuses that end the job without a retry (the job's NoRetryStatuses).
            "NoRetry": sfn.JsonPath.list_at("$.Job.NoRetryStatuses"),
        },
        result_path="$.Classes",
    )
    each.item_processor(classify)
    # The classes so far and the page's, as a list of the two lists, then flattened (ASL has
    # no intrinsic that joins arrays); a page holds at least one invocation.
    add = sfn.Pass(t.scope, f"{p}AddResultsPage", result_path="$.Sorted", parameters={
        "Classes.$": "States.Array($.Sorted.Classes, $.Classes)",
    })  # fmt: skip
    join = sfn.Pass(t.scope, f"{p}JoinResultsPage", result_path="$.Sorted", parameters={
        "Classes": sfn.JsonPath.list_at("$.Sorted.Classes[*][*]"),
    })  # fmt: skip
    any_more = sfn.Choice(t.scope, f"{p}MoreResults")
    start.next(first).next(each).next(add).next(join).next(any_more)
    any_more.when(sfn.Condition.is_present("$.Results.Next[0]"), more)
    more.next(each)
    return start, any_more
