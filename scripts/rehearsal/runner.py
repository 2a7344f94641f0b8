"""`cluster.py rehearse`: the cluster's job path on one machine, without AWS.

As root (network namespaces, iproute2, unshare) the job goes through every layer AWS has: the
operator CLI's own `Jobs` starts an execution of the operations stack's job supervisor in moto's
Step Functions interpreter (supervisor.py), whose SSM, Auto Scaling, EC2 and SNS calls the Run
Command stand-in answers (aws_stand_in.py), whose nodes run the real SSM documents as the SSM
agent does. Without root, on loopback addresses, the node scripts are started directly
(direct.py), without the agent's layer.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.cluster import Cluster
from scripts.cluster_lib.job_inputs import prepare
from scripts.cluster_lib.jobs import Jobs
from scripts.rehearsal.aws_stand_in import local_cloud
from scripts.rehearsal.direct import Rehearsal, check_failed, default_train_args, prepare_data
from scripts.rehearsal.hosts import NetnsHosts, make_hosts
from scripts.rehearsal.supervisor import local_supervisor, synthesize_operations


def rehearse(
    nodes: int,
    output: Path,
    job_id: str,
    extra_args: Sequence[str],
    *,
    mode: str = "auto",
    preflight: bool = True,
    fresh: bool = False,
    quiet: bool = False,
    timeout: float = 1800,
    out: Callable[[str], None] = print,
) -> dict[str, Any]:
    """What `cluster.py rehearse` does; returns the job's summary metrics line.

    With network namespaces (root), the job goes through every layer AWS has: the operator
    CLI's own `train` starts an execution of the operations stack's job supervisor (its
    synthesized definition, in moto's Step Functions interpreter), which waits for the nodes,
    runs preflight, sends RunTraining and retries through the local Run Command stand-in
    (scripts/rehearsal/aws_stand_in.py), which runs the real SSM documents on the nodes as the
    SSM agent does. On loopback addresses (no privileges) the node
    scripts are started directly, without the agent's layer."""
    if not 1 <= nodes <= 8:
        raise ClusterError(f"--nodes {nodes} is not allowed: rehearse with 1 to 8 nodes")
    if mode not in ("auto", "netns", "loopback"):
        raise ClusterError(f"--mode {mode!r} is not allowed: use auto, netns or loopback")
    through_agent = mode != "loopback" and NetnsHosts.available() and shutil.which("unshare")
    if mode == "netns" and not through_agent:
        raise ClusterError("--mode netns needs root, iproute2 and unshare; use --mode loopback")
    if through_agent:
        return _rehearse_through_run_command(
            nodes, output, job_id, extra_args, preflight=preflight, fresh=fresh, quiet=quiet,
            out=out,
        )  # fmt: skip
    return _rehearse_direct(
        nodes, output, job_id, extra_args, mode=mode, preflight=preflight, fresh=fresh,
        quiet=quiet, timeout=timeout, out=out,
    )  # fmt: skip


#: Folders the stand-in's nodes see through overlays: writes there stay on the node.
NODE_PRIVATE = ("/etc", "/opt", "/var", "/usr/local")


def _rehearse_through_run_command(
    nodes: int,
    output: Path,
    job_id: str,
    extra_args: Sequence[str],
    *,
    preflight: bool,
    fresh: bool,
    quiet: bool,
    out: Callable[[str], None],
) -> dict[str, Any]:
    if not preflight:
        raise ClusterError(
            "--skip-preflight is for --mode loopback only: through the Run Command stand-in "
            "the job supervisor runs preflight before every attempt, as it does in AWS"
        )
    output = output.resolve()
    for private in NODE_PRIVATE:
        if output == Path(private) or Path(private) in output.parents:
            raise ClusterError(
                f"--output {output} is inside {private}, which each rehearsal node overlays "
                "with its own files: choose a folder elsewhere (e.g. build/rehearsal)"
            )
    data = prepare_data(output / "data")
    if fresh:
        shutil.rmtree(output / "jobs" / job_id, ignore_errors=True)
    shutil.rmtree(output / "nodes", ignore_errors=True)
    out("rehearsal: synthesizing the operations stack for its job supervisor")
    template = synthesize_operations(REHEARSAL_CLUSTER, nodes)
    with (
        local_cloud(nodes, output, cluster_name=REHEARSAL_CLUSTER) as cloud,
        local_supervisor(cloud, template),
    ):
        addresses = ", ".join(i.address for i in cloud.running())
        out(
            f"rehearsal: {nodes} nodes (netns: {addresses}) behind the local Run Command "
            f"stand-in, the job supervisor in moto's Step Functions interpreter, output {output}"
        )
        cluster = Cluster(
            cloud.clients(), cloud.cluster_name, out=out, poll_interval=1.0,
            wait_timeout=120, failure_grace=60,
        )  # fmt: skip
        jobs = Jobs(cluster)
        # The reference workload, packed and uploaded to the data bucket as `train` does.
        inputs = prepare(
            cluster.clients.s3, cluster.outputs().data_bucket, code=None, script=None,
            module=None, data=None, out=out,
        )  # fmt: skip
        execution = jobs.start(
            job_id,
            [*default_train_args(data), *extra_args],
            inputs,
            max_retries=1,
            retry_delay=5,
            options=REHEARSAL_SUPERVISOR,
        )
        jobs.wait_for_start(execution, job_id)  # the job queue's dispatcher starts it
        jobs.follow(execution, job_id, stream=not quiet)  # Ctrl-C ends the rehearsal
    return _summary(output, job_id, out)


#: The rehearsal cluster's name (the stand-in's and the synthesized stack's).
REHEARSAL_CLUSTER = "rehearsal"
#: The supervisor's timing for a rehearsal: poll every second, cancel the rest of an attempt
#: a minute after one node ended.
REHEARSAL_SUPERVISOR = {"PollSeconds": 1, "FailureGraceSeconds": 60}


def _summary(output: Path, job_id: str, out: Callable[[str], None]) -> dict[str, Any]:
    metrics = output / "jobs" / job_id / "metrics.jsonl"
    records = []
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    summaries = [r for r in records if r.get("event") == "summary"]
    if not summaries:
        raise ClusterError(f"job {job_id} ended without a summary line in {metrics}")
    out(f"rehearsal: job {job_id} finished; metrics in {metrics}")
    out("summary: " + json.dumps(summaries[-1]))
    return summaries[-1]


def _rehearse_direct(
    nodes: int,
    output: Path,
    job_id: str,
    extra_args: Sequence[str],
    *,
    mode: str,
    preflight: bool,
    fresh: bool,
    quiet: bool,
    timeout: float,
    out: Callable[[str], None],
) -> dict[str, Any]:
    with make_hosts(nodes, mode) as hosts:
        rehearsal = Rehearsal(hosts, output, echo=None if quiet else out)
        out(
            f"rehearsal: {nodes} nodes ({hosts.mode}: {', '.join(hosts.addresses)}), "
            f"output {rehearsal.output} (node scripts started directly, without the SSM "
            "agent's layer: run as root for the Run Command stand-in)"
        )
        data = rehearsal.prepare_data()
        if fresh:
            shutil.rmtree(rehearsal.job_dir(job_id), ignore_errors=True)
        if preflight:
            out("rehearsal: preflight.sh on every node")
            running = rehearsal.preflight()
            check_failed("preflight", running.wait(timeout=600), running)
        out(f"rehearsal: launch.sh on every node, job {job_id}")
        running = rehearsal.start_job(job_id, [*default_train_args(data), *extra_args])
        check_failed(f"job {job_id}", running.wait(timeout=timeout), running)
        return _summary(rehearsal.output, job_id, out)
