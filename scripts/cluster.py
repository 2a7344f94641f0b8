#!/usr/bin/env python3
"""Operate a deployed Trainium cluster, or rehearse one locally.

    python scripts/cluster.py status
    python scripts/cluster.py preflight
    python scripts/cluster.py precompile --job-id ID [--steps 10] [--code DIR ...] -- <args>
    python scripts/cluster.py train [--job-id ID | --resume ID] [--code DIR]
                                    [--entry SCRIPT | --module M] [--data s3://BUCKET/PREFIX]
                                    [--max-retries N] [--detach] -- <entry args>
    python scripts/cluster.py jobs [--limit 10]
    python scripts/cluster.py stop --job-id ID
    python scripts/cluster.py logs --job-id ID [--node RANK|ADDRESS|INSTANCE] [--follow]
    python scripts/cluster.py shell RANK|ADDRESS|INSTANCE
    python scripts/cluster.py roll [--wait] [--force]
    python scripts/cluster.py export [--timeout 3600]
    python scripts/cluster.py deploy [--allow-disruption] [--dry-run]
    python scripts/cluster.py rehearse --nodes 2 [--output build/rehearsal] [-- <train.py args>]

The AWS commands find the cluster through its operations stack (`<cluster>-operations`),
its nodes by their tags, and drive them with the stack's SSM documents. `train` starts the job
as an execution of the stack's job supervisor (a Step Functions state machine), which waits for
the nodes, runs preflight, retries and resumes in AWS: Ctrl-C or a closed terminal only stops
following it. `rehearse` needs no
AWS: it runs the same node scripts on local network namespaces (or loopback addresses).

This file is the command line: the parser, the dispatch and what each command prints. What the
commands do is in scripts/cluster_lib (a map of its modules heads scripts/cluster_lib/cluster.py),
what they check in their arguments in scripts/cluster_lib/arguments.py; `rehearse` is
scripts/rehearsal/runner.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.arguments import UsageError, no_retry_statuses, validate
from stacks.api_rates import QUOTAS

if TYPE_CHECKING:
    from scripts.cluster_lib.clients import Session
    from scripts.cluster_lib.cluster import Cluster
    from scripts.cluster_lib.commands import CommandResult
    from scripts.cluster_lib.job_inputs import JobInputs

DEFAULT_CLUSTER = os.environ.get("TRAINIUM_CLUSTER_NAME", "trainium")


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see --help)")


def split_train_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Splits the command line at the first `--`: CLI options before, train.py's after."""
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], argv[index + 1 :]
    return argv, []


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="cluster.py",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Arguments after `--` go to workload/train.py unchanged.",
    )
    # The global options work before or after the command name.
    common = Parser(add_help=False)
    for target, default in ((parser, None), (common, argparse.SUPPRESS)):
        target.add_argument(
            "--cluster-name",
            default=default or DEFAULT_CLUSTER,
            help="default: TRAINIUM_CLUSTER_NAME, then trainium; its settings file "
            "clusters/<name>.yaml, where there is one, gives the region",
        )
        target.add_argument(
            "--region", default=default,
            help="AWS region (default: the settings file's, else AWS_REGION, "
            "AWS_DEFAULT_REGION, then the profile's)",
        )  # fmt: skip
        target.add_argument(
            "--profile", default=default, help="AWS profile (default: AWS_PROFILE or default)"
        )
        target.add_argument(
            "--wait-timeout", type=float, default=default or 900,
            help="seconds to wait for all nodes to run and be online in SSM (default: 900)",
        )  # fmt: skip
        target.add_argument(
            "--poll-interval", type=float, default=default or 10,
            help="seconds between status checks (default: 10)",
        )  # fmt: skip
        target.add_argument(
            "--give-up-after", type=float, default=default or 1800,
            help="seconds of AWS errors (throttling, time-outs, an expired SSO session) to "
            "ride out while following a command (default: 1800)",
        )  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser(
        "status", parents=[common], help="stack, nodes (SSM, AMI, template version), commands"
    )

    preflight = sub.add_parser(
        "preflight", parents=[common], help="check every node and a cross-node all-reduce"
    )
    preflight.add_argument("--port", default="29600")

    def job_options(p: argparse.ArgumentParser, required: bool) -> None:
        p.add_argument("--job-id", required=required, help="names the job's output /fsx/jobs/ID")
        p.add_argument("--master-port", default="29500")
        p.add_argument(
            "--nproc-per-node", default="auto", help="processes per node (default: NeuronCores)"
        )
        p.add_argument(
            "--code", type=Path, default=None, metavar="DIR",
            help="the job's code directory, snapshotted and run on every node (default: the "
            "reference workload, workload/)",
        )  # fmt: skip
        p.add_argument(
            "--entry", default=None, metavar="SCRIPT",
            help="the script to run under torchrun, relative to --code",
        )  # fmt: skip
        p.add_argument(
            "--module", default=None, metavar="MODULE",
            help="the module to run under torchrun (python -m); default: workload.train",
        )  # fmt: skip
        p.add_argument(
            "--data", default=None,
            help="the training data: s3://<the cluster's data bucket>/<prefix> or a path "
            "under /fsx; the job gets it as TRAINIUM_DATA_DIR",
        )  # fmt: skip

    precompile = sub.add_parser(
        "precompile", parents=[common], help="fill the compile cache for a job"
    )
    job_options(precompile, required=True)
    precompile.add_argument("--steps", default="10", help="steps to trace (default: 10)")

    train = sub.add_parser(
        "train", parents=[common],
        help="start (or resume) a job under the cluster's supervisor in AWS and follow it",
    )  # fmt: skip
    job_options(train, required=False)
    train.add_argument(
        "--resume", metavar="JOB",
        help="resume job JOB from its latest checkpoint (its restored optimizer and schedule "
        "go on; a new --job-id is a new job, refused when the ID was used)",
    )  # fmt: skip
    train.add_argument(
        "--max-retries", type=int, default=2,
        help="the supervisor relaunches the job after a failure up to N times; each retry "
        "waits for a full set of nodes, runs preflight and resumes from the checkpoint "
        "(default: 2)",
    )  # fmt: skip
    train.add_argument(
        "--retry-delay", type=float, default=60, help="seconds before a retry (default: 60)"
    )
    train.add_argument(
        "--check-every", type=int, default=None,
        help="seconds between the supervisor's checks of the nodes' commands (default: 300, "
        "or the minimum for the cluster's size, at which one 48-hour attempt fits in an "
        "execution's 25,000 history events: 75 up to 50 nodes, 162 up to 100)",
    )  # fmt: skip
    train.add_argument(
        "--failure-grace", type=int, default=300,
        help="seconds the other nodes may run on after one node's command ended, before the "
        "supervisor cancels the attempt (default: 300)",
    )  # fmt: skip
    train.add_argument(
        "--hang-minutes", type=int, default=30,
        help="minutes without a progress line (docs/job-contract.md) after which the "
        "supervisor ends the attempt as hung and retries it from the last checkpoint "
        "(default: 30)",
    )  # fmt: skip
    train.add_argument(
        "--compile-hang-minutes", type=int, default=180,
        help="the same while the job compiles: before its first progress line, and after a "
        "compiling line (default: 180)",
    )  # fmt: skip
    train.add_argument(
        "--detach", action="store_true",
        help="start the job and return at once (Ctrl-C while following detaches too)",
    )  # fmt: skip
    train.add_argument("--quiet", action="store_true", help="do not print rank 0's output")
    train.add_argument(
        "--no-retry-on", default="", metavar="STATUSES",
        help="the trainer's exit statuses (comma separated, 1-127) that end the job without a "
        "retry, besides 2 (the job's own input is wrong: a bad flag, missing data)",
    )  # fmt: skip
    train.add_argument(
        "--retry-on", default="", metavar="STATUSES",
        help="statuses to retry all the same: `--retry-on 2` retries input errors too",
    )  # fmt: skip

    jobs = sub.add_parser(
        "jobs",
        parents=[common],
        help="current and past jobs: status, attempts, step, rate, ETA, metrics",
    )
    jobs.add_argument("--limit", type=int, default=10, help="newest N jobs (default: 10)")

    stop = sub.add_parser(
        "stop", parents=[common],
        help="stop a job: its supervisor's execution, then its processes on every node "
        "(its checkpoints stay)",
    )  # fmt: skip
    stop.add_argument("--job-id", required=True)

    logs = sub.add_parser(
        "logs", parents=[common], help="print a job's output from CloudWatch Logs"
    )
    logs.add_argument("--job-id", help="the latest RunTraining command of this job")
    logs.add_argument("--command-id", help="a command ID printed by train/preflight/...")
    logs.add_argument("--node", help="rank, address or instance ID (default: every node)")
    logs.add_argument("--lines", type=int, default=100, help="last N lines (default: 100)")
    logs.add_argument(
        "--follow", action="store_true", help="keep printing new output until the command ends"
    )

    shell = sub.add_parser(
        "shell", parents=[common],
        help="open a shell on a node (Session Manager, through the AWS CLI and its plugin)",
    )  # fmt: skip
    shell.add_argument("node", metavar="NODE", help="rank, address or instance ID")

    roll = sub.add_parser(
        "roll", parents=[common],
        help="replace the nodes that do not run the group's current launch template",
    )  # fmt: skip
    roll.add_argument("--wait", action="store_true", help="follow the instance refresh to its end")
    roll.add_argument(
        "--force", action="store_true", help="roll even while a job runs (it loses its nodes)"
    )

    export = sub.add_parser(
        "export", parents=[common], help="export FSx files to S3 and wait (before a destroy)"
    )
    export.add_argument(
        "--timeout", type=float, default=3600, help="seconds to wait for it (default: 3600)"
    )

    deploy = sub.add_parser(
        "deploy", parents=[common],
        help="deploy clusters/<cluster-name>.yaml (npx cdk deploy --all) after showing what "
        "it changes; refuses changes that end jobs or replace nodes",
    )  # fmt: skip
    deploy.add_argument(
        "--allow-disruption", action="store_true",
        help="deploy changes that end running jobs or replace nodes (node_count down, "
        "instance_type, ami, capacity settings, placement group, zone, region)",
    )  # fmt: skip
    deploy.add_argument(
        "--dry-run", action="store_true", help="show the changes and the command, deploy nothing"
    )

    rehearse = sub.add_parser(
        "rehearse", parents=[common], help="run the launch path locally, without AWS"
    )
    rehearse.add_argument("--nodes", type=int, default=2)
    rehearse.add_argument("--output", type=Path, default=Path("build/rehearsal"))
    rehearse.add_argument("--job-id", default="rehearsal")
    rehearse.add_argument(
        "--mode", default="auto", choices=("auto", "netns", "loopback"),
        help="netns: one network namespace per node (root); loopback: 127.0.0.x addresses",
    )  # fmt: skip
    rehearse.add_argument("--skip-preflight", action="store_true")
    rehearse.add_argument("--fresh", action="store_true", help="delete the job's output first")
    rehearse.add_argument("--quiet", action="store_true", help="do not print the nodes' output")
    return parser


