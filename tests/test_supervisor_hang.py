"""Hang detection (stacks/supervisor_progress.py), rehearsed through the synthesized state
machine in moto's interpreter: rank 0's progress lines reach the stand-in's training log group
(logs_stand_in.py), the template's metric filters make them JobStep datapoints
(metric_filter.py) and the stand-in serves GetMetricData from them (metrics_stand_in.py; the
request checked against botocore's input shape as Step Functions reads it, sdk_parameters.py;
the answer against its output shape). The trainers stop stepping while their processes live
(workload/stop.py's hold), and the supervisor ends the attempt and retries from the checkpoint.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from scripts.cluster_lib.documents import join_train_args
from scripts.rehearsal.history_pages import whole_history
from scripts.rehearsal.hosts import job_processes
from tests.cdk_support import Synth, synth
from tests.node_support import unique_job_id
from tests.test_rehearsal import (
    HOLD_AT_5,
    checkpoints,
    gone,
    held,
    job_metrics,
    sample_data,
    train_args,
)
from tests.test_supervisor import (
    FAST,
    Supervisor,
    _name,
    machine_definition,
    placeholder_refs,
    states,
    supervised,
)

__all__ = ["sample_data"]  # a fixture of test_rehearsal, shared here

#: The hang settings of the rehearsal (seconds, counted in polls of PollSeconds 1): the
#: progress read every third poll.
HANG = {"HangSeconds": 20, "CompileHangSeconds": 600, "ProgressReadSeconds": 3}


@pytest.fixture(scope="module")
def default() -> Synth:
    return synth()


def reader_states(supervisor: Supervisor) -> list[list[str]]:
    """The states each RunTraining run's first batch entered, in order (its progress reader)."""
    runs = supervisor.child_events("RunTraining")
    return [[name for e in events if (name := _name(e)) and "Entered" in e["type"]]
            for events in runs]  # fmt: skip


@pytest.mark.slow
@pytest.mark.netns
def test_a_job_that_stops_stepping_is_ended_and_retried_from_its_checkpoint(
    tmp_path: Path, sample_data: Path, default: Synth
) -> None:
    """The trainers hold after step 5 (its checkpoint saved) with their processes alive: no
    progress line comes. Within HangSeconds plus one poll (counted in the reader's polls) the
    first batch's reader ends the attempt; the notification and the retry's story say "no
    progress since step 5 at T"; the retry resumes from step 5 and the job finishes."""
    job = unique_job_id("hung")
    args = train_args(sample_data, "--max-steps", "30", "--checkpoint-every", "5",
                      "--eval-every", "30", "--log-every", "5")  # fmt: skip
    with supervised(tmp_path, default, node_settings=HOLD_AT_5) as (cloud, supervisor):
        execution = supervisor.start(
            job, TrainArgs=join_train_args(args), MaxRetries=1, **FAST, **HANG
        )
        held(tmp_path, job, 5, 400, lambda: supervisor.trace(execution))
        assert checkpoints(tmp_path / "jobs" / job) == [5]
        status = supervisor.wait(execution, 900)
        assert status == "SUCCEEDED", supervisor.trace(execution)

        subjects = [n["Subject"].rsplit(" ", 1)[-1] for n in cloud.notifications]
        assert subjects == ["started", "retries", "finished"], cloud.notifications
        message = cloud.notifications[1]["Message"]
        # CloudWatch's values are doubles: the step reads as the answer gave it.
        since = re.compile(r"no progress since step 5(\.0)? at 20\d\d-\d\d-\d\dT\d\d:\d\d:00\.000Z")
        assert since.search(message), message
        # The reader: it saw progress, then none until the deadline, and ended the attempt;
        # it read every ProgressReadSeconds, not at every poll.
        first = reader_states(supervisor)[0]
        assert "RunTrainingProgressed" in first and "RunTrainingProgressStalled" in first
        last_progress = max(i for i, n in enumerate(first) if n.startswith("RunTrainingProgressed"))
        stalled = first.index("RunTrainingProgressStalled")
        polls = first[last_progress:stalled].count("RunTrainingWait")
        assert (
            polls <= (HANG["HangSeconds"] + HANG["ProgressReadSeconds"]) // FAST["PollSeconds"] + 1
        ), polls
        assert "RunTrainingCancelRest" in first[stalled:]
        reads = [i for i, n in enumerate(first) if n == "RunTrainingReadProgress"]
        apart = {first[a:b].count("RunTrainingWait") for a, b in itertools.pairwise(reads)}
        assert min(apart) >= HANG["ProgressReadSeconds"] // FAST["PollSeconds"], apart
        # Every request the reader made was valid for botocore (the stand-in's client checks
        # it) and asked from the newest datapoint it had seen.
        assert cloud.metrics.requests
        # The retry resumed from the checkpoint and finished.
        assert [r["step"] for r in job_metrics(tmp_path, job, "resume")] == [5]
        assert max(r["step"] for r in job_metrics(tmp_path, job, "train")) == 30
        hold = job_metrics(tmp_path, job, "hold")[0]["time"]
        resumed = [r for r in job_metrics(tmp_path, job, "train") if r["step"] > 5]
        measured = resumed[0]["time"] - hold
        print(f"hang at step 5 to training again: {measured:.1f} s with {HANG} and {FAST}")
        # Noticed within HangSeconds plus one poll of the reader: the rest is the retry's
        # start (nodes ready, a new RunTraining, the resume); bounded, not a figure to keep.
        assert measured < 600, measured
        chain = supervisor.chain(execution)
        why = json.loads(supervisor.describe(chain[0])["output"])["Why"]
        assert since.search(str(why)), why
        assert gone(job), job_processes(job)


