"""The job supervisor's building block for running an SSM document on every node.

`run_on_every_node` makes the states that send a document (Preflight or RunTraining) to every
node, one SendCommand per batch of at most SEND_BATCH nodes inside a Distributed Map whose
iterations are standard child executions (each batch's polls and classification fill the
child's history, not the job's: stacks/supervisor_limits.py), follow each command to its end
(cancelling the rest of a batch once a node has ended, or its instance no longer runs, and
FailureGraceSeconds have passed), and classify every invocation inside a second Map: ok, leg
(RunTraining ended at its time limit), final (RunTraining ended with a status of the job's
NoRetryStatuses, 2 by default: the job's own input is wrong; the job ends without a retry),
replaced (Preflight found a fault no retry fixes: the
node is marked unhealthy), roll (Preflight found the nodes run different software) or bad, each
but ok with the cause in words (the first MAX_CAUSES of a batch, and how many more). The last
state, <Document>Verdict, sums the classes up in $.Verdict; $.Outcome lists the command IDs and
the causes. The workflow (stacks/supervisor_workflow.py) chooses on $.Verdict.

A node whose instance dies mid-command never answers again: the invocation on it does not end.
The SSM documentation promises no terminal status for it. "Undeliverable" is for a command that
cannot be delivered, and "Delivery Timed Out" for one that was not delivered in time; "Execution
Timed Out" is what the agent reports when the command outlives its executionTimeout, and the agent
is the one that enforces it (CommandInvocation.StatusDetails, SSM API reference). "In Progress" is
"sent to the managed node but hasn't reached a terminal state". The EC2 user guide of 2016
(Monitoring Commands) said it outright: "If the SSM agent is not available on the instance, the
command status will show In Progress until the SSM agent is available again". An agent that died
with its instance is never available again. So the poll does not wait for SSM. It also asks Auto
Scaling which of the batch's nodes are still in service (DescribeAutoScalingInstances with the
batch's IDs: an ID that no longer exists "is ignored with no error", Auto Scaling API reference;
a node the group terminates, or finds unhealthy and replaces, leaves InService at once). If one
is not, that is an ended node: the grace starts. After the cancel, this batch's or another's
(the command is Cancelling for as long as a gone node's invocation does not acknowledge it), the
command counts as ended once at least as many invocations have ended as nodes still run.

A child execution that fails fails the map run, and Step Functions aborts the other children:
the map's Catch cancels the attempt's commands and the workflow retries (Run.failed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from aws_cdk import aws_iam as iam
from aws_cdk import aws_stepfunctions as sfn

from stacks.config import CLUSTER_TAG_KEY
from stacks.supervisor_limits import POLL_LIMIT_MARGIN, SEND_BATCH
from stacks.supervisor_outcomes import map_failed
from stacks.supervisor_progress import hang_result, initial_progress, read_due, watch_progress
from stacks.supervisor_results import read_and_classify
from stacks.supervisor_tasks import SupervisorTasks
from stacks.supervisor_wake import park, park_grace

#: preflight.sh exits with this status on a fault no retry on the node fixes (a Neuron hardware
#: error, fewer EFA devices than the instance type has, a failed bootstrap): replace the node.
REPLACE_NODE_STATUS = 3
#: preflight.sh exits with this status when the nodes run different software (the node-software
#: check): no retry can help, a roll of the fleet does, so the job ends at once.
ROLL_FLEET_STATUS = 4
#: launch.sh exits with this status when it ended a leg at its time limit (contract C4).
LEG_TIME_LIMIT_STATUS = 75
#: launch.sh exits with this status when the trainer's own input is wrong (argparse's status:
#: the reference trainer's for a bad flag or missing data; torchrun's report names it, and
#: launch.sh's last line on the agent's stderr says what was wrong). In the job's
#: NoRetryStatuses by default: the job ends at once, as no retry can fix its input.
INPUT_ERROR_STATUS = 2
#: The mark of launch.sh's one line on the agent's stderr for an input error (the last line of
#: the invocation's Output: read_trainer_status in scripts/node/launch.sh).
INPUT_ERROR_MARK = "input error (status 2)"
#: Command statuses after which nothing more happens: botocore's ssm CommandStatus enum (Pending,
#: InProgress, Success, Cancelled, Failed, TimedOut, Cancelling) less the three that go on.
#: "Delivery Timed Out" is a StatusDetails text, never a Status.
COMMAND_ENDED = ("Success", "Failed", "Cancelled", "TimedOut")
#: What the classification of an invocation says about its node ($.Outcome.Causes): States.Format
#: templates of the instance ID and (CAUSE_FAILED) the exit status or (CAUSE_ENDED) the
#: invocation's StatusDetails, once `document` is filled in.
CAUSE_FAILED = "{{}}: {document} failed with status {{}}"
CAUSE_GONE = "{{}}: node gone (its instance no longer runs); {document} never ended"
CAUSE_ENDED = "{{}}: {document} ended {{}}"
#: The error Step Functions names a throttled SSM call with (an AWS SDK integration's error is
#: the service name and the error code with "Exception": Step Functions developer guide).
THROTTLED = "Ssm.ThrottlingException"
#: The causes a batch reports in words; the rest it counts ("and N more nodes of this batch").
MAX_CAUSES = 5
#: The attempt's commands read at once when a batch cancels the others (each about 18 KB at
#: 1,024 nodes: it carries the host list).
OTHERS_PAGE = 5


#: What SendCommand answers for an instance that is no longer valid, a terminated one included
#: (botocore's ssm model, InvalidInstanceId), as Step Functions names it (ServiceName.ErrorName
#: in PascalCase with the Exception suffix: developer guide, "supported-services-awssdk").
INVALID_INSTANCE = "Ssm.InvalidInstanceIdException"


@dataclass(frozen=True)
class Run:
    """The first and the last state of one document's run on every node, and the last state
    after its Distributed Map failed (`failed`: $.Outcome says why)."""

    start: sfn.DistributedMap
    end: sfn.Pass
    failed: sfn.Pass


def from_job(field: str) -> str:
    """A document parameter (a list of one string) from the job's settings, $.Job.<field>."""
    return sfn.JsonPath.array(sfn.JsonPath.string_at(f"$.Job.{field}"))