# ------------------------------------------------------------------------- commands
def out(message: str) -> None:
    print(message, flush=True)


def make_cluster(args: argparse.Namespace, session: Session | None = None) -> Cluster:
    """The cluster behind the CLI's options; `session` (a boto3 Session) replaces the one
    built from --profile / --region, e.g. to serve the calls locally."""
    import boto3
    from botocore.exceptions import ProfileNotFound

    from scripts.cluster_lib.clients import Clients, resolve_region
    from scripts.cluster_lib.cluster import Cluster

    if session is None:
        region = settings_region(args.cluster_name, args.region) or resolve_region(
            args.region, os.environ
        )
        try:
            session = boto3.Session(profile_name=args.profile, region_name=region)
        except ProfileNotFound:
            raise ClusterError(
                f"AWS profile {args.profile!r} not found in the AWS config"
            ) from None
    return Cluster(
        Clients.from_session(session),
        args.cluster_name,
        out=out,
        poll_interval=args.poll_interval,
        wait_timeout=args.wait_timeout,
        give_up_after=args.give_up_after,
    )


def settings_region(
    cluster_name: str, cli_region: str | None, root: Path | None = None
) -> str | None:
    """The region of the cluster's settings file (clusters/<name>.yaml), which --region may
    repeat but not contradict; None without a file."""
    from stacks.config import ConfigError
    from stacks.settings_file import checkout_root, load_cluster, settings_path

    root = root or checkout_root()
    try:
        settings = load_cluster(cluster_name, root)
    except ConfigError as error:
        raise ClusterError(str(error)) from None
    if settings is None:
        return None
    if cli_region and cli_region != settings.region:
        raise ClusterError(
            f"--region {cli_region} contradicts {settings_path(cluster_name, root).name} (region: "
            f"{settings.region}); allowed: leave --region out, or --region {settings.region}"
        )
    return settings.region