#: The reader's states after its GetMetricData (stacks/supervisor_progress.py), run alone.
READER = ["ProgressSeen", "ProgressMade", "ProgressPhase", "Progressed", "ProgressedCompiling",
          "ProgressRecompiling", "ProgressQuiet", "ProgressStale", "ProgressNoneStale",
          "NoProgress", "NoProgressLine", "ProgressStalled"]  # fmt: skip


def read_progress(default: Synth, given: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Runs the definition's reader from ProgressSeen on `given` (a GetMetricData answer as
    its ResultSelector leaves it in $.Read) in moto's ASL interpreter, with RunTrainingWait
    (no hang: poll again) and RunTrainingCancelRest (the attempt ends) as Succeed states;
    returns where it went and the state there."""
    from moto import mock_aws

    from scripts.rehearsal.supervisor import step_functions_as_on_aws

    template = default.templates["operations"]
    found = dict(states(machine_definition(template, placeholder_refs(template))))
    chain = {f"RunTraining{n}": found[f"RunTraining{n}"] for n in READER}
    ends = {"RunTrainingWait": {"Type": "Succeed"}, "RunTrainingCancelRest": {"Type": "Succeed"}}
    with (
        mock_aws(config={"stepfunctions": {"execute_state_machine": True}}),
        step_functions_as_on_aws(),
    ):
        import boto3

        client = boto3.client("stepfunctions", region_name="us-east-1")
        arn = client.create_state_machine(
            name="reader",
            definition=json.dumps(
                {"StartAt": "RunTrainingProgressSeen", "States": {**chain, **ends}}
            ),
            roleArn="arn:aws:iam::123456789012:role/reader",
        )["stateMachineArn"]
        execution = client.start_execution(stateMachineArn=arn, input=json.dumps(given))
        deadline = time.monotonic() + 60
        while (
            status := client.describe_execution(executionArn=execution["executionArn"])["status"]
        ) == "RUNNING":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        events = whole_history(client, execution["executionArn"])
        assert status == "SUCCEEDED", events[-3:]
    entered = [e["stateEnteredEventDetails"] for e in events if "stateEnteredEventDetails" in e]
    return entered[-1]["name"], json.loads(entered[-1]["input"])


def _given(read: dict[str, Any], progress: dict[str, Any], waited: int) -> dict[str, Any]:
    return {
        "Read": read,
        "Progress": progress,
        "Alive": {"Waited": waited},
        "Job": {"HangSeconds": 1800, "CompileHangSeconds": 10800, "ProgressReadSeconds": 600},
    }


MINUTE, NEXT = "2026-11-26T06:33:00.000Z", "2026-11-26T06:34:00.000Z"
#: When the nodes were ready, as NodesReady writes $.Nodes.Since (no fraction of a second).
SINCE = "2026-11-26T06:30:00Z"


def test_a_job_that_compiles_past_the_training_limit_is_not_hung(default: Synth) -> None:
    """A datapoint is a minute's Maximum (GetMetricData, Period 60): the phase comes from the
    minute's highest step. A minute whose highest step is a compiling line's gives the compile
    limit, and the job compiling past HangSeconds (but within CompileHangSeconds) is polled
    again, not ended; a minute that holds the compile's end and the first steps gives the
    training limit; past the compile limit the attempt ends, "no progress since step N at T"."""
    start = {"At": SINCE, "Step": -1, "Phase": "compiling",
             "Deadline": 10800, "NextRead": 0, "Stale": -1}  # fmt: skip
    compiling = {"Times": [MINUTE], "Steps": [0.0],
                 "CompilingTimes": [MINUTE], "CompilingSteps": [0.0]}  # fmt: skip
    where, state = read_progress(default, _given(compiling, start, 100))
    assert where == "RunTrainingWait", where
    assert state["Progress"] == {"At": MINUTE, "Step": 0.0, "Phase": "compiling",
                                 "Deadline": 100 + 10800, "NextRead": 100 + 600,
                                 "Stale": -1}  # fmt: skip
    # Nothing new for longer than HangSeconds: still compiling, polled again, the next read
    # ProgressReadSeconds later.
    quiet = _given(compiling, state["Progress"], 100 + 1800 + 60)
    where, state = read_progress(default, quiet)
    assert where == "RunTrainingWait", where
    assert state["Progress"] == {"At": MINUTE, "Step": 0.0, "Phase": "compiling",
                                 "Deadline": 100 + 10800,
                                 "NextRead": 100 + 1800 + 60 + 600, "Stale": -1}  # fmt: skip
    # The compile's end and step 5 in one minute: training, the training limit.
    mixed = {"Times": [NEXT, MINUTE], "Steps": [5.0, 0.0],
             "CompilingTimes": [NEXT, MINUTE], "CompilingSteps": [0.0, 0.0]}  # fmt: skip
    where, state = read_progress(default, _given(mixed, state["Progress"], 2000))
    assert where == "RunTrainingWait" and state["Progress"]["Deadline"] == 2000 + 1800, state
    # No compiling line in the window at all: training.
    steps = {"Times": [NEXT], "Steps": [9.0], "CompilingTimes": [], "CompilingSteps": []}
    where, state = read_progress(default, _given(steps, state["Progress"], 2100))
    assert state["Progress"] == {"At": NEXT, "Step": 9.0, "Phase": "training",
                                 "Deadline": 2100 + 1800,
                                 "NextRead": 2100 + 600, "Stale": -1}, state  # fmt: skip
    # A compile after training steps (an evaluation's graph) whose line falls in the same
    # minute and at the same step as the newest training line: no new step, a new phase, so
    # the compile limit from now; past HangSeconds it is polled again, not ended.
    seen = {"At": NEXT, "Step": 9.0, "Phase": "training", "Deadline": 2100 + 1800,
            "NextRead": 2100 + 600, "Stale": -1}  # fmt: skip
    recompiling = {"Times": [NEXT], "Steps": [9.0],
                   "CompilingTimes": [NEXT], "CompilingSteps": [9.0]}  # fmt: skip
    where, state = read_progress(default, _given(recompiling, seen, 2700))
    assert where == "RunTrainingWait", where
    assert state["Progress"] == {"At": NEXT, "Step": 9.0, "Phase": "compiling",
                                 "Deadline": 2700 + 10800,
                                 "NextRead": 2700 + 600, "Stale": -1}, state  # fmt: skip
    where, state = read_progress(default, _given(recompiling, state["Progress"], 2700 + 1900))
    assert where == "RunTrainingWait" and state["Progress"]["Deadline"] == 2700 + 10800, state
    # Without the phase kept, the same read past HangSeconds ended the attempt as hung.
    where, state = read_progress(default, _given(recompiling, seen, 2100 + 1800))
    assert where == "RunTrainingWait" and state["Progress"]["Phase"] == "compiling", state
    # Past the compile limit with nothing new: the attempt ends, its cause in $.Hang.
    where, state = read_progress(default, _given(compiling, {**start, "At": MINUTE, "Step": 0},
                                                 10800))  # fmt: skip
    assert where == "RunTrainingCancelRest", where
    assert state["Hang"]["Cause"].startswith(f"no progress since step 0 at {MINUTE}"), state


def test_a_job_with_no_progress_line_yet_is_ended_only_past_the_compile_limit(
    default: Synth,
) -> None:
    """Before the attempt's first line GetMetricData answers no datapoint (a MetricDataResult
    with empty Timestamps and Values: botocore's cloudwatch model): within CompileHangSeconds of
    the nodes being ready the reader waits for the next read; past it the attempt ends, "no
    progress since the nodes were ready"."""
    start = {"At": SINCE, "Step": -1, "Phase": "compiling",
             "Deadline": 10800, "NextRead": 0, "Stale": -2}  # fmt: skip
    nothing = {"Times": [], "Steps": [], "CompilingTimes": [], "CompilingSteps": []}
    where, state = read_progress(default, _given(nothing, start, 60))
    assert where == "RunTrainingWait", where
    assert state["Progress"] == {**start, "NextRead": 60 + 600, "Stale": -1}, state
    where, state = read_progress(default, _given(nothing, state["Progress"], 5000))
    assert where == "RunTrainingWait", where
    assert state["Progress"] == {**start, "NextRead": 5000 + 600, "Stale": -1}, state
    where, state = read_progress(default, _given(nothing, state["Progress"], 10800))
    assert where == "RunTrainingCancelRest", where
    assert state["Hang"]["Cause"].startswith(
        f"no progress since the nodes were ready at {SINCE}"
    ), state