def run_on_every_node(
    t: SupervisorTasks, document: str, parameters: dict[str, Any], *, comment: str
) -> Run:
    """Sends `document` to every node (a SendCommand per batch of at most 50), follows each
    command to its end, and classifies every invocation: $.Verdict says whether any was
    bad, any ended its leg (RunTraining), any node was marked for replacement or any node
    found the fleet mixed (Preflight); $.Outcome lists the command IDs. The document's
    parameters are Hosts, the comma-separated host list, and `parameters`; `comment` is a
    States.Format template of the job ID and the attempt."""
    hosts = sfn.JsonPath.array(sfn.JsonPath.string_at("$.Hosts"))
    send = _send(t, document, {"Hosts": hosts, **parameters}, comment)
    start, done = read_and_classify(t, document, _classify(t, document))
    _follow(t, document, send, start)
    causes = _first_causes(t, document)
    if document == "RunTraining":
        # The batch whose progress reader ended the attempt (stacks/supervisor_progress.py).
        done.when(sfn.Condition.is_present("$.Hang"), hang_result(t, document).next(causes))
    done.otherwise(
        sfn.Pass(
            t.scope,
            f"{document}BatchResult",
            parameters={
                "CommandId": sfn.JsonPath.string_at("$.Command.CommandId"),
                "Classes": sfn.JsonPath.list_at("$.Sorted.Classes[*].Class"),
                # Ok and leg carry no cause; a wildcard leaves out what is absent.
                "Causes": sfn.JsonPath.list_at("$.Sorted.Classes[*].Cause"),
            },
        ).next(causes)
    )
    batches = sfn.DistributedMap(
        t.scope,
        f"{document}Batches",
        comment=f"{document} on every node: one SendCommand per batch of {SEND_BATCH}, each "
        "followed in a child execution of its own.",
        map_execution_type=sfn.StateMachineType.STANDARD,
        items_path="$.Nodes.Batches",
        item_selector={
            "InstanceIds": sfn.JsonPath.list_at("$$.Map.Item.Value"),
            "Hosts": sfn.JsonPath.string_at("$.Nodes.Hosts"),
            "Job": sfn.JsonPath.object_at("$.Job"),
            "Attempt": sfn.JsonPath.number_at("$.Counters.Attempts"),
            # The seconds the batch's command has been polled, counted in polls (_follow), and
            # the polls a wake started (stacks/supervisor_wake.py).
            "Alive": {"Waited": 0, "Woken": 0},
            # When the nodes were ready: a command sent since then is this attempt's (_send).
            "Since": sfn.JsonPath.string_at("$.Nodes.Since"),
            # RunTraining: which batch (the first reads the job's progress) and what it saw.
            **(
                {
                    "Batch": sfn.JsonPath.number_at("$$.Map.Item.Index"),
                    "Progress": initial_progress(),
                }
                if document == "RunTraining"
                else {}
            ),
        },
        result_selector={
            "CommandIds": sfn.JsonPath.list_at("$[*].CommandId"),
            "Classes": sfn.JsonPath.list_at("$[*].Classes[*]"),
            # A list per batch: "$[*].Causes[*]" is not found where no batch has a cause
            # (moto's JSONPath), and ASL has no intrinsic that flattens.
            "Causes": sfn.JsonPath.list_at("$[*].Causes"),
        },
        result_path="$.Outcome",
    )
    batches.item_processor(send)
    verdict = sfn.Pass(
        t.scope,
        f"{document}Verdict",
        parameters={
            "Bad.$": "States.ArrayContains($.Outcome.Classes, 'bad')",
            "Leg.$": "States.ArrayContains($.Outcome.Classes, 'leg')",
            "Final.$": "States.ArrayContains($.Outcome.Classes, 'final')",
            "Replaced.$": "States.ArrayContains($.Outcome.Classes, 'replaced')",
            "Roll.$": "States.ArrayContains($.Outcome.Classes, 'roll')",
        },
        result_path="$.Verdict",
    )
    batches.next(verdict)
    # A failed child fails the map run and Step Functions aborts the other children, whose
    # commands run on (up to the leg's time limit): cancel every command of the attempt.
    cancel, cancel_end = _cancel_other_batches(t, document, prefix=f"{document}MapFailed")
    failed = map_failed(t, f"{document}MapFailed", f"{document}Batches", cancelled=True)
    batches.add_catch(cancel, errors=["States.ALL"], result_path="$.MapFailure")
    cancel_end.next(failed)
    return Run(start=batches, end=verdict, failed=failed)