def cmd_deploy(cluster: Cluster, args: argparse.Namespace) -> int:
    from scripts.cluster_lib.deploy import deploy

    return deploy(
        cluster.clients.cloudformation,
        cluster.cluster_name,
        allow_disruption=args.allow_disruption,
        dry_run=args.dry_run,
        out=out,
    )


def cmd_status(cluster: Cluster) -> int:
    from scripts.cluster_lib.spares import job_nodes, role_of, spare_count

    outputs = cluster.outputs()
    out(
        f"cluster {outputs['ClusterName']} (stack {outputs.stack_name}): "
        f"{outputs['NodeCount']} x {outputs['InstanceType']}"
    )
    try:
        template = cluster.launch_template()
        out(
            f"launch template {template['id']}: current version {template['version']}, "
            f"AMI {template['ami'] or '-'}"
        )
    except ClusterError as error:  # e.g. the compute stack is not deployed
        template = {"id": "", "version": "", "ami": ""}
        out(f"launch template: unknown ({error})")
    nodes, starting = cluster.running_nodes()
    status = cluster.fleet.ssm_status(nodes)
    software = cluster.fleet.reported_software() if nodes else {}
    spares, running = spare_count(outputs), {}
    if spares:
        running = job_nodes(cluster.clients.ssm, outputs)
    wanted = f"{outputs['NodeCount']}" + (f" + {spares} spare" if spares else "")
    out(f"nodes: {len(nodes)} running of {wanted}, {starting} starting")
    stale = 0
    for rank, node in enumerate(nodes):
        launched = node.launch_time.strftime("%Y-%m-%d %H:%M") if node.launch_time else "-"
        version = node.launch_template_version or "?"
        old = bool(template["version"]) and (
            version != template["version"] or node.image_id != template["ami"]
        )
        stale += old
        out(
            f"  {rank:>3}  {node.instance_id:<20} {node.address:<15} {node.zone:<12} "
            f"ssm {status.get(node.instance_id, 'not registered'):<15} "
            f"{node.image_id or '-':<21} template v{version:<4} "
            f"software {software.get(node.instance_id, '?'):<16} launched {launched}"
            + ("  (older launch template)" if old else "")
            + (f"  {role_of(node.instance_id, running)}" if spares else "")
        )
    if stale:
        out(
            f"{stale} of {len(nodes)} nodes do not run launch template version "
            f"{template['version']}: roll the fleet with `cluster.py roll` when no job runs"
        )
    refresh = cluster.fleet.active_refresh() if template["id"] else None
    if refresh:
        out(
            f"instance refresh {refresh.get('InstanceRefreshId')}: {refresh.get('Status')}, "
            f"{refresh.get('PercentageComplete', 0)}% done"
        )
    commands = cluster.history.recent_commands()
    out("recent commands:" if commands else "recent commands: none")
    for command in commands:
        when = command.get("RequestedDateTime")
        job = command.get("Parameters", {}).get("JobId", [""])[0]
        out(
            f"  {when:%Y-%m-%d %H:%M} {command['Document']:<13} {job:<24} "
            f"{command.get('Status', ''):<11} {command['CommandId']}"
            if when
            else f"  {command['Document']} {job} {command.get('Status', '')} {command['CommandId']}"
        )
    from scripts.cluster_lib.jobs import Jobs

    try:
        warning = Jobs(cluster).idle_warning_now() if nodes else None
    except ClusterError:  # a stack without the supervisor or the queue: no jobs to read
        warning = None
    if warning:
        out(warning)
    return 0


