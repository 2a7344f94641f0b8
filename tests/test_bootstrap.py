"""bootstrap.sh and requirements_diff.py, run against a fake node.

bootstrap.sh runs unmodified with fakes for the system tools on PATH (mount, systemctl,
apt-get, aws, mdadm, ...; they record how they were called in calls.log) and its paths
redirected through the TRAINIUM_* variables. The fake node itself (FakeNode) is shared with
tests/test_launch_scripts.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_launch_scripts import FakeNode, healthy_trainium


@pytest.fixture
def node(tmp_path: Path) -> FakeNode:
    return FakeNode(tmp_path)


# ---------------------------------------------------------------------------- bootstrap
FAKE_MOUNT = """#!/usr/bin/env bash
echo "mount $*" >> "$FAKE_DIR/calls.log"
touch "$FAKE_DIR/mounted"
"""
FAKE_MOUNTPOINT = """#!/usr/bin/env bash
[[ -f "$FAKE_DIR/mounted" ]]
"""
FAKE_SYSTEMCTL = """#!/usr/bin/env bash
echo "systemctl $*" >> "$FAKE_DIR/calls.log"
if [[ $1 == is-active ]]; then [[ -f "$FAKE_DIR/agent-running" ]]; fi
"""
FAKE_AGENT_CTL = """#!/usr/bin/env bash
echo "amazon-cloudwatch-agent-ctl $*" >> "$FAKE_DIR/calls.log"
touch "$FAKE_DIR/agent-running"
"""
# The venv's python: `-m pip ...` is recorded instead of run; the rest is the real Python.
FAKE_VENV_PYTHON = f"""#!/usr/bin/env bash
if [[ $1 == -m && $2 == pip ]]; then
  echo "pip ${{*:3}}" >> "$FAKE_DIR/calls.log"
  exit 0