def _first_causes(t: SupervisorTasks, document: str) -> sfn.Choice:
    """<Document>ManyCauses: a batch with more than MAX_CAUSES causes keeps the first
    MAX_CAUSES and how many more there were (<Document>FirstCauses). Every node of 1,024 gone
    would otherwise put some 88 KB of causes in the attempt's outcome, and as much again in
    the message that quotes them, in one state of at most 256 KiB (tests/test_supervisor.py
    measures it)."""
    many = sfn.Choice(t.scope, f"{document}ManyCauses")
    first = ", ".join(f"States.ArrayGetItem($.Causes, {i})" for i in range(MAX_CAUSES))
    more = (
        f"States.Format('and {{}} more nodes of this batch', "
        f"States.MathAdd(States.ArrayLength($.Causes), -{MAX_CAUSES}))"
    )
    keep = sfn.Pass(
        t.scope,
        f"{document}FirstCauses",
        parameters={
            "CommandId": sfn.JsonPath.string_at("$.CommandId"),
            "Classes": sfn.JsonPath.list_at("$.Classes"),
            "Causes.$": f"States.Array({first}, {more})",
        },
    )
    many.when(sfn.Condition.is_present(f"$.Causes[{MAX_CAUSES}]"), keep).otherwise(
        sfn.Succeed(t.scope, f"{document}BatchDone")
    )
    return many