def report(result: CommandResult, what: str) -> int:
    if not result.ok:
        raise ClusterError(result.summary())
    out(f"{what} succeeded on all {len(result.invocations)} nodes")
    return 0


def cmd_logs(cluster: Cluster, args: argparse.Namespace) -> int:
    """Prints the output of a command (every batch of it) from CloudWatch Logs; with
    --follow, keeps printing until the command has ended everywhere. A RunTraining or
    Precompile command's output is the job's: the nodes' job-log streams over the command's
    time (logs.py job_output_window), which the CloudWatch agent fills from the node's log
    files; the SSM agent's output of such a command holds only launch.sh's own lines. Any
    other command's output is the SSM agent's."""
    from botocore.exceptions import ClientError

    from scripts.cluster_lib.clients import aws_errors
    from scripts.cluster_lib.command_history import latest_attempt
    from scripts.cluster_lib.logs import JOB_OUTPUT_FOLDERS, job_output_window, job_stream, lines_of

    log_group = cluster.outputs()["TrainingLogGroupName"]
    if args.command_id:
        command = cluster.history.command(args.command_id)
        document = command["Document"]
        commands = [command]
        others = cluster.history.commands(document) if document in JOB_OUTPUT_FOLDERS else []
    else:
        document = "RunTraining"
        others = cluster.history.commands(document)
        mine = [c for c in others if c.get("Parameters", {}).get("JobId") == [args.job_id]]
        if not mine:
            raise ClusterError(f"no {document} command found for job {args.job_id}")
        commands = latest_attempt(mine)
    command_ids = [c["CommandId"] for c in commands]
    instance = None
    if args.node is not None:
        from scripts.cluster_lib.session import node_instance

        instance = node_instance(cluster, args.node, gone_ok=True)
    # (stream, the instance it belongs to, the time window of the command in it or None)
    streams: list[tuple[str, str, tuple[int, int | None] | None]] = []
    if document in JOB_OUTPUT_FOLDERS:
        for command in commands:
            window = job_output_window(command, others)
            for iid in command.get("InstanceIds", []):
                if instance in (None, iid):
                    streams.append((job_stream(iid, document), iid, window))
    # A stream's last --lines lines first, then whatever it gets after them.
    reader = cluster.logs.reader(first_lines=args.lines)
    # A poll reads at most what half of CloudWatch Logs' GetLogEvents rate allows in one
    # --poll-interval (stacks/api_rates.py, its quota and source), the streams in turn: on
    # 1,024 nodes every stream is read every 1,024 / budget polls, and none of its lines is
    # lost meanwhile (the reader keeps its place in each stream).
    budget = max(1, int(LOG_READS_PER_SECOND * args.poll_interval))
    turn, lap_done = 0, False

    def poll() -> int:
        nonlocal turn, lap_done
        printed = 0
        found = list(streams)
        if document not in JOB_OUTPUT_FOLDERS:
            suffix = f"{instance}/" if instance else ""
            for command_id in command_ids:
                for name in cluster.logs.log_streams(log_group, f"{command_id}/{suffix}"):
                    found.append((name, name.split("/")[1], None))
        total = len(found)
        if total > budget:
            start = turn % total
            found = found[start : start + budget]
            turn = start + len(found)
            lap_done = turn >= total
        else:
            lap_done = True
        for name, iid, window in found:
            try:
                events = reader.read(name, window)
            except ClientError as error:
                # A node's job-log stream appears once its CloudWatch agent has shipped a line.
                if error.response.get("Error", {}).get("Code") != "ResourceNotFoundException":
                    raise
                continue
            for event in events:
                stamp = datetime.fromtimestamp(event["timestamp"] / 1000, UTC)
                for line in lines_of(event):
                    out(f"{iid} {stamp:%H:%M:%S} {line}")
            printed += 1
        return printed

    with aws_errors("reading the command output"):
        printed = poll()
        if not lap_done:
            out(f"reading the output of more streams than {budget}: {budget} every "
                f"{args.poll_interval:g} s (CloudWatch Logs' GetLogEvents rate)")  # fmt: skip
        while not args.follow and not lap_done:
            cluster.patience.sleep(args.poll_interval)
            printed += poll()
        if not printed and not args.follow:
            raise ClusterError(
                f"no output in log group {log_group} for command {', '.join(command_ids)} yet"
            )
    if not args.follow:
        return 0
    while True:
        ended = cluster.history.commands_ended(command_ids)
        if ended is not None:
            # What the nodes wrote last reaches CloudWatch after the command has ended.
            cluster.patience.sleep(args.poll_interval)
            cluster.patience.patiently("reading the command output", poll)
            states = ", ".join(f"{cid} {status}" for cid, status in ended.items())
            out(f"command ended: {states}")
            return 0
        cluster.patience.sleep(args.poll_interval)
        cluster.patience.patiently("reading the command output", poll)


