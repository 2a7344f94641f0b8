"""The local multi-host rehearsal: scripts/node/launch.sh on separate hosts, a real
multi-node torchrun job (gloo on the CPU), a node that dies mid-run, and the resume.

Two Linux network namespaces joined by a bridge (created and removed here, loopback-only
traffic) play two cluster nodes; each runs launch.sh exactly as the RunTraining document
does. `cluster.py rehearse` offers the same to users.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from scripts.cluster import main as cluster_main
from scripts.cluster_lib import ClusterError
from scripts.rehearsal.aws_stand_in import local_cloud
from scripts.rehearsal.direct import Rehearsal, RunningCommand
from scripts.rehearsal.hosts import NetnsHosts, job_processes
from tests.node_support import unique_job_id
from workload.stop import HOLD_VARIABLE

REPO_ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = re.compile(r"^step_(\d{8})$")

# A tiny model, short sequences, small data: each step takes a fraction of a second on
# two busy cores, and the whole module a few minutes.
TINY = [
    "--model",
    "tiny",
    "--device",
    "cpu",
    "--batch-size",
    "8",
    "--max-length",
    "32",
    "--seed",
    "0",
]


def train_args(data: Path, *extra: str) -> list[str]:
    return ["--data", str(data), *TINY, *extra]


def namespaced_hosts(count: int) -> NetnsHosts:
    """Network namespaces for the nodes, or a skip where this machine cannot make them."""
    if not NetnsHosts.available():
        pytest.skip("needs root and iproute2")
    try:
        return NetnsHosts(count)
    except ClusterError as error:  # e.g. a container without CAP_SYS_ADMIN
        pytest.skip(str(error))


def tails(running: RunningCommand) -> str:
    return "\n".join(f"--- node {n.index} ---\n{n.tail}" for n in running.nodes)


def checkpoints(job_dir: Path) -> list[int]:
    folder = job_dir / "checkpoints"
    if not folder.is_dir():
        return []
    steps = [int(m.group(1)) for p in folder.iterdir() if (m := CHECKPOINT.match(p.name))]
    return sorted(steps)


def with_sample_data(output: Path, sample_data: Path) -> Path:
    """An output folder whose data/ holds the module's sample data set."""
    (output / "data").mkdir(parents=True)
    for path in sample_data.iterdir():
        (output / "data" / path.name).write_bytes(path.read_bytes())
    return output


def events(rehearsal: Rehearsal, job_id: str, kind: str) -> list[dict[str, Any]]:
    return [r for r in rehearsal.metrics(job_id) if r.get("event") == kind]


LISTEN = """
import socket, sys
server = socket.create_server((sys.argv[1], 5000))
print("listening", flush=True)
connection, (peer, _) = server.accept()
connection.sendall(f"hello from {peer}".encode())
"""
CONNECT = """
import socket, sys
print(socket.create_connection((sys.argv[1], 5000), timeout=30).recv(100).decode())
"""


@pytest.fixture(scope="module")
def sample_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data = tmp_path_factory.mktemp("data")
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "make_sample_data.py"), "--output", str(data),
         "--train-size", "256", "--test-size", "64", "--seed", "0"],
        check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return data