def test_the_minute_the_nodes_were_ready_in_is_not_the_attempts_progress(default: Synth) -> None:
    """A retry's nodes ready at 06:33:27, in the minute of the previous attempt's last line
    (step 5): CloudWatch rounds GetMetricData's StartTime down to 06:33:00 (botocore's cloudwatch
    model) and answers that minute's datapoint. The first read keeps its step as stale: the
    compile limit from when the nodes were ready stands, and a retry compiling for longer than
    HangSeconds is polled again, not ended (at 2c3d5cf it was: "no progress since step 5.0 at
    06:33:00", HangSeconds after the first read); a later minute's datapoint, or that minute's
    step grown past the stale one, is the retry's."""
    since = "2026-11-26T06:33:27Z"
    start = {"At": since, "Step": -1, "Phase": "compiling", "Deadline": 10800, "NextRead": 0,
             "Stale": -2}  # fmt: skip
    stale = {"Times": [MINUTE], "Steps": [5.0], "CompilingTimes": [], "CompilingSteps": []}
    where, state = read_progress(default, _given(stale, start, 5))
    assert where == "RunTrainingWait", where
    kept = {**start, "Stale": 5.0}
    assert state["Progress"] == {**kept, "NextRead": 5 + 600}, state
    where, state = read_progress(default, _given(stale, state["Progress"], 5 + 1800 + 600))
    assert where == "RunTrainingWait", state.get("Hang")
    assert state["Progress"] == {**kept, "NextRead": 5 + 1800 + 600 + 600}, state
    # The retry's first lines, compiling, in the next minute: its progress, the compile limit.
    own = {"Times": [NEXT, MINUTE], "Steps": [0.0, 5.0],
           "CompilingTimes": [NEXT], "CompilingSteps": [0.0]}  # fmt: skip
    where, state = read_progress(default, _given(own, state["Progress"], 3000))
    assert where == "RunTrainingWait", where
    assert state["Progress"] == {"At": NEXT, "Step": 0.0, "Phase": "compiling",
                                 "Deadline": 3000 + 10800, "NextRead": 3000 + 600,
                                 "Stale": 5.0}, state  # fmt: skip
    # That minute's step past the stale one: lines written since the first read, the retry's.
    grown = {"Times": [MINUTE], "Steps": [7.0], "CompilingTimes": [], "CompilingSteps": []}
    where, state = read_progress(default, _given(grown, {**kept, "NextRead": 605}, 700))
    assert state["Progress"] == {"At": MINUTE, "Step": 7.0, "Phase": "training",
                                 "Deadline": 700 + 1800, "NextRead": 700 + 600,
                                 "Stale": 5.0}, state  # fmt: skip
    # Only the stale minute, past the compile limit: no line of the attempt's was seen.
    where, state = read_progress(default, _given(stale, kept, 10800))
    assert where == "RunTrainingCancelRest", where
    assert state["Hang"]["Cause"].startswith(
        f"no progress since the nodes were ready at {since}"
    ), state
    # Nothing in that minute at the first read (a new cluster's first job): a datapoint of that
    # minute later on is the attempt's.
    nothing = {"Times": [], "Steps": [], "CompilingTimes": [], "CompilingSteps": []}
    where, state = read_progress(default, _given(nothing, start, 1))
    assert state["Progress"]["Stale"] == -1, state
    where, state = read_progress(default, _given(stale, state["Progress"], 30))
    assert state["Progress"]["Step"] == 5.0 and state["Progress"]["Deadline"] == 30 + 1800, state