#: GetLogEvents calls `logs` makes a second: half of CloudWatch Logs' documented rate.
LOG_READS_PER_SECOND = QUOTAS["logs:GetLogEvents"].per_second / 2


def cmd_rehearse(args: argparse.Namespace, train_args: list[str]) -> int:
    from scripts.rehearsal.runner import rehearse

    rehearse(
        args.nodes, args.output, args.job_id, train_args, mode=args.mode,
        preflight=not args.skip_preflight, fresh=args.fresh, quiet=args.quiet,
    )  # fmt: skip
    return 0


def job_inputs(cluster: Cluster, args: argparse.Namespace) -> JobInputs:
    """The job's code snapshot (packed, checked, uploaded once) and its data, checked."""
    from scripts.cluster_lib.job_inputs import prepare

    bucket = cluster.outputs().data_bucket
    return prepare(
        cluster.clients.s3, bucket, code=args.code, script=args.entry, module=args.module,
        data=args.data, out=out,
    )  # fmt: skip


def cmd_precompile(cluster: Cluster, args: argparse.Namespace, train_args: list[str]) -> int:
    inputs = job_inputs(cluster, args)
    result = cluster.precompile(
        args.job_id, train_args, inputs, steps=args.steps, master_port=args.master_port,
        nproc_per_node=args.nproc_per_node,
    )  # fmt: skip
    return report(result, f"precompile of job {args.job_id}")