def _send(
    t: SupervisorTasks, document: str, parameters: dict[str, Any], comment: str
) -> sfn.TaskStateBase:
    """<Document>Send: one SendCommand to a batch's nodes, output to the training log group."""
    send = t.sdk(
        f"{document}Send",
        "ssm",
        "sendCommand",
        {
            "DocumentName": t.document_name(document),
            "InstanceIds": sfn.JsonPath.list_at("$.InstanceIds"),
            "Parameters": parameters,
            "Comment": sfn.JsonPath.format(comment, t.job_id, sfn.JsonPath.string_at("$.Attempt")),
            "CloudWatchOutputConfig": {
                "CloudWatchLogGroupName": t.training_log_group.log_group_name,
                "CloudWatchOutputEnabled": True,
            },
        },
        [t.document_arn(document)],
        iam_action="ssm:SendCommand",
        result_selector={"CommandId": sfn.JsonPath.string_at("$.Command.CommandId")},
        result_path="$.Command",
        # A node terminated since the group was read stays terminated: the child fails at
        # once, and with it the map run (map_failed).
        final_errors=[INVALID_INSTANCE],
        # Only a throttled send is sent again: SSM refused it before doing anything. Any other
        # error may have come after SSM accepted the command (a 5xx, a timeout), and a second
        # send would start a second command that no one follows (_find_sent looks first).
        retry_on=(THROTTLED,),
    )
    # The instances a command may go to: this cluster's nodes only, by their tag.
    t.role.add_to_principal_policy(
        iam.PolicyStatement(
            actions=["ssm:SendCommand"],
            resources=[t.instances_arn()],
            conditions={
                "StringEquals": {f"ssm:resourceTag/{CLUSTER_TAG_KEY}": t.config.cluster_name}
            },
        )
    )
    return send


def _find_sent(t: SupervisorTasks, document: str, send: sfn.TaskStateBase) -> sfn.Pass:
    """After a failed SendCommand, whether SSM accepted it anyway: this document's commands to
    the batch's first node since the nodes were ready (ListCommands: InstanceId, DocumentName,
    InvokedAfter; one job at a time, and each attempt sends each document once per batch, so
    any is this batch's). Found: $.Command names it and the poll loop follows it (the Pass
    returned). None: the send failed, and so does the batch (<Document>NotSent)."""
    p = document
    find = t.sdk(
        f"{p}FindSent",
        "ssm",
        "listCommands",
        {
            "InstanceId": sfn.JsonPath.string_at("$.InstanceIds[0]"),
            "Filters": [
                {"Key": "DocumentName", "Value": t.document_name(document)},
                {"Key": "InvokedAfter", "Value": sfn.JsonPath.string_at("$.Since")},
            ],
        },
        ["*"],
        iam_action="ssm:ListCommands",
        result_selector={"Ids": sfn.JsonPath.list_at("$.Commands[*].CommandId")},
        result_path="$.Sent",
    )
    # A node terminated since the group was read: SSM refused the whole send, so there is
    # nothing to look for; the child fails with SSM's error, and the map run with it.
    gone = sfn.Fail(t.scope, f"{p}InstanceGone", error=INVALID_INSTANCE,
                    cause_path="$.SendError.Cause")  # fmt: skip
    send.add_catch(gone, errors=[INVALID_INSTANCE], result_path="$.SendError")
    send.add_catch(find, errors=["States.ALL"], result_path="$.SendError")
    was_sent = sfn.Choice(t.scope, f"{p}WasSent")
    found = sfn.Pass(
        t.scope,
        f"{p}SentAnyway",
        parameters={"CommandId": sfn.JsonPath.string_at("$.Sent.Ids[0]")},
        result_path="$.Command",
    )
    not_sent = sfn.Fail(
        t.scope, f"{p}NotSent", error="SendCommandFailed", cause_path="$.SendError.Cause"
    )
    find.next(was_sent)
    was_sent.when(sfn.Condition.is_present("$.Sent.Ids[0]"), found).otherwise(not_sent)
    return found


