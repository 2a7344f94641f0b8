"""A node the group terminates gives its job the stop grace (scripts/node/termination_watch.sh),
and the job is then retried, not finished (launch.sh), within the group's termination lifecycle
hook (stacks/compute.py), which bootstrap installs the watch for.

The watch runs unmodified on a fake node (tests/node_support.py): IMDSv2 answered from files
(tests/test_bootstrap.py FAKE_CURL), `aws` parsed by the real AWS CLI before the fake records it
(tests/aws_cli.py), and a job process tagged as launch.sh tags its processes (TRAINIUM_JOB_ID)
that saves on SIGTERM.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.aws_cli import check_command
from tests.node_support import NODE, FakeNode
from tests.test_bootstrap import FAKE_CURL, bootstrap_node, run_bootstrap

#: Records each call with whether the job had saved by then; the AWS CLI parses it first.
FAKE_AWS = """#!/usr/bin/env bash
if ! refusal=$(@CHECK@ "$@" 2>&1); then
  echo "$refusal" >&2
  exit 252
fi
saved=no
[[ -f "$FAKE_DIR/saved" ]] && saved=yes
echo "aws $* (saved: $saved)" >> "$FAKE_DIR/calls.log"
"""
#: A trainer: on SIGTERM it saves (a file, a second later) and exits 0, as workload/stop.py's
#: trainer does.
TRAINER = """
import os, signal, sys, time
def save(*_):
    time.sleep(1)
    open(os.environ["FAKE_DIR"] + "/saved", "w").write("5\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, save)
while True:
    time.sleep(0.1)
"""


@pytest.fixture
def node(tmp_path: Path) -> FakeNode:
    found = FakeNode(tmp_path)
    found.tool("curl", FAKE_CURL)
    found.tool("aws", FAKE_AWS.replace("@CHECK@", check_command()))
    found.settings.update(AWS_REGION="us-east-1", TERMINATION_HOOK_NAME="trainium-terminating")
    found.write_env()
    (tmp_path / "node.env").write_text(
        "INSTANCE_ID=i-0123456789abcdef0\nAUTO_SCALING_GROUP_NAME=trainium-workers\n"
    )
    (tmp_path / "imds" / "autoscaling").mkdir(parents=True)
    return found


def _wait(what: str, condition: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s"
        time.sleep(0.1)


def test_a_terminating_node_stops_its_job_with_the_grace_then_completes_the_hook(
    node: FakeNode,
) -> None:
    state = node.root / "imds" / "autoscaling" / "target-lifecycle-state"
    state.write_text("InService")
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER], env={**node.env(), "TRAINIUM_JOB_ID": "bert-1"}
    )
    watch = subprocess.Popen(
        ["bash", str(NODE / "termination_watch.sh"), "--interval", "1", "--grace", "30"],
        env=node.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait(
            "the watch reading the state",
            lambda: any("target-lifecycle-state" in c for c in _calls(node)) or watch.poll(),
        )
        assert watch.poll() is None, watch.communicate()
        time.sleep(1.5)  # a second read of InService: nothing happens
        assert trainer.poll() is None and not (node.state / "terminating").exists()

        state.write_text("Terminated")
        out, _ = watch.communicate(timeout=90)
        assert watch.returncode == 0, out
        assert trainer.wait(timeout=30) == 0
    finally:
        for process in (trainer, watch):
            if process.poll() is None:
                process.kill()
    assert (node.root / "saved").read_text() == "5\n"
    assert (node.state / "terminating").is_file()
    (complete,) = [c for c in _calls(node) if c.startswith("aws ")]
    assert complete == (
        "aws --region us-east-1 --cli-connect-timeout 10 --cli-read-timeout 30 autoscaling "
        "complete-lifecycle-action --lifecycle-hook-name trainium-terminating "
        "--auto-scaling-group-name trainium-workers --instance-id i-0123456789abcdef0 "
        "--lifecycle-action-result CONTINUE (saved: yes)"
    )
    assert "this node is being terminated: stopping its job processes with a 30 s grace" in out
    assert f"sending SIGTERM to 1 worker processes of job *: {trainer.pid}" in out, out


def test_a_terminating_node_without_a_job_completes_the_hook_at_once(node: FakeNode) -> None:
    (node.root / "imds" / "autoscaling" / "target-lifecycle-state").write_text("Terminated")
    result = subprocess.run(
        ["bash", str(NODE / "termination_watch.sh"), "--interval", "1"],
        env=node.env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no job process runs on this node" in result.stdout + result.stderr
    assert [c for c in _calls(node) if "complete-lifecycle-action" in c]


def test_a_job_stopped_because_its_node_terminates_is_reported_failed_so_it_is_retried(
    node: FakeNode,
) -> None:
    """The trainers exit 0 after saving on the watch's SIGTERM; without the marker launch.sh
    would report the job finished and the supervisor would end it at the stop step."""
    finished = node.run("launch.sh", "--hosts", "10.1.0.12", "--job-id", "j",
                        "--nproc-per-node", "1")  # fmt: skip
    assert finished.returncode == 0
    (node.state / "terminating").write_text("2026-12-08T10:00:00Z\n")
    stopped = node.run("launch.sh", "--hosts", "10.1.0.12", "--job-id", "j",
                       "--nproc-per-node", "1")  # fmt: skip
    assert stopped.returncode == 1, stopped.stdout + stopped.stderr
    assert "because the node is being terminated: reporting 1" in stopped.stdout


def test_bad_options_are_refused_in_one_line(node: FakeNode) -> None:
    result = node.run("termination_watch.sh", "--interval", "soon")
    assert result.returncode != 0
    assert "--interval 'soon' is not a number of seconds" in result.stdout + result.stderr


def test_bootstrap_installs_the_watch_as_a_service_where_the_group_has_the_hook(
    tmp_path: Path,
) -> None:
    node = FakeNode(tmp_path)
    bootstrap_node(node)
    node.settings["TERMINATION_HOOK_NAME"] = "trainium-terminating"
    node.write_env()
    result = run_bootstrap(node)
    assert result.returncode == 0, result.stdout + result.stderr
    unit = (node.root / "systemd" / "trainium-termination-watch.service").read_text()
    assert f"ExecStart=/bin/bash {NODE}/termination_watch.sh\n" in unit
    assert "Restart=on-failure" in unit
    calls = node.calls()
    assert "systemctl enable trainium-termination-watch.service" in calls
    assert "systemctl restart trainium-termination-watch.service" in calls


def _calls(node: FakeNode) -> list[str]:
    path = node.root / "calls.log"
    return path.read_text().splitlines() if path.is_file() else []