def cmd_train(cluster: Cluster, args: argparse.Namespace, train_args: list[str]) -> int:
    from scripts.cluster_lib.jobs import Jobs

    job_id = args.resume or args.job_id or datetime.now(UTC).strftime("job-%Y%m%d-%H%M%S")
    if not (args.job_id or args.resume):
        out(f"job ID: {job_id} (resume it with `trainium-cluster train --resume {job_id}`)")
    jobs = Jobs(cluster)
    if not args.resume:
        # A new job's ID must be new: launch.sh refuses one whose directory holds a checkpoint
        # too, but only once the nodes are ready and preflight passed.
        used = jobs.executions.of_job(job_id)
        # A running one: Jobs.start says so ("runs already"), as for a queued one.
        if used is not None and used.get("status") != "RUNNING":
            raise ClusterError(
                f"job {job_id} ran on this cluster before (execution {used['name']}, started "
                f"{used['startDate']:%Y-%m-%d %H:%M} UTC): resume it with `trainium-cluster "
                f"train --resume {job_id}`, or choose another --job-id"
            )
    poll = jobs.poll_seconds(args.check_every)
    inputs = job_inputs(cluster, args)
    execution = jobs.start(
        job_id, train_args, inputs, master_port=args.master_port,
        nproc_per_node=args.nproc_per_node,
        max_retries=args.max_retries, retry_delay=args.retry_delay,
        options={
            "PollSeconds": poll,
            "FailureGraceSeconds": args.failure_grace,
            "HangSeconds": 60 * args.hang_minutes,
            "CompileHangSeconds": 60 * args.compile_hang_minutes,
            "NoRetryStatuses": no_retry_statuses(args.no_retry_on, args.retry_on),
            "Resume": "resume" if args.resume else "new",
        },
    )  # fmt: skip
    jobs.run(execution, job_id, detach=args.detach, stream=not args.quiet)
    return 0


