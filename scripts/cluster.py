#!/usr/bin/env python3
"""Operate a deployed Trainium cluster, or rehearse one locally.

    python scripts/cluster.py status
    python scripts/cluster.py preflight
    python scripts/cluster.py precompile --job-id ID [--steps 10] -- <train.py args>
    python scripts/cluster.py train --job-id ID [--max-retries N] -- <train.py args>
    python scripts/cluster.py stop --job-id ID
    python scripts/cluster.py logs --job-id ID [--node RANK|ADDRESS|INSTANCE] [--follow]
    python scripts/cluster.py rehearse --nodes 2 [--output build/rehearsal] [-- <train.py args>]

The AWS commands find the cluster through its operations stack (`<cluster>-operations`),
its nodes by their tags, and drive them with the stack's SSM documents. `rehearse` needs no
AWS: it runs the same node scripts on local network namespaces (or loopback addresses).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.cluster_lib import ClusterError

DEFAULT_CLUSTER = os.environ.get("TRAINIUM_CLUSTER_NAME", "trainium")


def split_train_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Splits the command line at the first `--`: CLI options before, train.py's after."""
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], argv[index + 1 :]
    return argv, []


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cluster.py",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Arguments after `--` go to workload/train.py unchanged.",
    )
    # The global options work before or after the command name.
    common = argparse.ArgumentParser(add_help=False)
    for target, default in ((parser, None), (common, argparse.SUPPRESS)):
        target.add_argument(
            "--cluster-name", default=default or DEFAULT_CLUSTER, help="default: trainium"
        )
        target.add_argument(
            "--region", default=default, help="AWS region (default: the profile's or AWS_REGION)"
        )
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
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser(
        "status", parents=[common], help="stack, nodes (with SSM status) and recent commands"
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

    precompile = sub.add_parser(
        "precompile", parents=[common], help="fill the compile cache for a job"
    )
    job_options(precompile, required=True)
    precompile.add_argument("--steps", default="10", help="steps to trace (default: 10)")

    train = sub.add_parser("train", parents=[common], help="run (or resume) a job on all nodes")
    job_options(train, required=False)
    train.add_argument(
        "--max-retries", type=int, default=0,
        help="relaunch the job after a failure up to N times; it resumes from its checkpoint",
    )  # fmt: skip
    train.add_argument("--retry-delay", type=float, default=60, help="seconds before a retry")
    train.add_argument("--skip-preflight", action="store_true", help="do not run preflight first")
    train.add_argument(
        "--replace-unhealthy", action="store_true",
        help="mark nodes with Neuron hardware errors unhealthy (the group replaces them)",
    )  # fmt: skip
    train.add_argument(
        "--detach", action="store_true", help="send the job and return without following it"
    )
    train.add_argument("--quiet", action="store_true", help="do not print the master node's output")

    stop = sub.add_parser(
        "stop", parents=[common], help="stop a job on all nodes (its checkpoints stay)"
    )
    stop.add_argument("--job-id", required=True)

    logs = sub.add_parser(
        "logs", parents=[common], help="print a job's output from CloudWatch Logs"
    )
    logs.add_argument("--job-id", help="the latest RunTraining command of this job")
    logs.add_argument("--command-id", help="a command ID printed by train/preflight/...")
    logs.add_argument("--node", help="rank, address or instance ID (default: every node)")
    logs.add_argument("--lines", type=int, default=100, help="last N lines (default: 100)")
    logs.add_argument("--follow", action="store_true", help="keep printing new output")

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


def out(message: str) -> None:
    print(message, flush=True)


def make_cluster(args: argparse.Namespace) -> Any:
    import boto3
    from botocore.exceptions import ProfileNotFound

    from scripts.cluster_lib.aws import Clients, Cluster

    try:
        session = boto3.Session(profile_name=args.profile, region_name=args.region)
    except ProfileNotFound:
        raise ClusterError(f"AWS profile {args.profile!r} not found in the AWS config") from None
    return Cluster(
        Clients.from_session(session),
        args.cluster_name,
        out=out,
        poll_interval=args.poll_interval,
        wait_timeout=args.wait_timeout,
    )


def cmd_status(cluster: Any) -> int:
    outputs = cluster.outputs()
    out(
        f"cluster {outputs['ClusterName']} (stack {outputs.stack_name}): "
        f"{outputs['NodeCount']} x {outputs['InstanceType']}"
    )
    nodes, starting = cluster.running_nodes()
    status = cluster.ssm_status(nodes)
    out(f"nodes: {len(nodes)} running of {outputs['NodeCount']}, {starting} starting")
    for rank, node in enumerate(nodes):
        launched = node.launch_time.strftime("%Y-%m-%d %H:%M") if node.launch_time else "-"
        out(
            f"  {rank:>3}  {node.instance_id:<20} {node.address:<15} {node.zone:<12} "
            f"ssm {status.get(node.instance_id, 'not registered'):<15} launched {launched}"
        )
    commands = cluster.recent_commands()
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
    return 0


def report(result: Any, what: str) -> int:
    if not result.ok:
        raise ClusterError(result.summary())
    out(f"{what} succeeded on all {len(result.invocations)} nodes")
    return 0


def cmd_logs(cluster: Any, args: argparse.Namespace) -> int:
    from scripts.cluster_lib.aws import aws_errors

    if bool(args.job_id) == bool(args.command_id):
        raise ClusterError("logs needs exactly one of --job-id or --command-id")
    command_id = args.command_id or cluster.latest_command(args.job_id)["CommandId"]
    log_group = cluster.outputs()["TrainingLogGroupName"]
    nodes, _ = cluster.running_nodes()
    prefix = f"{command_id}/"
    if args.node is not None:
        match = [
            n for rank, n in enumerate(nodes) if args.node in (str(rank), n.address, n.instance_id)
        ]
        if not match and not args.node.startswith("i-"):
            raise ClusterError(
                f"--node {args.node!r} matches no running node (rank, address or ID)"
            )
        prefix += f"{match[0].instance_id if match else args.node}/"
    tokens: dict[str, str] = {}
    first = True
    while True:
        with aws_errors("reading the command output"):
            streams = cluster.clients.logs.describe_log_streams(
                logGroupName=log_group, logStreamNamePrefix=prefix
            )["logStreams"]
            if first and not streams:
                raise ClusterError(
                    f"no output in log group {log_group} for command {command_id} yet"
                )
            for stream in sorted(streams, key=lambda s: s["logStreamName"]):
                name = stream["logStreamName"]
                kwargs: dict[str, Any] = {"logGroupName": log_group, "logStreamName": name}
                if name in tokens:
                    kwargs.update(nextToken=tokens[name], startFromHead=True)
                else:
                    kwargs.update(startFromHead=False, limit=args.lines)
                response = cluster.clients.logs.get_log_events(**kwargs)
                for event in response["events"]:
                    stamp = datetime.fromtimestamp(event["timestamp"] / 1000, UTC)
                    for line in event["message"].rstrip("\n").splitlines():
                        out(f"{name.split('/')[1]} {stamp:%H:%M:%S} {line}")
                tokens[name] = response["nextForwardToken"]
        first = False
        if not args.follow:
            return 0
        time.sleep(args.poll_interval)


def cmd_rehearse(args: argparse.Namespace, train_args: list[str]) -> int:
    from scripts.cluster_lib.rehearsal import rehearse

    rehearse(
        args.nodes, args.output, args.job_id, train_args, mode=args.mode,
        preflight=not args.skip_preflight, fresh=args.fresh, quiet=args.quiet,
    )  # fmt: skip
    return 0


def cmd_precompile(cluster: Any, args: argparse.Namespace, train_args: list[str]) -> int:
    result = cluster.precompile(
        args.job_id, train_args, steps=args.steps, master_port=args.master_port,
        nproc_per_node=args.nproc_per_node,
    )  # fmt: skip
    return report(result, f"precompile of job {args.job_id}")


def cmd_train(cluster: Any, args: argparse.Namespace, train_args: list[str]) -> int:
    if args.max_retries < 0:
        raise ClusterError(f"--max-retries {args.max_retries} is not allowed: use 0 or more")
    job_id = args.job_id or datetime.now(UTC).strftime("job-%Y%m%d-%H%M%S")
    if not args.job_id:
        out(f"job ID: {job_id} (train again with --job-id {job_id} to resume it)")
    result = cluster.train(
        job_id, train_args, master_port=args.master_port,
        nproc_per_node=args.nproc_per_node, max_retries=args.max_retries,
        retry_delay=args.retry_delay, skip_preflight=args.skip_preflight,
        replace_unhealthy=args.replace_unhealthy, detach=args.detach, stream=not args.quiet,
    )  # fmt: skip
    if isinstance(result, str):
        out(f"job {job_id} sent as command {result}; follow it with")
        out(f"  python scripts/cluster.py logs --job-id {job_id} --follow")
    return 0


def dispatch(args: argparse.Namespace, train_args: list[str]) -> int:
    if args.command == "rehearse":
        return cmd_rehearse(args, train_args)
    cluster = make_cluster(args)
    handlers = {
        "status": lambda: cmd_status(cluster),
        "preflight": lambda: report(cluster.preflight(port=args.port), "preflight"),
        "precompile": lambda: cmd_precompile(cluster, args, train_args),
        "train": lambda: cmd_train(cluster, args, train_args),
        "stop": lambda: report(cluster.stop(args.job_id), f"stop of job {args.job_id}"),
        "logs": lambda: cmd_logs(cluster, args),
    }
    return handlers[args.command]()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options, train_args = split_train_args(argv)
    parser = build_parser()
    args = parser.parse_args(options)
    if train_args and args.command not in ("train", "precompile", "rehearse"):
        parser.error(f"{args.command} takes no train.py arguments after --")
    try:
        return dispatch(args, train_args)
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