def _follow(t: SupervisorTasks, document: str, send: sfn.TaskStateBase, results: sfn.State) -> None:
    """The poll loop after `send`: wait, ListCommands, which of the batch's nodes still run, and
    once the command has ended, its invocations (`results`: supervisor_results.py). Once one
    node has ended, or its instance no longer runs, the others may run on for
    FailureGraceSeconds before the rest of the command is cancelled."""
    p = document
    command_id = {"CommandId": sfn.JsonPath.string_at("$.Command.CommandId")}
    poll = t.sdk(
        f"{p}Poll",
        "ssm",
        "listCommands",
        command_id,
        ["*"],
        iam_action="ssm:ListCommands",
        result_selector={
            # The whole command, not fields of it: a path that ends at an array element
            # reads the same in every JSONPath evaluator (moto's returns a list for
            # "$.Commands[0].Status").
            "Command": sfn.JsonPath.object_at("$.Commands[0]"),
        },
        result_path="$.Poll",
    )
    wait = park(t.scope, p, t.wake_queue, poll)
    nodes = t.in_service(f"{p}Nodes", "Ids", ".InstanceId", "$.Seen")
    ids = sfn.JsonPath.list_at("$.Seen.Ids")
    alive = sfn.Pass(
        t.scope,
        f"{p}NodesAlive",
        parameters={
            "Ids": ids,
            "Count": sfn.JsonPath.array_length(ids),
            "Waited.$": "States.MathAdd($.Alive.Waited, $.Job.PollSeconds)",
            "Woken.$": "$.Alive.Woken",
        },
        result_path="$.Alive",
    )
    # The poll's own limit: an agent cut off from SSM never reports, and a cancel never reaches
    # it (the command stays Cancelling), so after the document's timeout and a margin the
    # command counts as ended and its invocations are read as they stand.
    limit = execution_timeout(t.documents[document].content) + POLL_LIMIT_MARGIN
    too_long = t.sdk(f"{p}PollLimit", "ssm", "cancelCommand", command_id, ["*"],
                     iam_action="ssm:CancelCommand")  # fmt: skip
    gone = sfn.Pass(t.scope, f"{p}NodeGone", result=sfn.Result.from_boolean(True),
                    result_path="$.Gone")  # fmt: skip
    grace = sfn.Pass(t.scope, f"{p}GraceStarts", result=sfn.Result.from_object({"Over": False}),
                     result_path="$.Grace")  # fmt: skip
    wait_grace = park_grace(t.scope, p, t.wake_queue, poll)
    cancel = t.sdk(f"{p}CancelRest", "ssm", "cancelCommand", command_id, ["*"],
                   iam_action="ssm:CancelCommand")  # fmt: skip
    cancelled = sfn.Pass(t.scope, f"{p}Cancelled", result=sfn.Result.from_boolean(True),
                         result_path="$.Cancelled")  # fmt: skip
    others, others_end = _cancel_other_batches(t, document)
    node_gone = sfn.Condition.number_less_than_json_path(
        "$.Alive.Count", "$.Poll.Command.TargetCount"
    )
    node_ended = sfn.Condition.number_greater_than("$.Poll.Command.CompletedCount", 0)
    # Cancelled by this child, or by another batch's (_cancel_other_batches): SSM reports the
    # command Cancelling until every invocation has acknowledged the cancel (SSM API reference,
    # Command.Status), and an invocation on a node that is gone never does.
    cancel_asked = sfn.Condition.or_(
        sfn.Condition.is_present("$.Cancelled"),
        sfn.Condition.string_equals("$.Poll.Command.Status", "Cancelling"),
    )
    ended = sfn.Choice(t.scope, f"{p}Ended")
    ended.when(
        sfn.Condition.or_(
            *(sfn.Condition.string_equals("$.Poll.Command.Status", s) for s in COMMAND_ENDED)
        ),
        results,
    ).when(sfn.Condition.number_greater_than_equals("$.Alive.Waited", limit), too_long).when(
        # The invocations on nodes that are gone never end: once the command was cancelled,
        # whoever cancelled it, the rest has once as many invocations ended as nodes still run.
        sfn.Condition.and_(
            cancel_asked,
            node_gone,
            sfn.Condition.number_greater_than_equals_json_path(
                "$.Poll.Command.CompletedCount", "$.Alive.Count"
            ),
        ),
        results,
    ).when(
        # Cancelled, and a node still runs its invocation: wait for it.
        cancel_asked,
        wait,
    ).when(
        # The grace has passed with the command still running: cancel the rest.
        sfn.Condition.and_(
            sfn.Condition.is_present("$.Grace"), sfn.Condition.boolean_equals("$.Grace.Over", True)
        ),
        cancel,
    ).when(
        # In the grace, woken by an event before its end, the command still running.
        sfn.Condition.is_present("$.Grace"),
        wait_grace,
    ).when(node_gone, gone).when(node_ended, grace)
    if document == "RunTraining":
        # Nothing else happened at this poll: the first batch reads the job's progress when a
        # read is due, and ends the attempt as after a node that ended when there is none by
        # the deadline. Either way it goes back to the wait (a callback on the wake queue).
        ended.when(read_due(), watch_progress(t, p, wait, cancel))
    ended.otherwise(wait)
    send.next(wait)
    poll.next(nodes).next(alive).next(ended)
    _find_sent(t, document, send).next(wait)
    gone.next(grace)
    grace.next(wait_grace)
    cancel.next(others)
    too_long.add_catch(results, errors=["States.ALL"], result_path=sfn.JsonPath.DISCARD)
    too_long.next(results)
    # Polled at once after the cancel: the invocations may all have ended already (a node gone,
    # the others failed on their own), and then no event would come to end a wait.
    others_end.next(cancelled).next(poll)


