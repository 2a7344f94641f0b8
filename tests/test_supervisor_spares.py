"""Warm spares rehearsed through the synthesized state machine: a node of a running job dies,
with spare_nodes=1 and without.

The stand-in runs as many nodes as the synthesized Auto Scaling group's desired capacity
(node_count + spare_nodes, stacks/compute.py). With a spare, the retry finds node_count
InService nodes at once (FullSet, stacks/supervisor_workflow.py), preflights the spare with the
survivor and resumes on them: the workflow never enters WaitForNodes. Without one, the retry
waits for the group's replacement; here the replacement is launched once the workflow is seen
waiting for it (on AWS its EC2 launch and bootstrap take that place: docs/operating.md, "Warm
spares", models them). Measured in both: from the death to the resumed run's first step.
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
    wait_for,
)
from tests.test_stacks_compute import group_properties
from tests.test_supervisor import FAST, Supervisor

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
    tmp_path: Path, sample_data: Path, cluster: Synth, settings: dict[str, int] | None = None
) -> dict[str, Any]:
    """One of the job's nodes dies while the trainers hold after step 5; with no spare the
    replacement starts once the workflow waits for nodes. `settings`: the supervisor's
    (FAST by default). Returns what the test checks."""
    settings = settings or FAST
    job = unique_job_id("spare" if cluster.config.spare_nodes else "no-spare")
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
        replacement = None
        if not spares:
            wait_for(
                "the retry waiting for nodes",
                lambda: "WaitForNodes" in supervisor.entered(execution),
                600,
                lambda: supervisor.trace(execution),
            )
            replacement = cloud.instances.launch(victim.slot)  # the group's replacement
            cloud.instances.instances.append(replacement)
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
            "replacement": replacement.instance_id if replacement else None,
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


def report(seen: dict[str, Any], cluster: Synth, used: dict[str, int] | None = None) -> None:
    settings = ", ".join(f"{k} {v}" for k, v in (used or FAST).items())
    print(
        f"\nspare_nodes={cluster.config.spare_nodes}: death to training again "
        f"{seen['seconds']:.1f} s (first step {seen['resumed']['step']} of the resumed run; "
        f"{settings})"
    )


@pytest.mark.slow
@pytest.mark.netns
def test_with_a_spare_the_retry_starts_on_it_without_waiting_for_a_node(
    tmp_path: Path, sample_data: Path
) -> None:
    cluster = synth(spare_nodes="1")  # two nodes for the job, one spare: the group runs 3
    seen = die_and_resume(tmp_path, sample_data, cluster)
    survivor = seen["chosen"] - {seen["victim"]}
    (spare,) = seen["spares"]
    # The retry read the group, found node_count InService nodes and never waited for one.
    assert "WaitForNodes" not in seen["entered"], seen["entered"]
    assert seen["entered"].count("JoinHosts") == 2
    # The spare was preflighted with the survivor before it joined, and the job resumed on them.
    assert seen["preflights"] == [seen["chosen"], survivor | {spare}]
    assert seen["runs"] == [seen["chosen"], survivor | {spare}]
    assert seen["resume"] == [5] and seen["resumed"]["step"] == 6
    report(seen, cluster)


@pytest.mark.slow
@pytest.mark.netns
def test_without_a_spare_the_retry_waits_for_the_replacement(
    tmp_path: Path, sample_data: Path
) -> None:
    cluster = synth()
    seen = die_and_resume(tmp_path, sample_data, cluster)
    survivor = seen["chosen"] - {seen["victim"]}
    assert "WaitForNodes" in seen["entered"]
    assert seen["runs"] == [seen["chosen"], survivor | {seen["replacement"]}]
    assert seen["resume"] == [5] and seen["resumed"]["step"] == 6
    report(seen, cluster)


#: Realistic settings: the default poll, which only the wake's events cut short
#: (stacks/supervisor_wake.py), and a short grace and retry delay (docs/operating.md, "Warm
#: spares", says why they may be this short).
WOKEN = {"PollSeconds": 300, "FailureGraceSeconds": 30, "RetryDelaySeconds": 5}
#: A poll that no event cuts short would leave the job untouched for this long.
LONG_POLL = {**WOKEN, "PollSeconds": 600}


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.parametrize("settings", [WOKEN, LONG_POLL], ids=["poll-300", "poll-600"])
def test_with_a_spare_the_wake_has_the_job_training_again_well_within_a_poll(
    tmp_path: Path, sample_data: Path, settings: dict[str, int]
) -> None:
    """The same death with a spare at PollSeconds 300 and 600: the group's termination of the
    node (its lifecycle action event) and the invocations' ends (Run Command's events) wake the
    batches' polls, so the preflights, the death, the cancel and the retry are each acted on
    within seconds; training resumes at step 6 on the survivor and the spare well within one
    PollSeconds of the death (at PollSeconds 600 without the wake, the first preflight alone
    would wait ten minutes: tests/test_supervisor_wake.py shows the same wait running out)."""
    cluster = synth(spare_nodes="1")
    seen = die_and_resume(tmp_path, sample_data, cluster, settings)
    survivor = seen["chosen"] - {seen["victim"]}
    (spare,) = seen["spares"]
    assert "WaitForNodes" not in seen["entered"], seen["entered"]
    assert seen["runs"] == [seen["chosen"], survivor | {spare}]
    assert seen["resume"] == [5] and seen["resumed"]["step"] == 6
    assert "EC2 Instance-terminate Lifecycle Action" in seen["woken"], seen["woken"]
    assert seen["seconds"] < settings["PollSeconds"] / 2, (
        f"{seen['seconds']:.1f} s; the states entered after the death:\n{seen['timeline']}"
    )
    report(seen, cluster, settings)
