"""Warm spares rehearsed through the synthesized state machine: a node of a running job dies,
with spare_nodes=1 (without one: tests/test_supervisor.py, the dead node's test).

The stand-in runs as many nodes as the synthesized Auto Scaling group's desired capacity
(node_count + spare_nodes, stacks/compute.py). With a spare, the retry finds node_count
InService nodes at once (FullSet, stacks/supervisor_workflow.py), preflights the spare with the
survivor and resumes on them: the workflow never enters WaitForNodes. Measured: from the
death to the resumed run's first step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.cluster_lib.documents import join_train_args
from scripts.rehearsal.aws_stand_in import local_cloud
from scripts.rehearsal.hosts import NetnsHosts
from scripts.rehearsal.supervisor import local_supervisor, map_run_histories
from stacks.supervisor_limits import DEFAULT_POLL_SECONDS
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
from tests.test_stacks_compute import group_properties
from tests.test_supervisor import Supervisor

__all__ = ["sample_data"]  # a fixture, used by name


@contextlib.contextmanager
def supervised(tmp_path: Path, cluster: Synth, **options: Any) -> Iterator[tuple[Any, Supervisor]]:
    """As many stand-in nodes as the synthesized group runs, and its state machine."""
    if not NetnsHosts.available():
        pytest.skip("needs root and iproute2")
    nodes = int(group_properties(cluster)["DesiredCapacity"])
    assert nodes == cluster.config.group_size
    with (
        local_cloud(nodes, tmp_path, cluster_name=cluster.config.cluster_name, **options) as cloud,
        local_supervisor(cloud, cluster.templates["operations"]) as arn,
        map_run_histories() as map_runs,
    ):
        yield cloud, Supervisor(cloud, arn, map_runs)


def documents(cloud: Any, name: str) -> list[Any]:
    """The commands of one document (Preflight, RunTraining), in the order they were sent."""
    return [c for c in cloud.commands.values() if c.document.endswith(name)]


def die_and_resume(
    tmp_path: Path, sample_data: Path, cluster: Synth, settings: dict[str, int]
) -> dict[str, Any]:
    """One of the job's nodes dies while the trainers hold after step 5, the supervisor run
    with `settings`. Returns what the test checks."""
    job = unique_job_id("spare")
    args = train_args(sample_data, "--max-steps", "10", "--checkpoint-every", "5",
                      "--eval-every", "10", "--log-every", "1")  # fmt: skip
    with supervised(tmp_path, cluster, node_settings=HOLD_AT_5) as (cloud, supervisor):
        execution = supervisor.start(job, TrainArgs=join_train_args(args), MaxRetries=1, **settings)
        held(tmp_path, job, 5, 400, lambda: supervisor.trace(execution))
        assert checkpoints(tmp_path / "jobs" / job) == [5]
        (first,) = documents(cloud, "RunTraining")
        chosen = set(first.invocations)
        assert len(chosen) == cluster.config.node_count
        spares = {i.instance_id for i in cloud.running()} - chosen
        assert len(spares) == cluster.config.spare_nodes
        victim = next(i for i in cloud.running() if i.instance_id == sorted(chosen)[-1])
        died = time.time()
        cloud.instances.terminate(victim)  # what EC2 does when an instance dies
        status = supervisor.wait(execution, 600)
        assert status == "SUCCEEDED", supervisor.trace(execution)
        # Every wake ended well: one that fails leaves the messages it received unanswered.
        outcomes = cloud.wake.outcomes()
        assert not any(o.failed for o in outcomes), [line for o in outcomes for line in o.lines()]
        assert gone(job), "a process of the job outlived it"
        steps = job_metrics(tmp_path, job, "train")
        resumed = min((r for r in steps if r["time"] > died), key=lambda r: r["time"])
        return {
            "chosen": chosen,
            "spares": spares,
            "victim": victim.instance_id,
            "preflights": [set(c.invocations) for c in documents(cloud, "Preflight")],
            "runs": [set(c.invocations) for c in documents(cloud, "RunTraining")],
            "entered": supervisor.entered(execution),
            "resumed": resumed,
            "seconds": resumed["time"] - died,
            "resume": [r["step"] for r in job_metrics(tmp_path, job, "resume")],
            "woken": [e["detail-type"] for e in cloud.wake.delivered],
            "timeline": "\n".join(
                [
                    supervisor.timeline(execution, died),
                    "the wakes:",
                    *(line for outcome in cloud.wake.outcomes() for line in outcome.lines()),
                ]
            ),
        }


def report(seen: dict[str, Any], cluster: Synth, used: dict[str, int]) -> None:
    settings = ", ".join(f"{k} {v}" for k, v in used.items())
    print(
        f"\nspare_nodes={cluster.config.spare_nodes}: death to training again "
        f"{seen['seconds']:.1f} s (first step {seen['resumed']['step']} of the resumed run; "
        f"{settings})"
    )


#: Realistic settings: a poll that only the wake's events cut short (stacks/supervisor_wake.py),
#: twice the default 300 s, and a short grace and retry delay (docs/operating.md, "Warm spares",
#: says why they may be this short).
WOKEN = {"PollSeconds": 600, "FailureGraceSeconds": 30, "RetryDelaySeconds": 5}


@pytest.mark.slow
@pytest.mark.netns
def test_with_a_spare_the_retry_starts_on_it_at_once_and_the_wake_has_it_training_within_seconds(
    tmp_path: Path, sample_data: Path
) -> None:
    """Two nodes for the job and one spare (the group runs 3), PollSeconds 600: one of the job's
    nodes dies. The retry reads the group, finds node_count InService nodes and never waits for
    one; it preflights the spare with the survivor and resumes on them at step 6. The group's
    termination of the node (its lifecycle action event) and the invocations' ends (Run
    Command's events) wake the batches' polls, so the death, the cancel, the preflight and the
    retry are each acted on within seconds: training resumes within half the default poll of
    the death (without the wake the first preflight alone would wait ten minutes:
    tests/test_supervisor_wake.py shows the same wait running out)."""
    cluster = synth(spare_nodes="1")
    seen = die_and_resume(tmp_path, sample_data, cluster, WOKEN)
    survivor = seen["chosen"] - {seen["victim"]}
    (spare,) = seen["spares"]
    # The retry read the group, found node_count InService nodes and never waited for one.
    assert "WaitForNodes" not in seen["entered"], seen["entered"]
    assert seen["entered"].count("JoinHosts") == 2
    # The spare was preflighted with the survivor before it joined, and the job resumed on them.
    assert seen["preflights"] == [seen["chosen"], survivor | {spare}]
    assert seen["runs"] == [seen["chosen"], survivor | {spare}]
    assert seen["resume"] == [5] and seen["resumed"]["step"] == 6
    assert "EC2 Instance-terminate Lifecycle Action" in seen["woken"], seen["woken"]
    assert seen["seconds"] < DEFAULT_POLL_SECONDS / 2, (
        f"{seen['seconds']:.1f} s; the states entered after the death:\n{seen['timeline']}"
    )
    report(seen, cluster, WOKEN)