def cmd_jobs(cluster: Cluster, args: argparse.Namespace) -> int:
    from scripts.cluster_lib.jobs import Jobs, rows_text

    jobs = Jobs(cluster)
    rows = jobs.queued_rows() + jobs.rows(limit=args.limit)
    if not rows:
        out("no jobs yet: start one with `cluster.py train`")
    for line in rows_text(rows) if rows else []:
        out(line)
    warning = jobs.idle_warning(rows)
    if warning:
        out(warning)
    return 0


def cmd_stop(cluster: Cluster, args: argparse.Namespace) -> int:
    from scripts.cluster_lib.jobs import Jobs

    # The execution first, so that its supervisor does not retry what the nodes then end.
    jobs = Jobs(cluster)
    stopped = jobs.stop(args.job_id)
    if not stopped:
        if jobs.queue.remove(args.job_id):
            out(f"job {args.job_id}: taken off the queue; it never ran")
            return 0
        # Not queued (any more): the dispatcher may just have started it.
        stopped = jobs.stop(args.job_id)
    if not stopped and not cluster.history.active_commands(job_id=args.job_id):
        # StopTraining for a job ID that nothing runs would end nothing on the nodes and
        # report success on every one of them (stop.sh finds no process of it).
        jobs.refuse_unknown(args.job_id)
    return report(cluster.stop(args.job_id), f"stop of job {args.job_id}")


def cmd_shell(cluster: Cluster, args: argparse.Namespace) -> int:
    from scripts.cluster_lib.session import open_shell

    return open_shell(cluster, args.node, args.profile)


def cmd_export(cluster: Cluster, args: argparse.Namespace) -> int:
    task = cluster.export(timeout=args.timeout)
    out(
        f"export task {task['TaskId']} succeeded: the files are in S3; the storage stack can "
        "be destroyed"
    )
    return 0


def dispatch(
    args: argparse.Namespace, train_args: list[str], session: Session | None = None
) -> int:
    if args.command == "rehearse":
        return cmd_rehearse(args, train_args)
    cluster = make_cluster(args, session)
    handlers = {
        "status": lambda: cmd_status(cluster),
        "preflight": lambda: report(cluster.preflight(port=args.port), "preflight"),
        "precompile": lambda: cmd_precompile(cluster, args, train_args),
        "train": lambda: cmd_train(cluster, args, train_args),
        "jobs": lambda: cmd_jobs(cluster, args),
        "stop": lambda: cmd_stop(cluster, args),
        "logs": lambda: cmd_logs(cluster, args),
        "shell": lambda: cmd_shell(cluster, args),
        "roll": lambda: (cluster.roll(force=args.force, wait=args.wait), 0)[1],
        "export": lambda: cmd_export(cluster, args),
        "deploy": lambda: cmd_deploy(cluster, args),
    }
    return handlers[args.command]()


def main(argv: list[str] | None = None, *, session: Session | None = None) -> int:
    """The CLI; `session` (a boto3 Session) serves every AWS call instead of the default one."""
    argv = sys.argv[1:] if argv is None else argv
    options, train_args = split_train_args(argv)
    try:
        args = build_parser().parse_args(options)
        validate(args, train_args)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    try:
        return dispatch(args, train_args, session)
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