def execution_timeout(content: dict[str, Any]) -> int:
    """The seconds the SSM agent lets a document's step run: its timeoutSeconds, or the default
    of the parameter it names ("{{ ExecutionTimeout }}": the supervisor passes none)."""
    timeout = str(content["mainSteps"][0]["inputs"]["timeoutSeconds"])
    named = re.fullmatch(r"\{\{ *(\w+) *\}\}", timeout)
    if named:
        timeout = str(content["parameters"][named[1]]["default"])
    return int(timeout)


def _cancel_other_batches(
    t: SupervisorTasks, document: str, *, prefix: str = ""
) -> tuple[sfn.State, sfn.Map]:
    """Once a batch cancels the rest of its command, it cancels the attempt's other batches'
    commands too: a data-parallel job cannot go on without a rank, and on the other batches'
    nodes nothing may end it (the ranks wait in a collective for one that is gone), so every
    batch's child would otherwise poll its command until the leg's time limit, up to 48 hours
    (the scale rehearsal, scripts/rehearsal/scale.py, found it at 64 nodes). The attempt's
    commands are this document's that are still executing (one job at a time: SSM API
    reference, ListCommands, CommandFilter ExecutionStage), read five at a time (each carries
    the host list, 16 KB at 1,024 nodes, so a page stays near 90 KB of a task's 256 KiB
    result) and all of them before the first is cancelled: a cancel moves a command out of
    the filter, and paging on would skip commands. Cancelling a command that has just ended
    changes nothing; a refusal is not an error here. Returns the first state and the last;
    their names start with `prefix` (the document's by default)."""
    p = prefix or document
    filters = [
        {"Key": "DocumentName", "Value": t.document_name(document)},
        {"Key": "ExecutionStage", "Value": "Executing"},
    ]

    def page(construct_id: str, more: bool) -> sfn.TaskStateBase:
        parameters: dict[str, Any] = {"Filters": filters, "MaxResults": OTHERS_PAGE}
        if more:
            parameters["NextToken"] = sfn.JsonPath.string_at("$.Others.Next[0]")
        return t.sdk(
            construct_id, "ssm", "listCommands", parameters, ["*"],
            iam_action="ssm:ListCommands",
            result_selector={
                "Ids": sfn.JsonPath.list_at("$.Commands[*].CommandId"),
                "Next": sfn.JsonPath.list_at("$..NextToken"),
            },
            result_path="$.OthersPage" if more else "$.Others",
        )  # fmt: skip

    first, more = page(f"{p}ListOtherBatches", False), page(f"{p}ListMoreBatches", True)
    # The IDs so far and the page's, as a list of the two lists, then flattened (ASL has no
    # intrinsic that joins arrays).
    add = sfn.Pass(t.scope, f"{p}AddBatchPage", result_path="$.Others", parameters={
        "Ids.$": "States.Array($.Others.Ids, $.OthersPage.Ids)",
        "Next": sfn.JsonPath.list_at("$.OthersPage.Next"),
    })  # fmt: skip
    join = sfn.Pass(t.scope, f"{p}JoinBatchPage", result_path="$.Others", parameters={
        "Ids": sfn.JsonPath.list_at("$.Others.Ids[*][*]"),
        "Next": sfn.JsonPath.list_at("$.Others.Next"),
    })  # fmt: skip
    each = sfn.Map(
        t.scope,
        f"{p}CancelOtherBatches",
        items_path="$.Others.Ids",
        item_selector={"CommandId": sfn.JsonPath.string_at("$$.Map.Item.Value")},
        result_path=sfn.JsonPath.DISCARD,
    )
    one = t.sdk(f"{p}CancelBatch", "ssm", "cancelCommand",
                {"CommandId": sfn.JsonPath.string_at("$.CommandId")}, ["*"],
                iam_action="ssm:CancelCommand")  # fmt: skip
    one.add_catch(sfn.Pass(t.scope, f"{p}BatchEnded"), errors=["States.ALL"])
    each.item_processor(one)
    any_more = sfn.Choice(t.scope, f"{p}MoreBatches")
    first.next(any_more)
    any_more.when(sfn.Condition.is_present("$.Others.Next[0]"), more).otherwise(each)
    more.next(add).next(join).next(any_more)
    return first, each


