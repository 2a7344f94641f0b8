"""What the operator CLI checks in its arguments before any AWS call.

Bad input fails at once, in one line with exit status 2, instead of on the nodes or after
waiting for them: the cluster name and job ID (the config's and the SSM documents' rules),
ports, numbers, and the train.py arguments, which SSM passes to the nodes as one
space-separated string.
"""

from __future__ import annotations

import argparse
import math
import re

#: The config's rule for cluster_name (stacks/config.py) and the SSM documents' JobId rule.
CLUSTER_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,23}")
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
COMMAND_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
TRAIN_ARG = re.compile(r"[A-Za-z0-9._,=:/+-]+")
#: The TrainArgs parameter's length limit. SSM's agent checks allowedPattern with Go's regexp,
#: which refuses repeat counts above 1000, so the documents cannot enforce it: the CLI does.
MAX_TRAIN_ARGS = 2048
#: train.py flags the node scripts set themselves: launch.sh passes `--output
#: <jobs-root>/<job-id>` (and refuses it in the arguments), precompile.sh appends
#: `--max-steps <steps>`; `--help` would end every rank at once with status 0.
RESERVED_TRAIN_FLAGS = {"--output": "the job writes to /fsx/jobs/<job-id> (set --job-id)"}
RESERVED_PRECOMPILE_FLAGS = {
    **RESERVED_TRAIN_FLAGS,
    "--max-steps": "precompile traces --steps steps (set --steps)",
}
HELP_FLAGS = {"-h", "--help"}
#: An entry point: a Python module (dotted identifiers), or a script's path inside the code
#: snapshot (relative, no `..`, no hidden folders, ending in .py): the EntryPoint parameter's
#: rule in stacks/ssm_documents/RunTraining.yaml, checked here first.
MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*([.][A-Za-z_][A-Za-z0-9_]*)*")
SCRIPT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(/[A-Za-z0-9_][A-Za-z0-9_.-]*)*[.]py")
MAX_ENTRY = 256
#: A path on the cluster's file system (the DataPath parameter's rule).
FSX_PATH = re.compile(r"/fsx(/[A-Za-z0-9_][A-Za-z0-9._=+-]*)*")
S3_URI = re.compile(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(/(.*))?")


class UsageError(Exception):
    """Bad command-line input: one line, exit status 2, before any AWS call."""


def check_port(flag: str, value: str) -> None:
    """A TCP port that leaves port + 1 free: launch.sh and preflight.sh put the Neuron root
    communicator (NEURON_RT_ROOT_COMM_ID) on the next port."""
    if not re.fullmatch(r"[1-9][0-9]{0,4}", value) or int(value) > 65534:
        raise UsageError(
            f"{flag} {value!r} is not allowed: use a TCP port from 1 to 65534 (the next port "
            "is the Neuron root communicator's)"
        )


def check_number(flag: str, value: float, *, low: float, strict: bool = False) -> None:
    if not math.isfinite(value) or value < low or (strict and value == low):
        bound = f"more than {low:g}" if strict else f"{low:g} or more"
        raise UsageError(f"{flag} {value:g} is not allowed: use {bound}")


def check_train_args(args: list[str], reserved: dict[str, str]) -> None:
    for arg in args:
        if not TRAIN_ARG.fullmatch(arg):
            raise UsageError(
                f"train argument {arg!r} is not allowed: use letters, digits and . _ , = : / + - "
                "only (SSM passes the arguments as one space-separated string, no quotes)"
            )
        flag = arg.split("=", 1)[0]
        if flag in reserved:
            raise UsageError(f"train argument {flag} is set by the node scripts: {reserved[flag]}")
        if arg in HELP_FLAGS:
            raise UsageError(
                f"train argument {arg} would only print train.py's help on every node: run "
                "`python workload/train.py --help` here"
            )
    joined = " ".join(args)
    if len(joined) > MAX_TRAIN_ARGS:
        raise UsageError(
            f"the train arguments are {len(joined)} characters long: at most "
            f"{MAX_TRAIN_ARGS} fit the SSM parameter"
        )


def check_entry(script: str | None, module: str | None) -> None:
    """`--entry SCRIPT` or `--module MODULE`: their form (whether the script is in the
    snapshot is `entry_point`'s check, once the directory is packed)."""
    if script is not None and module is not None:
        raise UsageError("give --entry SCRIPT or --module MODULE, not both")
    if module is not None and (len(module) > MAX_ENTRY or not MODULE.fullmatch(module)):
        raise UsageError(
            f"--module {module!r} is not allowed: use a Python module name (dotted "
            "identifiers, e.g. mypackage.train)"
        )
    if script is not None and (len(script) > MAX_ENTRY or not SCRIPT.fullmatch(script)):
        raise UsageError(
            f"--entry {script!r} is not allowed: use the path of a .py file inside the code "
            "directory, relative to it (letters, digits, '_', '-', '.' and '/', no '..' and "
            "no hidden folders; e.g. train.py or src/train.py)"
        )


def entry_point(script: str | None, module: str | None, names: tuple[str, ...]) -> str:
    """The EntryPoint parameter: `-m MODULE`, or the script, which must be in the snapshot
    (`names`: its files); by default the reference trainer, `-m workload.train`."""
    if module is not None:
        return f"-m {module}"
    if script is None:
        if "workload/train.py" not in names:
            raise UsageError(
                "the code snapshot has no workload/train.py, the default entry point "
                "(-m workload.train): name yours with --entry SCRIPT or --module MODULE"
            )
        return "-m workload.train"
    if script not in names:
        raise UsageError(
            f"--entry {script} is not in the code snapshot: its files include "
            f"{', '.join(n for n in names if n.endswith('.py'))[:300] or 'no .py file'} "
            "(paths relative to --code; what .gitignore ignores is left out)"
        )
    return script


def check_data(value: str | None) -> None:
    """`--data s3://<bucket>/<prefix>` or `--data /fsx/...`; the bucket is checked against
    the cluster's data bucket once its outputs are read."""
    if value is None:
        return
    if value.startswith("s3://"):
        if not S3_URI.fullmatch(value):
            raise UsageError(f"--data {value!r} is not an S3 URI: use s3://<bucket>/<prefix>")
        return
    if len(value) > 1024 or not FSX_PATH.fullmatch(value.rstrip("/") or "/"):
        raise UsageError(
            f"--data {value!r} is not allowed: use s3://<the cluster's data bucket>/<prefix> "
            "or a path under /fsx (letters, digits and . _ = + - in its names)"
        )


#: The trainer's status for its own bad input (argparse's), which the supervisor does not retry
#: unless told to (stacks/supervisor_run.py INPUT_ERROR_STATUS, the job's NoRetryStatuses).
INPUT_ERROR_STATUS = 2
#: launch.sh's leg end: never a trainer's status (launch.sh reports a trainer's 75 as 1).
LEG_END_STATUS = 75


def statuses(flag: str, value: str) -> set[int]:
    """A comma-separated list of exit statuses a trainer can report through launch.sh: 1 to
    127 but 75 (launch.sh passes a trainer's status on only then: report_exit_status in
    scripts/node/lib.sh; above 127 the status is a signal's or one the SSM agent reads)."""
    found: set[int] = set()
    for item in filter(None, value.split(",")):
        if not re.fullmatch(r"[1-9][0-9]{0,2}", item) or int(item) > 127:
            raise UsageError(
                f"{flag} {value!r} is not allowed: give exit statuses from 1 to 127, comma "
                "separated (launch.sh reports any higher status as 1)"
            )
        if int(item) == LEG_END_STATUS:
            raise UsageError(
                f"{flag} names 75, the status launch.sh reports when a leg ends at its time "
                "limit (the next leg resumes): a trainer's own 75 is reported as 1"
            )
        found.add(int(item))
    return found


def no_retry_statuses(no_retry_on: str, retry_on: str) -> list[int]:
    """The job's NoRetryStatuses: 2 (an input error) and those of --no-retry-on, less those of
    --retry-on."""
    never, again = statuses("--no-retry-on", no_retry_on), statuses("--retry-on", retry_on)
    both = sorted(never & again)
    if both:
        raise UsageError(
            f"--no-retry-on and --retry-on both name {', '.join(map(str, both))}: name a status "
            "in one of them"
        )
    return sorted(({INPUT_ERROR_STATUS} | never) - again)


def check_job_id(value: str | None, flag: str = "--job-id") -> None:
    if value is not None and not JOB_ID.fullmatch(value):
        raise UsageError(
            f"{flag} {value!r} is not allowed: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )


def validate(args: argparse.Namespace, train_args: list[str]) -> None:
    """Checks everything that can be checked without AWS, so that bad input fails at once
    instead of on the nodes or after waiting for them."""
    if not CLUSTER_NAME.fullmatch(args.cluster_name):
        raise UsageError(
            f"--cluster-name {args.cluster_name!r} is not allowed: use 1-24 lowercase letters, "
            "digits and '-'"
        )
    check_number("--poll-interval", args.poll_interval, low=0, strict=True)
    check_number("--wait-timeout", args.wait_timeout, low=0)
    check_number("--give-up-after", args.give_up_after, low=0)
    command = args.command
    if train_args and command not in ("train", "precompile", "rehearse"):
        raise UsageError(f"{command} takes no train.py arguments after --")
    if command in ("train", "precompile", "stop"):
        check_job_id(args.job_id)
    if command == "train":
        check_job_id(args.resume, "--resume")
        if args.resume and args.job_id:
            raise UsageError(
                "give --job-id ID for a new job or --resume ID to resume one, not both"
            )
    if command in ("train", "precompile"):
        check_port("--master-port", args.master_port)
        if not re.fullmatch(r"auto|[1-9][0-9]{0,2}", args.nproc_per_node):
            raise UsageError(
                f"--nproc-per-node {args.nproc_per_node!r} is not allowed: use 'auto' (one "
                "process per NeuronCore) or a number from 1 to 999"
            )
        reserved = RESERVED_PRECOMPILE_FLAGS if command == "precompile" else RESERVED_TRAIN_FLAGS
        check_train_args(train_args, reserved)
        check_entry(args.entry, args.module)
        check_data(args.data)
    if command == "precompile" and not re.fullmatch(r"[1-9][0-9]{0,3}", args.steps):
        raise UsageError(f"--steps {args.steps!r} is not allowed: use 1 to 9999")
    if command == "train":
        if args.max_retries < 0:
            raise UsageError(f"--max-retries {args.max_retries} is not allowed: use 0 or more")
        check_number("--retry-delay", args.retry_delay, low=0)
        if args.retry_delay > 31_536_000:
            raise UsageError(
                f"--retry-delay {args.retry_delay:g} is not allowed: use at most 31536000 "
                "(a Step Functions Wait state waits at most a year)"
            )
        if args.check_every is not None and not 1 <= args.check_every <= 3600:
            raise UsageError(f"--check-every {args.check_every} is not allowed: use 1 to 3600")
        if not 0 <= args.failure_grace <= 86400:
            raise UsageError(f"--failure-grace {args.failure_grace} is not allowed: use 0 to 86400")
        for flag, minutes in (
            ("--hang-minutes", args.hang_minutes),
            ("--compile-hang-minutes", args.compile_hang_minutes),
        ):
            if not 1 <= minutes <= 2880:
                raise UsageError(
                    f"{flag} {minutes} is not allowed: use 1 to 2880 (a leg lasts 48 hours)"
                )
        no_retry_statuses(args.no_retry_on, args.retry_on)
    if command == "jobs" and not 1 <= args.limit <= 1000:
        raise UsageError(f"--limit {args.limit} is not allowed: use 1 to 1000")
    if command == "preflight":
        check_port("--port", args.port)
    if command == "logs":
        if (args.job_id is None) == (args.command_id is None):
            raise UsageError("logs needs exactly one of --job-id or --command-id")
        check_job_id(args.job_id)
        if args.command_id is not None and not COMMAND_ID.fullmatch(args.command_id):
            raise UsageError(
                f"--command-id {args.command_id!r} is not an SSM command ID (a UUID such as "
                "0b6f0d1a-2c3d-4e5f-8a9b-0c1d2e3f4a5b)"
            )
        if not 1 <= args.lines <= 10000:
            raise UsageError(f"--lines {args.lines} is not allowed: use 1 to 10000")
    if command == "export":
        check_number("--timeout", args.timeout, low=0, strict=True)