@pytest.mark.netns
def test_namespaces_are_created_and_removed() -> None:
    with namespaced_hosts(3) as hosts:
        names = [*hosts.namespaces, hosts.switch]
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
        assert all(name in listed.stdout for name in names)
        # Each node sees only its own address and reaches the others over the bridge.
        server = subprocess.Popen(
            hosts.command(2, [sys.executable, "-c", LISTEN, hosts.addresses[2]]),
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert server.stdout is not None and server.stdout.readline() == "listening\n"
            client = subprocess.run(
                hosts.command(0, [sys.executable, "-c", CONNECT, hosts.addresses[2]]),
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
            assert client.stdout.strip() == "hello from 10.77.0.1", client.stderr
        finally:
            server.kill()
            server.wait()
        addresses = subprocess.run(
            hosts.command(1, ["ip", "-o", "-4", "addr", "show"]), capture_output=True, text=True,
            check=True,
        ).stdout  # fmt: skip
        assert "10.77.0.2/24" in addresses
        assert "10.77.0.1/" not in addresses
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert not any(name in listed.stdout for name in names)


def stand_in(tmp_path: Path, **options: Any) -> Any:
    """Two rehearsal nodes behind the local Run Command stand-in, or a skip where this
    machine cannot make namespaces."""
    if not NetnsHosts.available():
        pytest.skip("needs root and iproute2")
    try:
        return local_cloud(2, tmp_path, **options)
    except ClusterError as error:
        pytest.skip(str(error))


def gone(job: str, timeout: float = 60) -> bool:
    """No process of the job is left (the leg's watchdog polls every second; the bound only
    keeps a broken run from hanging)."""
    deadline = time.monotonic() + timeout
    while job_processes(job):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def job_metrics(output: Path, job_id: str, kind: str) -> list[dict[str, Any]]:
    path = output / "jobs" / job_id / "metrics.jsonl"
    records = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return [r for r in records if r.get("event") == kind]


#: Holds the trainers after step 5 until a stop is requested (workload/stop.py), so that a
#: test cancels a node, refuses a second job or stops the job at a step it knows, however fast
#: or slow this machine trains. Resumed runs start at step 5 and do not hold again.
HOLD_AT_5 = {HOLD_VARIABLE: "5"}


def held(output: Path, job: str, step: int, timeout: float, context: Any) -> None:
    """Wait until the job's trainers hold after `step` (rank 0's `hold` line)."""
    wait_for(
        f"the trainers holding after step {step}",
        lambda: job_metrics(output, job, "hold"),
        timeout,
        context,
    )
    assert [h["step"] for h in job_metrics(output, job, "hold")] == [step]


def _proc(pid: int, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_text(errors="replace")
    except OSError:
        return ""


def launchers(job: str) -> list[int]:
    """launch.sh of every node running the job: the parent of the node's torchrun (launch.sh
    starts it as `"${command[@]}" &`)."""
    found = []
    for pid in job_processes(job):
        argv = _proc(pid, "cmdline").split("\0")
        if any(arg.rsplit("/", 1)[-1] == "torchrun" for arg in argv[:2]):
            parent = re.search(r"^PPid:\s+(\d+)$", _proc(pid, "status"), re.M)
            if parent is not None:
                found.append(int(parent.group(1)))
    return sorted(found)


#: What launch.sh logs once its USR1 trap (end_leg) is set. /proc/<pid>/status cannot tell:
#: bash catches USR1 (SigCgt) as soon as an EXIT trap is set (lib.sh sets one), to run that trap
#: on the way out, and a USR1 before end_leg's trap ends launch.sh.
LEG_TIMER_SET = "leg timer set: the trainers are asked to save and exit in"


def end_legs(job: str, logs: Path, nodes: int, timeout: float = 120) -> None:
    """End the job's leg on every node the way its leg timer does at the time limit: the timer
    is a subshell of launch.sh that runs `kill -USR1 $$`, and launch.sh's USR1 trap (end_leg)
    asks the trainers to checkpoint and exit, then exits 75. The test sends that USR1 itself,
    when it chooses, instead of waiting for a time limit that a fast machine outruns, once
    every node's log (`logs`, the job's logs folder) says that launch.sh set its trap."""

    def armed() -> bool:
        texts = [path.read_text(errors="replace") for path in logs.glob("node-*.log")]
        return len(texts) == nodes and all(LEG_TIMER_SET in text for text in texts)

    wait_for(f"launch.sh of job {job} on {nodes} nodes with its leg timer set", armed,
             timeout, lambda: sorted(path.name for path in logs.glob("node-*.log")))  # fmt: skip
    ready = launchers(job)
    assert len(ready) == nodes, ready
    for pid in ready:
        assert "launch.sh" in _proc(pid, "cmdline"), _proc(pid, "cmdline")
        os.kill(pid, signal.SIGUSR1)


class Cli(threading.Thread):
    """`cluster.py <argv>` (its main, in this process) against the stand-in."""

    def __init__(self, cloud: Any, *argv: str) -> None:
        super().__init__(daemon=True)
        self.argv = ["--cluster-name", cloud.cluster_name, "--poll-interval", "0.5", *argv]
        self.session = cloud.session()
        self.code: int | None = None

    def run(self) -> None:
        command, *rest = self.argv[4:]
        self.code = cluster_main([command, *self.argv[:4], *rest], session=self.session)


@pytest.fixture(scope="module")
def operations() -> tuple[str, dict[str, Any]]:
    """The default cluster's name and its synthesized operations template (the supervisor)."""
    from tests.cdk_support import synth

    default = synth()
    return default.config.cluster_name, default.templates["operations"]


@pytest.fixture
def short_legs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`train --check-every 1` for the stand-in's jobs of a few minutes: the CLI allows a
    poll that short only for legs of at most 5 minutes (stacks/supervisor_limits.py; moto's
    interpreter has no history quota, AWS has), so the leg length it assumes is made 5
    minutes here."""
    from stacks import supervisor_limits

    monkeypatch.setattr(supervisor_limits, "LEG_SECONDS", 300)


def execution_status(cloud: Any, job: str) -> list[str]:
    """The statuses of the job's executions, newest first."""
    from scripts.cluster_lib.executions import job_of

    client = cloud.client("stepfunctions")
    arn = cloud.stack_outputs()["JobStateMachineArn"]
    return [
        e["status"]
        for e in client.list_executions(stateMachineArn=arn)["executions"]
        if job_of(e["name"]) == job
    ]


def wait_for(what: str, condition: Any, timeout: float, output: Any) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s\n{output()}"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.usefixtures("short_legs")
def test_stop_ends_the_supervisor_and_every_process_and_logs_follow_ends(
    tmp_path: Path,
    sample_data: Path,
    operations: tuple[str, dict[str, Any]],
    capfd: pytest.CaptureFixture[str],
) -> None:
    """`train --detach`, then a second job (queued behind the first, then taken off the queue
    with `stop`), `logs --follow` and `stop` as an operator types them: stop ends the job's
    execution (no retry follows) and every process of the job on every node; the follower
    ends with the command."""
    from scripts.rehearsal.supervisor import local_supervisor

    cluster_name, template = operations
    job = unique_job_id("stopme")
    args = train_args(sample_data, "--max-steps", "5000", "--checkpoint-every", "5",
                      "--eval-every", "5000", "--log-every", "5")  # fmt: skip
    from moto.stepfunctions.parser.utils import TMP_THREADS

    earlier = set(TMP_THREADS)  # the interpreter's threads: executions, Map iterations
    with (
        stand_in(tmp_path, cluster_name=cluster_name, node_settings=HOLD_AT_5) as cloud,
        local_supervisor(cloud, template),
    ):
        train = Cli(cloud, "train", "--job-id", job, "--max-retries", "2", "--retry-delay", "1",
                    "--check-every", "1", "--detach", "--", *args)  # fmt: skip
        train.run()
        assert train.code == 0, capfd.readouterr()
        held(tmp_path, job, 5, 400, capfd.readouterr)

        second = Cli(cloud, "train", "--job-id", "second", "--detach", "--", *args)
        second.run()
        captured = capfd.readouterr()
        assert second.code == 0, captured.err
        assert "job second: queued;" in captured.out, captured.out
        unqueue = Cli(cloud, "stop", "--job-id", "second")
        unqueue.run()
        captured = capfd.readouterr()
        assert unqueue.code == 0, captured.err
        assert "job second: taken off the queue; it never ran" in captured.out

        follow = Cli(cloud, "logs", "--job-id", job, "--follow")
        follow.start()
        stop = Cli(cloud, "stop", "--job-id", job)
        stop.run()
        assert stop.code == 0, capfd.readouterr()
        follow.join(timeout=120)
        captured = capfd.readouterr()
        assert not follow.is_alive(), "logs --follow did not end with the command"
        assert follow.code == 0, captured.err
        assert f"job {job}: stopped execution {job}-" in captured.out
        assert "[launch " in captured.out  # logs printed the nodes' launch.sh output
        client = cloud.client("stepfunctions")
        machine = cloud.stack_outputs()["JobStateMachineArn"]
        (execution,) = client.list_executions(stateMachineArn=machine)["executions"]
        described = client.describe_execution(executionArn=execution["executionArn"])
        # AWS ends a stopped execution ABORTED at once (StopExecution, Step Functions API
        # reference). moto 5.2.5's interpreter, stopped while the execution is inside a Map
        # iteration (RunTrainingBatches, where a job spends its time), fails that iteration's
        # frame with an AttributeError instead (its Environment.set_stop on inner frames), so
        # the execution reads FAILED/States.Runtime here. Either way it ended when `stop` ran,
        # and no retry follows (checked below).
        assert described["status"] == "ABORTED" or (
            described["status"] == "FAILED"
            and described.get("error") == "States.Runtime"
            and "AttributeError" in described.get("cause", "")
        ), described
        assert gone(job), job_processes(job)
        stops = [c for c in cloud.commands.values() if c.document.endswith("StopTraining")]
        assert [i.status()["status"] for i in stops[0].invocations.values()] == ["Success"] * 2
        # Whatever the stopped supervisor would still do, it has done once every thread of
        # the interpreter has ended: it sent no RunTraining again (no retry).
        wait_for(
            "the interpreter's threads to end",
            lambda: not [t for t in TMP_THREADS if t.is_alive() and t not in earlier],
            120,
            lambda: [t for t in TMP_THREADS if t.is_alive() and t not in earlier],
        )
        legs = [c for c in cloud.commands.values() if c.document.endswith("RunTraining")]
        assert len(legs) == 1
        stopped = job_metrics(tmp_path, job, "summary")
        assert [(s["step"], s["stopped_by_signal"]) for s in stopped] == [(5, True)], stopped
        assert checkpoints(tmp_path / "jobs" / job) == [5]


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.usefixtures("short_legs")
def test_a_fleet_that_runs_different_software_ends_the_job_at_once(
    tmp_path: Path,
    sample_data: Path,
    operations: tuple[str, dict[str, Any]],
    capfd: pytest.CaptureFixture[str],
) -> None:
    """One node booted with other node software (its node.env, as bootstrap writes it): every
    node's preflight finds the fleet mixed and exits 4; the supervisor ends the job without
    spending its retries or sending RunTraining, notifies, and `cluster.py train` (following in
    the foreground) exits 1 with one line saying what to do."""
    cluster_name, template = operations
    job = unique_job_id("mixed")
    args = train_args(sample_data, "--max-steps", "10")
    from scripts.rehearsal.supervisor import local_supervisor

    with stand_in(tmp_path, cluster_name=cluster_name) as cloud, local_supervisor(cloud, template):
        odd = cloud.running()[1]
        node_env = odd.root / "upper" / "etc" / "trainium-cluster" / "node.env"
        node_env.write_text(
            node_env.read_text().replace(cloud.software_version, "0badc0ffee000001")
        )
        # A grace of 5 s: when the two preflights end in different polls, the first one's end
        # starts the grace before the rest is cancelled (300 s by default).
        train = Cli(cloud, "train", "--job-id", job, "--max-retries", "2", "--retry-delay", "1",
                    "--check-every", "1", "--failure-grace", "5", "--", *args)  # fmt: skip
        train.run()
        captured = capfd.readouterr()
        assert train.code == 1, captured.out + captured.err
        (line,) = captured.err.splitlines()
        assert line == (
            f"error: job {job} cannot run: the nodes run different software: roll the fleet "
            "(trainium-cluster roll --wait), then resume the job with trainium-cluster train "
            "--resume <job ID> "
            "(`cluster.py status` shows who runs what)"
        ), line
        assert execution_status(cloud, job) == ["FAILED"]
        (preflight,) = [c for c in cloud.commands.values() if c.document.endswith("Preflight")]
        codes = [i.status()["code"] for i in preflight.invocations.values()]
        assert codes == [4, 4], codes
        assert not [c for c in cloud.commands.values() if c.document.endswith("RunTraining")]
        assert cloud.health_reports == []  # no node is replaced: the fleet is rolled
        subjects = [n["Subject"].split(f"job {job} ", 1)[-1] for n in cloud.notifications]
        assert subjects == ["started", "cannot run"], subjects
        assert preflight.command_id in cloud.notifications[-1]["Message"]
        assert f"`trainium-cluster train --resume {job}`" in cloud.notifications[-1]["Message"]


@pytest.mark.slow
@pytest.mark.netns
def test_cluster_py_rehearse_goes_through_the_run_command_stand_in(
    tmp_path: Path, sample_data: Path
) -> None:
    """`make demo`'s command as root: the CLI's `train` starts the job supervisor's synthesized
    state machine, which sends preflight and RunTraining to the stand-in, which runs the real
    documents on the namespaced nodes."""
    if not NetnsHosts.available():
        pytest.skip("needs root and iproute2")
    output = with_sample_data(tmp_path / "rehearsal", sample_data)
    job = unique_job_id("cli")
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "cluster.py"), "rehearse", "--nodes", "2",
         "--mode", "netns", "--output", str(output), "--job-id", job, "--quiet",
         "--", *TINY, "--max-steps", "4", "--checkpoint-every", "2", "--eval-every", "4"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "behind the local Run Command stand-in, the job supervisor" in result.stdout
    assert f"job {job}: preflight on every node" in result.stdout
    assert f"job {job}: RunTraining on every node" in result.stdout
    assert f"job {job} finished (execution {job}-" in result.stdout
    # The supervisor retries a failed attempt (that is its job), but this 2-node job has no
    # fault: a retry here is an attempt that failed on its own, a defect to find.
    assert "after 0 retries" in result.stdout, "the fault-free job retried: " + " | ".join(
        line for line in result.stdout.splitlines() if "retr" in line
    )
    summary = json.loads(result.stdout.split("summary: ", 1)[1].splitlines()[0])
    assert summary["event"] == "summary"
    assert sorted(p.name for p in (output / "jobs" / job / "logs").iterdir()) == [
        "node-0-10.77.0.1.log", "node-1-10.77.0.2.log",
    ]  # fmt: skip
    # A trn1.32xlarge's TMPDIR is on its instance store (bootstrap's node.env): each node's
    # torchrun, the preflight's and the job's, made its folder in the node's scratch.
    for node in sorted((output / "nodes").iterdir()):
        assert len(list((node / "scratch" / "tmp").glob("torchelastic_*"))) == 2, node


@pytest.mark.slow
def test_cluster_py_rehearse_on_loopback_addresses(tmp_path: Path, sample_data: Path) -> None:
    """The user-facing command, in the mode that needs no privileges."""
    output = with_sample_data(tmp_path / "rehearsal", sample_data)
    job = unique_job_id("cli")
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "cluster.py"), "rehearse", "--nodes", "2",
         "--mode", "loopback", "--output", str(output), "--job-id", job, "--quiet",
         "--skip-preflight",
         "--", *TINY, "--max-steps", "4", "--checkpoint-every", "2", "--eval-every", "4"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # The nodes' addresses: a block of 127.0.0.0/8 of this rehearsal's own (LoopbackHosts).
    found = re.search(r"rehearsal: 2 nodes \(loopback: (127\.\d+\.\d+)\.1, \1\.2\)", result.stdout)
    assert found, result.stdout
    block = found.group(1)
    summary = json.loads(result.stdout.split("summary: ", 1)[1].splitlines()[0])
    assert summary["event"] == "summary"
    metrics = output / "jobs" / job / "metrics.jsonl"
    assert metrics.is_file()
    assert sorted(p.name for p in (output / "jobs" / job / "logs").iterdir()) == [
        f"node-0-{block}.1.log", f"node-1-{block}.2.log",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "0"], "error: --nodes 0 is not allowed: rehearse with 1 to 8 nodes\n"),
        (["--nodes", "9"], "error: --nodes 9 is not allowed: rehearse with 1 to 8 nodes\n"),
    ],
)
def test_rehearse_refuses_bad_node_counts(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "cluster.py"), "rehearse", *args],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (result.returncode, result.stderr) == (1, message)
