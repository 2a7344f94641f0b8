"""The local multi-host rehearsal: scripts/node/launch.sh on separate hosts, a real
multi-node torchrun job (gloo on the CPU), a node that dies mid-run, and the resume.

Two Linux network namespaces joined by a bridge (created and removed here, loopback-only
traffic) play two cluster nodes; each runs launch.sh exactly as the RunTraining document
does. `cluster.py rehearse` offers the same to users.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from scripts.cluster import main as cluster_main
from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.aws import Cluster
from scripts.cluster_lib.localcloud import job_processes, local_cloud
from scripts.cluster_lib.rehearsal import NetnsHosts, Rehearsal, RunningCommand
from tests.test_launch_scripts import alive

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
connection, (peer, _) = server.accept()
connection.sendall(f"hello from {peer}".encode())
"""
CONNECT = """
import socket, sys, time
for _ in range(100):
    try:
        print(socket.create_connection((sys.argv[1], 5000), timeout=5).recv(100).decode())
        break
    except ConnectionRefusedError:
        time.sleep(0.1)
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


def gone(job: str, timeout: float = 10) -> bool:
    """No process of the job is left (the leg's watchdog polls every second)."""
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


class Train(threading.Thread):
    """`Cluster.train` (the CLI's own code) in a thread, its output kept."""

    def __init__(self, cluster: Cluster, job_id: str, args: list[str], **options: Any) -> None:
        super().__init__(daemon=True)
        self.cluster, self.job_id, self.args, self.options = cluster, job_id, args, options
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.cluster.train(self.job_id, self.args, **self.options)
        except BaseException as error:  # reported by the test
            self.error = error


def make_cluster(cloud: Any, lines: list[str]) -> Cluster:
    return Cluster(
        cloud.clients(), cloud.cluster_name, out=lines.append, poll_interval=0.5,
        wait_timeout=120, failure_grace=20,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.netns
def test_a_cancelled_node_leaves_nothing_behind_and_the_retry_resumes(
    tmp_path: Path, sample_data: Path
) -> None:
    """`train --max-retries 1` through the Run Command stand-in: one node's command is
    cancelled the agent's way (SIGKILL to the script's process group) mid-run; nothing of
    the first attempt survives on any node, the retry's preflight (which fails on
    NeuronCores in use) passes, and the job resumes from its last checkpoint and finishes."""
    job = "cancelled"
    args = train_args(sample_data, "--max-steps", "60", "--checkpoint-every", "5",
                      "--eval-every", "60", "--log-every", "5")  # fmt: skip
    with stand_in(tmp_path) as cloud:
        lines: list[str] = []
        cluster = make_cluster(cloud, lines)
        train = Train(cluster, job, args, nproc_per_node="auto", max_retries=1, retry_delay=1,
                      stream=False)  # fmt: skip
        train.start()
        job_dir = tmp_path / "jobs" / job
        deadline = time.monotonic() + 400
        while not checkpoints(job_dir):
            assert time.monotonic() < deadline, "no checkpoint after 400 s\n" + "\n".join(lines)
            assert train.is_alive(), f"train ended early: {train.error}\n" + "\n".join(lines)
            time.sleep(0.1)
        first_attempt = job_processes(job)
        assert len(first_attempt) >= 4, "expected torchrun and a trainer on each node"
        (command,) = [c for c in cloud.commands.values() if c.document.endswith("RunTraining")]
        victim = cloud.running()[1]
        cloud.cancel(command.command_id, victim.instance_id)
        train.join(timeout=600)
        assert not train.is_alive(), "train did not finish\n" + "\n".join(lines)
        assert train.error is None, f"{train.error}\n" + "\n".join(lines)

        output = "\n".join(lines)
        assert f"RunTraining: node 1 ({victim.address}, {victim.instance_id}): Cancelled" in output
        assert "attempt 1 failed; retrying" in output
        assert "attempt 2 of 2" in output
        # Nothing of the first attempt outlived it: not the cancelled node's workers (in
        # sessions of their own), not the survivor's.
        assert [pid for pid in first_attempt if alive(pid)] == []
        invocation = command.invocations[victim.instance_id].status()
        assert (invocation["status"], invocation["code"]) == ("Cancelled", 137)
        preflights = [c for c in cloud.commands.values() if c.document.endswith("Preflight")]
        assert len(preflights) == 2
        assert all(i.status()["status"] == "Success" for i in preflights[1].invocations.values())
        resumes = job_metrics(tmp_path, job, "resume")
        assert resumes, output
        assert 0 < resumes[-1]["step"] < 60
        summaries = job_metrics(tmp_path, job, "summary")
        assert summaries and max(r["step"] for r in job_metrics(tmp_path, job, "train")) == 60
        assert gone(job), job_processes(job)


@pytest.mark.slow
@pytest.mark.netns
def test_a_leg_that_reaches_its_time_limit_saves_and_the_next_leg_resumes(
    tmp_path: Path, sample_data: Path
) -> None:
    """RunTraining's ExecutionTimeout made short for the first leg (as an operator may deploy
    the document): launch.sh ends the leg StopGraceSeconds before the agent would kill it, the
    trainers save, and `train` with no retries to spend continues with a second leg (at the
    document's own 48-hour limit), which resumes and finishes the job."""
    job = "legs"
    args = train_args(sample_data, "--max-steps", "1500", "--checkpoint-every", "100",
                      "--eval-every", "1500", "--log-every", "10")  # fmt: skip
    defaults = {"RunTraining": {"ExecutionTimeout": "60", "StopGraceSeconds": "30"}}
    with stand_in(tmp_path, document_defaults=defaults) as cloud:
        lines: list[str] = []
        cluster = make_cluster(cloud, lines)
        train = Train(cluster, job, args, max_retries=0, retry_delay=1, stream=False)
        train.start()
        deadline = time.monotonic() + 300
        while not any(c.document.endswith("RunTraining") for c in cloud.commands.values()):
            assert time.monotonic() < deadline and train.is_alive(), "\n".join(lines)
            time.sleep(0.2)
        cloud.document_defaults = {}  # later legs get the document's defaults
        train.join(timeout=900)
        assert not train.is_alive(), "train did not finish\n" + "\n".join(lines)
        output = "\n".join(lines)
        assert train.error is None, f"{train.error}\n{output}"
        assert "leg 1 reached its time limit and saved a checkpoint" in output
        legs = [c for c in cloud.commands.values() if c.document.endswith("RunTraining")]
        assert len(legs) == 2, output
        first = [i.status() for i in legs[0].invocations.values()]
        assert {(s["status"], s["code"]) for s in first} <= {("Failed", 75), ("Success", 0)}
        assert ("Failed", 75) in {(s["status"], s["code"]) for s in first}
        stopped = [s for s in job_metrics(tmp_path, job, "summary") if s.get("stopped_by_signal")]
        assert stopped, "no summary with stopped_by_signal"
        resumes = job_metrics(tmp_path, job, "resume")
        assert resumes and resumes[0]["step"] == stopped[0]["step"]
        assert 0 < stopped[0]["step"] < 1500
        assert max(r["step"] for r in job_metrics(tmp_path, job, "train")) == 1500
        assert gone(job), job_processes(job)


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


@pytest.mark.slow
@pytest.mark.netns
def test_stop_and_logs_through_the_cli_leave_no_process_behind(
    tmp_path: Path, sample_data: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`cluster.py train`, `logs --follow` and `stop` as an operator types them: stop ends
    every process of the job on every node, train does not retry a stopped job, and
    `logs --follow` ends when the command has ended."""
    job = "stopme"
    args = train_args(sample_data, "--max-steps", "5000", "--checkpoint-every", "5",
                      "--eval-every", "5000", "--log-every", "5")  # fmt: skip
    with stand_in(tmp_path) as cloud:
        train = Cli(cloud, "train", "--job-id", job, "--max-retries", "2", "--retry-delay", "1",
                    "--", *args)  # fmt: skip
        train.start()
        job_dir = tmp_path / "jobs" / job
        deadline = time.monotonic() + 400
        while not checkpoints(job_dir):
            assert time.monotonic() < deadline and train.is_alive(), capfd.readouterr().out
            time.sleep(0.2)
        follow = Cli(cloud, "logs", "--job-id", job, "--follow")
        follow.start()
        stop = Cli(cloud, "stop", "--job-id", job)
        stop.run()
        assert stop.code == 0, capfd.readouterr()
        train.join(timeout=300)
        follow.join(timeout=120)
        captured = capfd.readouterr()
        assert not train.is_alive() and train.code not in (None, 0), captured.out + captured.err
        assert not follow.is_alive(), "logs --follow did not end with the command"
        assert follow.code == 0, captured.err
        assert f"job {job} was stopped" in captured.err, captured.err
        assert "retrying" not in captured.out
        assert "[launch " in captured.out  # logs printed the nodes' launch.sh output
        assert gone(job), job_processes(job)
        stops = [c for c in cloud.commands.values() if c.document.endswith("StopTraining")]
        assert [i.status()["status"] for i in stops[0].invocations.values()] == ["Success"] * 2


@pytest.mark.slow
@pytest.mark.netns
def test_cluster_py_rehearse_goes_through_the_run_command_stand_in(
    tmp_path: Path, sample_data: Path
) -> None:
    """`make demo`'s command as root: preflight and RunTraining are sent by the CLI's code to
    the stand-in, which runs the real documents on the namespaced nodes."""
    if not NetnsHosts.available():
        pytest.skip("needs root and iproute2")
    output = with_sample_data(tmp_path / "rehearsal", sample_data)
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "cluster.py"), "rehearse", "--nodes", "2",
         "--mode", "netns", "--output", str(output), "--job-id", "cli", "--quiet",
         "--", *TINY, "--max-steps", "4", "--checkpoint-every", "2", "--eval-every", "4"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "behind the local Run Command stand-in" in result.stdout
    assert "software: version=" in result.stdout  # preflight compared the nodes
    assert "job cli finished on all 2 nodes" in result.stdout
    summary = json.loads(result.stdout.split("summary: ", 1)[1].splitlines()[0])
    assert summary["event"] == "summary"
    assert sorted(p.name for p in (output / "jobs" / "cli" / "logs").iterdir()) == [
        "node-0-10.77.0.1.log", "node-1-10.77.0.2.log",
    ]  # fmt: skip


@pytest.mark.slow
def test_cluster_py_rehearse_on_loopback_addresses(tmp_path: Path, sample_data: Path) -> None:
    """The user-facing command, in the mode that needs no privileges."""
    output = with_sample_data(tmp_path / "rehearsal", sample_data)
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "cluster.py"), "rehearse", "--nodes", "2",
         "--mode", "loopback", "--output", str(output), "--job-id", "cli", "--quiet",
         "--skip-preflight",
         "--", *TINY, "--max-steps", "4", "--checkpoint-every", "2", "--eval-every", "4"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rehearsal: 2 nodes (loopback: 127.0.0.1, 127.0.0.2)" in result.stdout
    summary = json.loads(result.stdout.split("summary: ", 1)[1].splitlines()[0])
    assert summary["event"] == "summary"
    metrics = output / "jobs" / "cli" / "metrics.jsonl"
    assert metrics.is_file()
    assert sorted(p.name for p in (output / "jobs" / "cli" / "logs").iterdir()) == [
        "node-0-127.0.0.1.log", "node-1-127.0.0.2.log",
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