def _final(t: SupervisorTasks, p: str) -> sfn.Choice:
    """<Document>InputError: an invocation that ended with a status of the job's
    NoRetryStatuses is `final`, the job ends without a retry. For the input error (2) with
    launch.sh's line at the end of its Output (the agent keeps a short stderr whole: its
    truncateOutput), the cause quotes that line: the trainer's own error; for another status,
    the cause names it as one the operator chose not to retry."""
    instance, code = "$.Invocation.InstanceId", "$.Plugin.ResponseCode"
    which = sfn.Choice(t.scope, f"{p}InputError")
    # The Output's last line: split at its newlines (a delimiter from a path: an intrinsic's
    # string literal cannot hold one), its last item; in one state (a node's classification
    # stays within EVENTS_PER_NODE history events: stacks/supervisor_limits.py).
    split = "States.StringSplit($.Plugin.Output, $.Newline)"
    said = sfn.Pass(
        t.scope,
        f"{p}InputErrorSaid",
        parameters={
            "Class": "final",
            "Cause.$": "States.Format('{}: RunTraining failed with status 2, an input error "
            "of the job (not retried): {}', $.Invocation.InstanceId, "
            f"States.ArrayGetItem({split}, States.MathAdd(States.ArrayLength({split}), -1)))",
        },
    )
    chosen = sfn.Pass(
        t.scope,
        f"{p}NotRetried",
        parameters={
            "Class": "final",
            "Cause": sfn.JsonPath.format(
                "{}: RunTraining failed with status {}, a status this job does not retry "
                "(NoRetryStatuses: train --no-retry-on)",
                sfn.JsonPath.string_at(instance),
                sfn.JsonPath.string_at(code),
            ),
        },
    )
    which.when(
        sfn.Condition.and_(
            sfn.Condition.number_equals(code, INPUT_ERROR_STATUS),
            sfn.Condition.is_present("$.Plugin.Output"),
            sfn.Condition.string_matches("$.Plugin.Output", f"*{INPUT_ERROR_MARK}*"),
        ),
        said,
    ).otherwise(chosen)
    return which


