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
import time
from pathlib import Path
from typing import Any

import pytest

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.rehearsal import NetnsHosts, Rehearsal, RunningCommand

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


@pytest.mark.slow
@pytest.mark.netns
def test_two_nodes_train_then_resume_after_one_dies(tmp_path: Path, sample_data: Path) -> None:
    with namespaced_hosts(2) as hosts:
        rehearsal = Rehearsal(hosts, tmp_path, echo=None)

        # Preflight across the two nodes: local checks and a gloo all-reduce.
        preflight = rehearsal.preflight()
        assert preflight.wait(timeout=300) == [0, 0], tails(preflight)
        assert any('"event": "collective"' in line for line in preflight.nodes[0].lines)

        # Job 1 trains to completion on both nodes.
        job = rehearsal.start_job("complete", train_args(sample_data, "--max-steps", "8",
                                                          "--checkpoint-every", "4",
                                                          "--eval-every", "8"))  # fmt: skip
        assert job.wait(timeout=600) == [0, 0], tails(job)
        job_dir = rehearsal.job_dir("complete")
        assert events(rehearsal, "complete", "summary"), tails(job)
        assert max(r["step"] for r in events(rehearsal, "complete", "train")) == 8
        assert checkpoints(job_dir)[-1] == 8
        logs = sorted(p.name for p in (job_dir / "logs").iterdir())
        assert logs == ["node-0-10.77.0.1.log", "node-1-10.77.0.2.log"]

        # Job 2: node 1 dies after the first checkpoint; node 0's torchrun fails on its own.
        args = train_args(sample_data, "--max-steps", "60", "--checkpoint-every", "5",
                          "--eval-every", "60")  # fmt: skip
        job = rehearsal.start_job("resume", args)
        job_dir = rehearsal.job_dir("resume")
        deadline = time.monotonic() + 400
        while not checkpoints(job_dir):
            assert time.monotonic() < deadline, "no checkpoint after 400 s\n" + tails(job)
            assert None in [n.process.poll() for n in job.nodes], "job ended early\n" + tails(job)
            time.sleep(0.05)
        hosts.kill(1)
        codes = job.wait(timeout=300, failure_grace=240)
        assert not events(rehearsal, "resume", "summary"), "the job finished before the kill"
        assert codes[1] != 0
        assert codes[0] > 0, f"node 0 did not fail on its own (status {codes[0]})\n" + tails(job)
        assert any("torchrun failed with status" in line for line in job.nodes[0].lines)
        last = checkpoints(job_dir)[-1]
        assert 0 < last < 60

        # The same job ID on both nodes again: it resumes from the last checkpoint and ends.
        job = rehearsal.start_job("resume", args)
        assert job.wait(timeout=600) == [0, 0], tails(job)
        resumes = events(rehearsal, "resume", "resume")
        assert resumes, tails(job)
        assert resumes[-1]["step"] == last
        assert str(last) in str(resumes[-1].get("checkpoint", last))
        assert events(rehearsal, "resume", "summary")
        steps = [r["step"] for r in events(rehearsal, "resume", "train")]
        assert max(steps) == 60
        assert any(step > last for step in steps)


@pytest.mark.slow
def test_cluster_py_rehearse_on_loopback_addresses(tmp_path: Path, sample_data: Path) -> None:
    """The user-facing command, in the mode that needs no privileges."""
    output = tmp_path / "rehearsal"
    (output / "data").mkdir(parents=True)
    for path in sample_data.iterdir():
        (output / "data" / path.name).write_bytes(path.read_bytes())
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