fi
exec {sys.executable} "$@"
"""


def bootstrap_node(node: FakeNode) -> None:
    healthy_trainium(node)
    for tool, script in (
        ("mount", FAKE_MOUNT),
        ("mountpoint", FAKE_MOUNTPOINT),
        ("systemctl", FAKE_SYSTEMCTL),
    ):
        node.tool(tool, script)
    node.tool("mount.lustre")
    node.tool("modprobe")
    venv = node.root / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text(FAKE_VENV_PYTHON)
    (venv / "python").chmod(0o755)
    agent = node.root / "cwagent" / "bin"
    agent.mkdir(parents=True)
    (agent / "amazon-cloudwatch-agent-ctl").write_text(FAKE_AGENT_CTL)
    (agent / "amazon-cloudwatch-agent-ctl").chmod(0o755)
    neuron_bin = node.root / "neuron-bin"
    neuron_bin.mkdir()
    for name in ("neuron-monitor", "neuron-monitor-cloudwatch.py"):
        (neuron_bin / name).write_text("#!/bin/sh\n")
        (neuron_bin / name).chmod(0o755)
    import pytest as installed  # a package this interpreter has, at its installed version

    (node.workload / "requirements.txt").write_text(
        f"# workload pins\npytest=={installed.__version__}\ntqdm==0.0.1  # differs\ntorch==0.0.1\n"
    )
    node.settings.update(
        AWS_REGION="us-east-1", FSX_DNS_NAME="fs-1.fsx.us-east-1.amazonaws.com",
        FSX_MOUNT_NAME="abcdef", TRAINING_LOG_GROUP="/trainium/training",
        METRICS_NAMESPACE="TrainiumCluster/trainium",
        NEURON_VENV=str(node.root / "venv"),
    )  # fmt: skip
    node.write_env()
    (node.state / "ready").unlink()
    (node.root / "fstab").write_text(
        "LABEL=root / ext4 defaults 0 1\nold-fs@tcp:/x " + str(node.fsx) + " lustre defaults 0 0\n"
    )


def run_bootstrap(node: FakeNode) -> subprocess.CompletedProcess[str]:
    return node.run(
        "bootstrap.sh", "--env-file", str(node.env_file),
        TRAINIUM_FSTAB=str(node.root / "fstab"), TRAINIUM_PROFILE_DIR=str(node.root / "profile.d"),
        TRAINIUM_SYSTEMD_DIR=str(node.root / "systemd"),
        TRAINIUM_CW_AGENT_DIR=str(node.root / "cwagent"),
        TRAINIUM_NEURON_BIN=str(node.root / "neuron-bin"),
    )  # fmt: skip


def test_bootstrap_prepares_the_node_and_a_second_run_changes_nothing(node: FakeNode) -> None:
    bootstrap_node(node)
    first = run_bootstrap(node)
    assert first.returncode == 0, first.stdout + first.stderr
    fsx_lines = [
        line for line in (node.root / "fstab").read_text().splitlines() if str(node.fsx) in line
    ]
    assert fsx_lines == [
        f"fs-1.fsx.us-east-1.amazonaws.com@tcp:/abcdef {node.fsx} lustre "
        "defaults,relatime,flock,_netdev,x-systemd.automount,x-systemd.requires=network.service 0 0"
    ]
    calls = node.calls()
    assert [c for c in calls if c.startswith("mount ")] == [
        f"mount -t lustre -o relatime,flock fs-1.fsx.us-east-1.amazonaws.com@tcp:/abcdef {node.fsx}"
    ]
    pip = [c for c in calls if c.startswith("pip ")]
    assert len(pip) == 2
    assert pip[0].startswith("pip install") and pip[0].endswith(" tqdm==0.0.1")  # only what differs
    assert pip[1] == "pip check"
    constraints = (node.state / "neuron-constraints.txt").read_text()
    assert constraints.startswith("torch==")  # the venv's own torch is pinned, never replaced
    assert "torch 2." in first.stdout and "keeping" in first.stdout
    assert (
        'NEURON_COMPILE_CACHE_URL="s3://cache-bucket/neuron-compile-cache/"'
        in (node.root / "profile.d" / "trainium-cluster.sh").read_text()
    )
    config = json.loads((node.root / "cwagent" / "etc" / "trainium-cluster.json").read_text())
    files = config["logs"]["logs_collected"]["files"]["collect_list"]
    assert {f["log_group_name"] for f in files} == {"/trainium/training"}
    unit = (node.root / "systemd" / "trainium-neuron-monitor.service").read_text()
    assert "--namespace TrainiumCluster/trainium --region us-east-1" in unit
    assert config["metrics"]["namespace"] == "TrainiumCluster/trainium"
    assert "systemctl restart trainium-neuron-monitor.service" in calls
    assert (node.state / "ready").read_text().startswith("ready ")
    log = (node.logs / "bootstrap.log").read_text()
    for phase in (
        "environment",
        "fsx",
        "neuron",
        "efa",
        "python",
        "workload",
        "compile-cache",
        "monitoring",
        "ready",
    ):
        assert re.search(rf"phase {phase}: done in \d+ s", log), phase

    (node.root / "calls.log").unlink()
    second = run_bootstrap(node)
    assert second.returncode == 0, second.stdout
    assert fsx_lines == [
        line for line in (node.root / "fstab").read_text().splitlines() if str(node.fsx) in line
    ]
    calls = node.calls()
    assert not [c for c in calls if c.startswith("mount ")]
    assert not [c for c in calls if "restart" in c or "fetch-config" in c]
    assert "fstab already mounts" in second.stdout
    assert "is already mounted" in second.stdout
    assert (node.state / "ready").exists()


def test_bootstrap_failure_names_the_phase_and_line_and_leaves_no_ready_marker(
    node: FakeNode,
) -> None:
    bootstrap_node(node)
    node.tool("fi_info", "#!/usr/bin/env bash\nexit 1\n")
    result = run_bootstrap(node)
    assert result.returncode == 1
    assert "phase efa: start" in result.stdout
    assert (
        "error: libfabric has no EFA provider: multi-node training needs the EFA interfaces"
        in result.stdout
    )
    assert not (node.state / "ready").exists()
    assert (node.state / "failed").read_text().split(" ", 1)[1] == (
        "libfabric has no EFA provider: multi-node training needs the EFA interfaces\n"
    )
    node.settings["PREFLIGHT_MIN_FREE_GB"] = "0"
    node.write_env()
    check = node.run("preflight.sh", "--hosts", "10.1.0.12", "--nproc-per-node", "1")
    assert "FAIL ready: bootstrap failed: " in check.stderr
    node.tool("neuron-ls", "#!/usr/bin/env bash\nexit 1\n")
    node.tool("lsmod", "#!/usr/bin/env bash\nexit 0\n")
    node.tool(
        "modprobe", "#!/usr/bin/env bash\necho 'modprobe: FATAL: Module neuron not found'\nexit 1\n"
    )
    result = run_bootstrap(node)
    assert result.returncode == 1
    failed = (node.state / "failed").read_text()
    assert re.search(
        r"'modprobe neuron' failed with status 1 at bootstrap.sh line \d+ \(phase neuron\)", failed
    )
    assert failed.split(" ", 1)[1].strip() in result.stdout


def test_bootstrap_needs_its_settings(node: FakeNode) -> None:
    result = node.run("bootstrap.sh", "--env-file", str(node.root / "missing.env"),
                      TRAINIUM_FSTAB=str(node.root / "fstab"))  # fmt: skip
    assert result.returncode == 1
    assert f"cluster settings {node.root}/missing.env not found" in result.stdout
    node.settings.pop("FSX_DNS_NAME", None)
    node.write_env()
    result = node.run(
        "bootstrap.sh", "--env-file", str(node.env_file), TRAINIUM_FSTAB=str(node.root / "fstab")
    )
    assert result.returncode == 1
    assert "lacks AWS_REGION FSX_DNS_NAME FSX_MOUNT_NAME TRAINING_LOG_GROUP" in result.stdout


# --------------------------------------------------------------------- requirements_diff
def test_requirements_plan_installs_only_what_differs_and_never_the_neuron_stack() -> None:
    from scripts.node.requirements_diff import parse_requirements, plan

    pins = parse_requirements(
        "# comment\n-r other.txt\ntorch==2.9.0\nTransformers==5.23.0  # pinned\n"
        "tokenizers[extra]==0.23.3\nnumpy\ntqdm==4.70.1\n"
    )
    assert pins == [
        ("torch", "2.9.0"), ("Transformers", "5.23.0"), ("tokenizers", "0.23.3"),
        ("numpy", None), ("tqdm", "4.70.1"),
    ]  # fmt: skip
    installed = {
        "torch": "2.8.0+cpu",
        "transformers": "5.23.0",
        "tokenizers": "0.22.0",
        "tqdm": "4.70.1",
    }
    install, warnings, constraints = plan(pins, installed, keep={"torch"})
    assert install == ["tokenizers==0.23.3", "numpy"]
    assert warnings == ["torch 2.8.0+cpu is installed, 2.9.0 is pinned: keeping 2.8.0+cpu"]
    assert constraints == ["torch==2.8.0+cpu"]
    # The local version label of a Neuron build does not count as a difference.
    assert plan([("torch", "2.9.0")], {"torch": "2.9.0+cpu"}, keep=set())[0] == []