def _classify(t: SupervisorTasks, document: str) -> sfn.Choice:
    """<Document>Classify, for one invocation ($.Invocation, with $.Running: the IDs of the
    batch's nodes that still ran at the last poll): {"Class": ok, leg (ended at its time limit),
    replaced, roll or bad, "Cause": what happened on the node, in words (not for ok and leg)}.
    An invocation that was never delivered has no plugin and so no ResponseCode: bad."""
    p = document
    classify = sfn.Choice(t.scope, f"{p}Classify")
    by_code = sfn.Choice(t.scope, f"{p}ByCode")
    on_node = sfn.Choice(t.scope, f"{p}NodeRan")
    instance, code = "$.Invocation.InstanceId", "$.Plugin.ResponseCode"

    def verdict(name: str, kind: str, cause: str | None = None) -> sfn.Pass:
        parameters = {"Class": kind}
        if cause is not None:
            parameters["Cause"] = cause
        return sfn.Pass(t.scope, f"{p}{name}", parameters=parameters)

    ok = verdict("Ok", "ok")
    failed = verdict(
        "Bad",
        "bad",
        sfn.JsonPath.format(
            CAUSE_FAILED.format(document=p),
            sfn.JsonPath.string_at(instance),
            sfn.JsonPath.string_at(code),
        ),
    )
    plugin = sfn.Pass(
        t.scope,
        f"{p}Plugin",
        parameters={
            "Invocation": sfn.JsonPath.object_at("$.Invocation"),
            "Plugin": sfn.JsonPath.object_at("$.Invocation.CommandPlugins[0]"),
            **({"NoRetry": sfn.JsonPath.list_at("$.NoRetry")} if document == "RunTraining" else {}),
        },
    )
    if document == "RunTraining":
        # Whether the status is one the job does not retry (a path that ends at an array
        # element reads as a list in moto's JSONPath: the plugin is taken out first), and the
        # delimiter its Output's lines are split at (_final).
        named = sfn.Pass(
            t.scope,
            f"{p}StatusNamed",
            parameters={
                "Invocation": sfn.JsonPath.object_at("$.Invocation"),
                "Plugin": sfn.JsonPath.object_at("$.Plugin"),
                "Final.$": "States.ArrayContains($.NoRetry, $.Plugin.ResponseCode)",
                "Newline": "\n",
            },
        )
        plugin.next(named).next(by_code)
    else:
        plugin.next(by_code)
    # Not ended, cancelled, timed out, never delivered: did its node still run?
    running = sfn.Pass(
        t.scope,
        f"{p}NodeRunning",
        parameters={
            "Invocation": sfn.JsonPath.object_at("$.Invocation"),
            "Ran.$": "States.ArrayContains($.Running, $.Invocation.InstanceId)",
        },
    )
    running.next(on_node)
    on_node.when(
        sfn.Condition.boolean_equals("$.Ran", False),
        verdict(
            "Gone",
            "bad",
            sfn.JsonPath.format(CAUSE_GONE.format(document=p), sfn.JsonPath.string_at(instance)),
        ),
    ).otherwise(
        verdict(
            "Other",
            "bad",
            sfn.JsonPath.format(
                CAUSE_ENDED.format(document=p),
                sfn.JsonPath.string_at(instance),
                sfn.JsonPath.string_at("$.Invocation.StatusDetails"),
            ),
        )
    )
    classify.when(sfn.Condition.string_equals("$.Invocation.Status", "Success"), ok).when(
        sfn.Condition.and_(
            sfn.Condition.string_equals("$.Invocation.Status", "Failed"),
            sfn.Condition.is_present("$.Invocation.CommandPlugins[0]"),
        ),
        plugin,
    ).otherwise(running)
    if document == "RunTraining":
        by_code.when(
            sfn.Condition.number_equals(code, LEG_TIME_LIMIT_STATUS), verdict("Leg", "leg")
        ).when(sfn.Condition.boolean_equals("$.Final", True), _final(t, p))
    if document == "Preflight":
        mark = t.sdk(
            f"{p}MarkUnhealthy",
            "autoscaling",
            "setInstanceHealth",
            {
                "InstanceId": sfn.JsonPath.string_at(instance),
                "HealthStatus": "Unhealthy",
                "ShouldRespectGracePeriod": False,
            },
            [t.group_arn()],
            iam_action="autoscaling:SetInstanceHealth",
        )
        mark.add_catch(failed, errors=["States.ALL"], result_path=sfn.JsonPath.DISCARD)
        mark.next(
            verdict(
                "Replaced",
                "replaced",
                sfn.JsonPath.format(
                    "{}: Preflight found a fault no retry on the node can fix (status {}: a "
                    "Neuron hardware error, a lost EFA device or a failed bootstrap; its output "
                    "names it); marked unhealthy, the group replaces the node",
                    sfn.JsonPath.string_at(instance),
                    sfn.JsonPath.string_at(code),
                ),
            )
        )
        by_code.when(sfn.Condition.number_equals(code, REPLACE_NODE_STATUS), mark).when(
            sfn.Condition.number_equals(code, ROLL_FLEET_STATUS),
            verdict(
                "Roll",
                "roll",
                sfn.JsonPath.format(
                    "{}: Preflight found that the nodes run different software (status {})",
                    sfn.JsonPath.string_at(instance),
                    sfn.JsonPath.string_at(code),
                ),
            ),
        )
    by_code.otherwise(failed)
    return classify
