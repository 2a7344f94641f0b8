"""bootstrap.sh and requirements_diff.py, run against a fake node.

bootstrap.sh runs unmodified with fakes for the system tools on PATH (mount, systemctl,
curl for the instance metadata and downloads, aws, mdadm, apt-get, ...; they record how they
were called in calls.log) and its paths redirected through the TRAINIUM_* variables. The
Neuron venv is a real venv holding package metadata only; the CloudWatch agent's signature
is checked by the real gpg against a key made for the test. The fake node itself (FakeNode)
is shared with tests/test_launch_scripts.py.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.aws_cli import check_command
from tests.node_support import NODE, FakeNode
from tests.test_preflight import (
    NEURON_RELEASES,
    REFUSED_2_31_1,
    healthy_trainium,
    neuron_release,
)

INSTANCE_STORE = "Amazon EC2 NVMe Instance Storage"
FSX_DEVICE = "fs-1.fsx.us-east-1.amazonaws.com@tcp:/abcdef"
NOBLE = 'ID=ubuntu\nVERSION_CODENAME=noble\nPRETTY_NAME="Ubuntu 24.04"\n'


@pytest.fixture
def node(tmp_path: Path) -> Iterator[FakeNode]:
    """A fake node; the test fails if a script on it made an `aws` call the CLI refuses, even
    where the script only logs the failed call as a warning."""
    node = FakeNode(tmp_path)
    yield node
    assert not refused_calls(node), "calls the AWS CLI refuses:\n" + "\n".join(refused_calls(node))


def refused_calls(node: FakeNode) -> list[str]:
    """The fake `aws`'s refusals on this node, each with the CLI's reason."""
    log = node.root / "aws-refused.log"
    return log.read_text().splitlines() if log.exists() else []


FAKE_MOUNT = """#!/usr/bin/env bash
echo "mount $*" >> "$FAKE_DIR/calls.log"
touch "$FAKE_DIR/mounted-$(basename "${@: -1}")"
"""
FAKE_MOUNTPOINT = """#!/usr/bin/env bash
[[ -f "$FAKE_DIR/mounted-$(basename "${@: -1}")" ]]
"""
FAKE_SYSTEMCTL = """#!/usr/bin/env bash
echo "systemctl $*" >> "$FAKE_DIR/calls.log"
case $1 in
  is-active) [[ -f "$FAKE_DIR/agent-running" ]] ;;
  is-enabled) [[ -f "$FAKE_DIR/enabled-${@: -1}" ]] ;;
  enable) touch "$FAKE_DIR/enabled-$2" ;;
esac
"""
FAKE_AGENT_CTL = """#!/usr/bin/env bash
echo "amazon-cloudwatch-agent-ctl $*" >> "$FAKE_DIR/calls.log"
touch "$FAKE_DIR/agent-running"
"""
# IMDSv2 answers from $FAKE_DIR/imds/<path>; downloads from $FAKE_DIR/downloads/<name>.
FAKE_CURL = """#!/usr/bin/env bash
out="" url="" method=GET
while (($#)); do
  case $1 in
    -o) out=$2; shift 2 ;;
    -X) method=$2; shift 2 ;;
    -H | --max-time | --retry) shift 2 ;;
    -*) shift ;;
    *) url=$1; shift ;;
  esac
done
echo "curl $method $url" >> "$FAKE_DIR/calls.log"
case $url in
  */latest/api/token) [[ $method == PUT ]] && echo fake-token ;;
  */latest/meta-data/*)
    f="$FAKE_DIR/imds/${url#*/latest/meta-data/}"
    [[ -f $f ]] || exit 22
    cat "$f" ;;
  *)
    f="$FAKE_DIR/downloads/${url##*/}"
    [[ -f $f ]] || exit 22
    if [[ -n $out ]]; then cp "$f" "$out"; else cat "$f"; fi ;;
esac
"""
# Each call is first parsed by the real AWS CLI (tests/aws_cli.py): one it would refuse fails
# with its message and exit status 252. The first complete-lifecycle-action succeeds; later ones
# find no pending action, as on AWS after a reboot.
FAKE_AWS = """#!/usr/bin/env bash
echo "aws $*" >> "$FAKE_DIR/calls.log"
if ! refusal=$(@CHECK@ "$@" 2>&1); then
  echo "$refusal" | tee -a "$FAKE_DIR/aws-refused.log" >&2
  exit 252
fi
case "$*" in
  *describe-auto-scaling-instances*)
    if [[ -n ${FAKE_DESCRIBE_ERROR:-} ]]; then
      echo "$FAKE_DESCRIBE_ERROR" >&2
      exit 254
    fi
    # The CLI prints the answer through bootstrap's own --query and --output.
    template="" instances=""
    lt='"LaunchTemplateId": "lt-0123456789abcdef0", "LaunchTemplateName": "trainium-nodes"'
    [[ -z ${FAKE_LT_VERSION:-} ]] ||
      printf -v template ', "LaunchTemplate": {%s, "Version": "%s"}' "$lt" "$FAKE_LT_VERSION"
    instance='{"InstanceId": "%s", "AutoScalingGroupName": "%s", "AvailabilityZone": "us-east-1a",'
    instance+=' "LifecycleState": "Pending:Wait", "HealthStatus": "HEALTHY",'
    instance+=' "ProtectedFromScaleIn": false%s}'
    [[ -z ${FAKE_ASG:-} ]] ||
      printf -v instances "$instance" "${FAKE_INSTANCE:-i-0}" "$FAKE_ASG" "$template"
    AWS_CHECK_RESPONSE="{\\"AutoScalingInstances\\": [$instances]}" @CHECK@ "$@" ;;
  *complete-lifecycle-action*)
    if [[ -n ${FAKE_LIFECYCLE_ERROR:-} ]]; then
      echo "$FAKE_LIFECYCLE_ERROR" >&2
      exit 254
    fi
    if [[ -f "$FAKE_DIR/lifecycle-done" ]]; then
      echo "An error occurred (ValidationError) when calling the CompleteLifecycleAction \\
operation: No active Lifecycle Action found with instance ID ${FAKE_INSTANCE:-}" >&2
      exit 254
    fi
    touch "$FAKE_DIR/lifecycle-done" ;;
  *record-lifecycle-action-heartbeat*)
    if [[ -f "$FAKE_DIR/lifecycle-done" ]]; then
      echo "An error occurred (ValidationError) when calling the RecordLifecycleActionHeartbeat \\
operation: No active Lifecycle Action found with instance ID ${FAKE_INSTANCE:-}" >&2
      exit 254
    fi ;;
  *set-instance-health*)
    if [[ -n ${FAKE_HEALTH_ERROR:-} ]]; then
      echo "$FAKE_HEALTH_ERROR" >&2
      exit 254
    fi ;;
esac
"""
FAKE_MODINFO = """#!/usr/bin/env bash
[[ ! -f "$FAKE_DIR/no-lustre-module" ]]
"""
# Holds the dpkg lock for as many polls as $FAKE_DIR/lock-polls says.
FAKE_FUSER = """#!/usr/bin/env bash
n=$(cat "$FAKE_DIR/lock-polls" 2>/dev/null || echo 0)
((n > 0)) || exit 1
echo $((n - 1)) > "$FAKE_DIR/lock-polls"
echo " 4242"
"""
FAKE_PS = """#!/usr/bin/env bash
echo unattended-upgr
"""
FAKE_BLKID = """#!/usr/bin/env bash
cat "$FAKE_DIR/fs-$(basename "${@: -1}")" 2>/dev/null
"""
FAKE_MKFS = """#!/usr/bin/env bash
echo "mkfs.ext4 $*" >> "$FAKE_DIR/calls.log"
echo ext4 > "$FAKE_DIR/fs-$(basename "${@: -1}")"
"""
# The array's superblocks survive a reboot, not a stop and start.
FAKE_MDADM = """#!/usr/bin/env bash
echo "mdadm $*" >> "$FAKE_DIR/calls.log"
case $1 in
  --assemble) [[ -f "$FAKE_DIR/md-superblocks" ]] ;;
  --create) touch "$FAKE_DIR/md-superblocks" ;;
esac
"""
FAKE_DPKG = """#!/usr/bin/env bash
echo "dpkg $*" >> "$FAKE_DIR/calls.log"
mkdir -p "$FAKE_DIR/cwagent/bin"
cp "$FAKE_DIR/agent-ctl" "$FAKE_DIR/cwagent/bin/amazon-cloudwatch-agent-ctl"
chmod +x "$FAKE_DIR/cwagent/bin/amazon-cloudwatch-agent-ctl"
"""
# The Neuron venv's python: `-m pip --python P install ...` is recorded and leaves package
# metadata in P's site-packages, as an install would; the rest is the venv's real python.
FAKE_NEURON_PYTHON = """#!/usr/bin/env bash
if [[ $1 == -m && $2 == pip ]]; then
  echo "pip ${*:3}" >> "$FAKE_DIR/calls.log"
  if [[ $3 == --python && $5 == install ]]; then
    site=$("$4" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    prev=""
    for arg in "${@:6}"; do
      if [[ $arg == *==* && $prev != -c ]]; then
        d="$site/${arg%%==*}-${arg#*==}.dist-info"
        mkdir -p "$d"
        printf 'Metadata-Version: 2.1\\nName: %s\\nVersion: %s\\n' "${arg%%==*}" "${arg#*==}" \\
          > "$d/METADATA"
      fi
      prev=$arg
    done
  fi
  exit "${FAKE_PIP_EXIT:-0}"
fi
exec "$(dirname "$0")/python-real" "$@"
"""
# What the DLAMI's Neuron venv holds, as far as these tests care: name -> (version, requires).
# The Neuron packages at Neuron 2.29.1's versions (src/helperscripts/n2-manifest.json).
NEURON_VENV_PACKAGES: dict[str, tuple[str, list[str]]] = {
    "torch": ("2.9.0+cpu", ["filelock", "typing-extensions>=4.10.0", "pytest ; extra == 'test'"]),
    "torch-xla": ("2.9.0", ["numpy", "pyyaml", "absl-py>=1.0.0"]),
    "torch-neuronx": ("2.9.0.2.13.26312", ["torch==2.9.*", "torch-xla==2.9.*", "libneuronxla"]),
    "libneuronxla": ("2.2.16408.0", ["boto3", "numpy"]),
    "neuronx-cc": ("2.24.8799.0", ["numpy<3", "protobuf>3"]),
    "neuronx-distributed": ("0.19.28492", ["transformers"]),
    "numpy": ("2.2.6", []),
    "pyyaml": ("6.0.2", []),
    "absl-py": ("2.1.0", []),
    "protobuf": ("5.29.4", []),
    "boto3": ("1.40.0", []),
    "filelock": ("3.16.0", []),
    "typing-extensions": ("4.12.2", []),
    "transformers": ("4.57.1", ["numpy>=1.17", "tokenizers"]),
    "tokenizers": ("0.22.1", []),
    "tqdm": ("4.70.1", []),
}
WORKLOAD_REQUIREMENTS = """# workload pins
torch==2.9.0
torch-xla==2.9.0
transformers==5.23.0
numpy==2.4.6
tqdm==4.70.1
"""


def fake_aws() -> str:
    return FAKE_AWS.replace("@CHECK@", check_command())


def tool(directory: Path, name: str, script: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(script)
    path.chmod(0o755)
    return path


def site_packages(venv: Path) -> Path:
    return next(venv.glob("lib/python3*/site-packages"))


def make_neuron_venv(
    venv: Path, packages: dict[str, tuple[str, list[str]]], modules: tuple[str, ...] = ("boto3",)
) -> None:
    """A real venv with the packages' metadata (no code) and importable stand-ins for
    `modules`; its bin/python is FAKE_NEURON_PYTHON in front of the real one."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = site_packages(venv)
    for name, (version, requires) in packages.items():
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        lines = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"]
        lines += [f"Requires-Dist: {requirement}\n" for requirement in requires]
        (info / "METADATA").write_text("".join(lines))
    for module in modules:
        (site / module).mkdir()
        (site / module / "__init__.py").write_text("")
    (venv / "bin" / "python").rename(venv / "bin" / "python-real")
    tool(venv / "bin", "python", FAKE_NEURON_PYTHON)


def bootstrap_node(node: FakeNode, *, instance_store: int = 4) -> None:
    healthy_trainium(node)
    for name, script in (
        ("mount", FAKE_MOUNT),
        ("mountpoint", FAKE_MOUNTPOINT),
        ("systemctl", FAKE_SYSTEMCTL),
        ("curl", FAKE_CURL),
        ("aws", fake_aws()),
        ("modinfo", FAKE_MODINFO),
        ("fuser", FAKE_FUSER),
        ("ps", FAKE_PS),
        ("blkid", FAKE_BLKID),
        ("mkfs.ext4", FAKE_MKFS),
        ("mdadm", FAKE_MDADM),
        ("dpkg", FAKE_DPKG),
    ):
        node.tool(name, script)
    for name in ("mount.lustre", "modprobe", "apt-get"):
        node.tool(name)
    make_neuron_venv(node.root / "neuron-venv", NEURON_VENV_PACKAGES)
    (node.root / "agent-ctl").write_text(FAKE_AGENT_CTL)
    tool(node.root / "cwagent" / "bin", "amazon-cloudwatch-agent-ctl", FAKE_AGENT_CTL)
    for name in ("neuron-monitor", "neuron-monitor-cloudwatch.py"):
        tool(node.root / "neuron-bin", name, "#!/bin/sh\n")
    (node.workload / "requirements.txt").write_text(WORKLOAD_REQUIREMENTS)
    imds = node.root / "imds"
    imds.mkdir()
    (imds / "instance-id").write_text("i-0123456789abcdef0")
    (imds / "ami-id").write_text("ami-0fedcba9876543210")
    block = node.root / "sys" / "block"
    models = ["Amazon Elastic Block Store"] + [INSTANCE_STORE] * instance_store
    for i, model in enumerate(models):
        (block / f"nvme{i}n1" / "device").mkdir(parents=True)
        (block / f"nvme{i}n1" / "device" / "model").write_text(f"{model:<40}\n")
    (node.root / "os-release").write_text(NOBLE)
    node.settings.update(
        AWS_REGION="us-east-1", FSX_DNS_NAME="fs-1.fsx.us-east-1.amazonaws.com",
        FSX_MOUNT_NAME="abcdef", TRAINING_LOG_GROUP="/trainium/training",
        METRICS_NAMESPACE="TrainiumCluster/trainium", NEURON_VENV=str(node.root / "neuron-venv"),
        SOFTWARE_VERSION="0123456789abcdef", INTERNET_EGRESS="nat",
        LIFECYCLE_HOOK_NAME="trainium-launch", SCRATCH_DIR=str(node.root / "scratch"),
        # As the compute stack writes it: the cache's directory on the shared file system.
        COMPILE_CACHE_URL=f"{node.fsx}/neuron-compile-cache",
    )  # fmt: skip
    node.write_env()
    (node.state / "ready").unlink()
    (node.root / "fstab").write_text(
        "LABEL=root / ext4 defaults 0 1\nold-fs@tcp:/x " + str(node.fsx) + " lustre defaults 0 0\n"
    )


def run_bootstrap(node: FakeNode, **extra: str) -> subprocess.CompletedProcess[str]:
    settings = {
        "TRAINIUM_FSTAB": str(node.root / "fstab"),
        "TRAINIUM_PROFILE_DIR": str(node.root / "profile.d"),
        "TRAINIUM_SYSTEMD_DIR": str(node.root / "systemd"),
        "TRAINIUM_TMPFILES_DIR": str(node.root / "tmpfiles.d"),
        "TRAINIUM_CW_AGENT_DIR": str(node.root / "cwagent"),
        "TRAINIUM_NEURON_BIN": str(node.root / "neuron-bin"),
        "TRAINIUM_WORKLOAD_VENV": str(node.root / "workload-venv"),
        "TRAINIUM_BASE_REQUIREMENTS": str(node.workload / "requirements.txt"),
        "TRAINIUM_SYSTEM_PYTHON": str(node.root / "no-system-python"),
        "TRAINIUM_OS_RELEASE": str(node.root / "os-release"),
        "TRAINIUM_SYS_BLOCK": str(node.root / "sys" / "block"),
        "TRAINIUM_DEV_DIR": str(node.root / "dev"),
        "TRAINIUM_MDSTAT": str(node.root / "mdstat"),
        "TRAINIUM_APT_SOURCES_DIR": str(node.root / "apt"),
        "TRAINIUM_KEYRING_DIR": str(node.root / "keyrings"),
        "TRAINIUM_LOCK_POLL": "0",
        "FAKE_ASG": "trainium-nodes",
        "FAKE_LT_VERSION": "7",
        "FAKE_INSTANCE": "i-0123456789abcdef0",
    }
    settings.update(extra)
    return node.run("bootstrap.sh", "--env-file", str(node.env_file), **settings)


def output(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [
        line.split("] error: ", 1)[1] for line in result.stdout.splitlines() if "] error: " in line
    ]


def node_env(node: FakeNode) -> dict[str, str]:
    lines = (node.root / "node.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if not line.startswith("#"))


def fsx_lines(node: FakeNode) -> list[str]:
    lines = (node.root / "fstab").read_text().splitlines()
    return [line for line in lines if str(node.fsx) in line]


def reboot(node: FakeNode) -> None:
    """What a reboot changes for bootstrap: nothing is mounted; systemd-tmpfiles clears the
    markers; the kernel assembled the instance-store array from its superblocks."""
    for marker in node.root.glob("mounted-*"):
        marker.unlink()
    (node.root / "calls.log").unlink()
    (node.root / "fs-md127").write_text("ext4\n")
    (node.root / "mdstat").write_text(
        "Personalities : [raid0]\n"
        "md127 : active raid0 nvme4n1[3] nvme3n1[2] nvme2n1[1] nvme1n1[0]\n"
        "      7500000000 blocks super 1.2 512k chunks\n"
    )


# ---------------------------------------------------------------------------- first boot
def test_bootstrap_prepares_the_node_and_a_second_run_changes_nothing(node: FakeNode) -> None:
    bootstrap_node(node)
    first = run_bootstrap(node)
    assert first.returncode == 0, output(first)
    fstab = (node.root / "fstab").read_text()
    # Ubuntu 24.04 has no network.service: network-online.target, and nofail.
    assert fsx_lines(node) == [
        f"fs-1.fsx.us-east-1.amazonaws.com@tcp:/abcdef {node.fsx} lustre defaults,relatime,flock,"
        "_netdev,nofail,x-systemd.requires=network-online.target 0 0"
    ]
    calls = node.calls()
    assert [c for c in calls if c.startswith("mount ")] == [
        f"mount -o noatime {node.root}/dev/md/trainium-scratch {node.root}/scratch",
        f"mount -t lustre -o relatime,flock {FSX_DEVICE} {node.fsx}",
    ]
    # Instance store: the four instance-store devices, not the EBS root volume.
    devices = " ".join(f"{node.root}/dev/nvme{i}n1" for i in (1, 2, 3, 4))
    assert (
        f"mdadm --create {node.root}/dev/md/trainium-scratch --run --level=0 --raid-devices=4 "
        f"--name=trainium-scratch {devices}" in calls
    )
    assert (
        f"mkfs.ext4 -F -q -L trainium-scratch -E nodiscard {node.root}/dev/md/trainium-scratch"
        in calls
    )
    assert (node.root / "scratch" / "tmp").stat().st_mode & 0o7777 == 0o1777
    # Every boot: the oneshot unit after network-online.target, the markers cleared at boot.
    unit = (node.root / "systemd" / "trainium-bootstrap.service").read_text()
    assert "Type=oneshot" in unit
    assert "Wants=network-online.target\nAfter=network-online.target remote-fs.target" in unit
    assert f"ExecStart=/bin/bash {NODE}/bootstrap.sh --env-file {node.env_file}\n" in unit
    assert "systemctl enable trainium-bootstrap.service" in calls
    assert not [c for c in calls if "start trainium-bootstrap" in c]
    rules = (node.root / "tmpfiles.d" / "trainium-cluster.conf").read_text().splitlines()
    assert f"r! {node.state}/ready" in rules
    assert f"r! {node.state}/failed" in rules
    # node.env for the launcher and preflight.
    env = node_env(node)
    assert {k: env[k] for k in env if k != "BOOT_ID"} == {
        "INSTANCE_ID": "i-0123456789abcdef0",
        "AMI_ID": "ami-0fedcba9876543210",
        "LAUNCH_TEMPLATE_VERSION": "7",
        "AUTO_SCALING_GROUP_NAME": "trainium-nodes",
        "SOFTWARE_VERSION": "0123456789abcdef",
        "SCRATCH": f"{node.root}/scratch",
        "TMPDIR": f"{node.root}/scratch/tmp",
        "WORKLOAD_VENV": f"{node.root}/workload-venv",
        "WORKLOAD_PYTHON": f"{node.root}/workload-venv/bin/python",
    }
    # The lifecycle hook and the metric.
    aws = [c for c in calls if c.startswith("aws ")]
    assert any(
        "autoscaling complete-lifecycle-action --lifecycle-hook-name trainium-launch "
        "--auto-scaling-group-name trainium-nodes --instance-id i-0123456789abcdef0 "
        "--lifecycle-action-result CONTINUE" in c
        for c in aws
    )
    assert any(
        "cloudwatch put-metric-data --namespace TrainiumCluster/trainium --metric-name "
        "BootstrapFailures --dimensions ClusterName=trainium --unit Count --value 0" in c
        for c in aws
    )
    # Python: only what the Neuron venv lacks goes into the layered venv.
    pip = [c for c in calls if c.startswith("pip ")]
    layer_python = f"{node.root}/workload-venv/bin/python"
    assert pip == [
        f"pip --python {layer_python} install --quiet --disable-pip-version-check "
        f"-c {node.state}/neuron-constraints.txt transformers==5.23.0",
        f"pip --python {layer_python} check",
    ]
    assert "numpy 2.2.6 is installed, 2.4.6 is pinned: keeping 2.2.6" in first.stdout
    assert (
        f'NEURON_COMPILE_CACHE_URL="{node.fsx}/neuron-compile-cache"'
        in (node.root / "profile.d" / "trainium-cluster.sh").read_text()
    )
    assert (node.fsx / "neuron-compile-cache").is_dir()
    config = json.loads((node.root / "cwagent" / "etc" / "trainium-cluster.json").read_text())
    files = config["logs"]["logs_collected"]["files"]["collect_list"]
    assert {f["log_group_name"] for f in files} == {"/trainium/training"}
    # The agent ships only the newest file a wildcard matches: precompile's logs get their own
    # entry and stream, apart from the jobs'.
    assert {f["file_path"]: f["log_stream_name"] for f in files} == {
        f"{node.logs}/bootstrap.log": "{instance_id}/bootstrap",
        f"{node.logs}/jobs/*.log": "{instance_id}/jobs",
        f"{node.logs}/precompile/*.log": "{instance_id}/precompile",
        # The jobs' metrics files (launch.sh TRAINIUM_METRICS_FILE), which `jobs` reads.
        f"{node.logs}/metrics/*.jsonl": "{instance_id}/metrics",
    }
    assert (node.logs / "metrics").is_dir()  # there before the agent starts watching it
    assert config["metrics"]["namespace"] == "TrainiumCluster/trainium"
    assert config["metrics"]["metrics_collected"]["disk"]["resources"] == [
        "/", str(node.fsx), f"{node.root}/scratch"
    ]  # fmt: skip
    assert "systemctl restart trainium-neuron-monitor.service" in calls
    assert (node.state / "ready").read_text().startswith("ready ")
    log = (node.logs / "bootstrap.log").read_text()
    for phase in (
        "environment", "identity", "boot-unit", "scratch", "fsx", "neuron", "efa", "python",
        "compile-cache", "monitoring", "lifecycle", "ready",
    ):  # fmt: skip
        assert re.search(rf"phase {phase}: done in \d+ s", log), phase

    (node.root / "calls.log").unlink()
    second = run_bootstrap(node)
    assert second.returncode == 0, output(second)
    assert (node.root / "fstab").read_text() == fstab
    calls = node.calls()
    assert not [c for c in calls if c.startswith(("mount ", "mdadm ", "mkfs", "pip install"))]
    assert not [c for c in calls if "restart" in c or "fetch-config" in c or " enable " in c]
    assert "fstab already mounts" in second.stdout
    assert "is already mounted" in second.stdout
    assert "trainium-bootstrap.service already installed" in second.stdout
    assert "the workload venv already has every pinned workload requirement" in second.stdout
    assert "no pending launch lifecycle action (a later boot): CONTINUE not needed" in second.stdout
    assert (node.state / "ready").exists()


# modinfo (the fsx phase asks it for the Lustre module) that answers only once the heartbeat
# loop has recorded two heartbeats after the first: bootstrap is "slow" until then.
SLOW_MODINFO = """#!/usr/bin/env bash
for _ in $(seq 600); do
  (($(grep -c record-lifecycle-action-heartbeat "$FAKE_DIR/calls.log") >= 3)) && exit 0
  sleep 0.1
done
echo "modinfo (test): no heartbeats within 60 s" >&2
exit 1
"""


# A `sleep` that takes 3 s to end on its SIGTERM: stop_heartbeat must wait for the heartbeat
# loop's sleep, not only for the loop.
SLOW_TO_END_SLEEP = """#!/usr/bin/env bash
command -p sleep "$@" &
trap 'kill "$!"; command -p sleep 3; exit 143' TERM
wait "$!"
"""


def processes_of(root: Path) -> list[str]:
    """Command lines of the processes that run with FAKE_DIR=root (this node's tools), once
    bootstrap's log `tee` has ended too (it reads on until bootstrap's output closes; waited
    for, at most 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        found = []
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if f"FAKE_DIR={root}".encode() in environ.read_bytes().split(b"\0"):
                    cmdline = (environ.parent / "cmdline").read_bytes()
                    found.append(cmdline.replace(b"\0", b" ").decode(errors="replace"))
                    found[-1] = found[-1] or f"pid {environ.parent.name}, ending"
            except OSError:
                continue
        if not any(line.startswith("tee ") for line in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_bootstrap_records_lifecycle_heartbeats_while_it_works(node: FakeNode) -> None:
    """While the launch lifecycle action is pending, bootstrap records heartbeats (each restarts
    the hook's 45-minute timeout), and stops before it completes the action."""
    bootstrap_node(node)
    node.tool("modinfo", SLOW_MODINFO)
    node.tool("sleep", SLOW_TO_END_SLEEP)
    result = run_bootstrap(node, TRAINIUM_HEARTBEAT_INTERVAL="1")
    assert result.returncode == 0, output(result)
    aws = [c.split("--cli-read-timeout 30 ", 1)[1] for c in node.calls() if c.startswith("aws ")]
    heartbeat = (
        "autoscaling record-lifecycle-action-heartbeat --lifecycle-hook-name trainium-launch "
        "--auto-scaling-group-name trainium-nodes --instance-id i-0123456789abcdef0"
    )
    assert aws.count(heartbeat) >= 3, aws
    complete = next(i for i, c in enumerate(aws) if "complete-lifecycle-action" in c)
    assert heartbeat not in aws[complete:], "a heartbeat after the action was completed"
    assert "launch lifecycle action pending: a heartbeat every 1 s" in result.stdout
    assert "lifecycle heartbeats stopped" in result.stdout
    assert processes_of(node.root) == [], "the heartbeat loop outlived bootstrap"

    # A later boot has no pending action: one try, no loop.
    (node.bin / "sleep").unlink()
    node.tool("modinfo", FAKE_MODINFO)
    reboot(node)
    result = run_bootstrap(node, TRAINIUM_HEARTBEAT_INTERVAL="1")
    assert result.returncode == 0, output(result)
    aws = [c for c in node.calls() if "record-lifecycle-action-heartbeat" in c]
    assert len(aws) == 1
    assert "no pending launch lifecycle action (a later boot): no heartbeat to record" in (
        result.stdout
    )


def test_a_failed_bootstrap_stops_its_heartbeats(node: FakeNode) -> None:
    bootstrap_node(node)
    node.tool("modinfo", SLOW_MODINFO.replace("exit 0", "exit 1"))
    node.tool("apt-get", "#!/usr/bin/env bash\nexit 100\n")
    result = run_bootstrap(node, TRAINIUM_HEARTBEAT_INTERVAL="1")
    assert result.returncode != 0
    calls = node.calls()
    abandon = next(i for i, c in enumerate(calls) if "--lifecycle-action-result ABANDON" in c)
    assert not [c for c in calls[abandon:] if "record-lifecycle-action-heartbeat" in c]
    assert "lifecycle heartbeats stopped" in result.stdout
    assert processes_of(node.root) == []


def test_the_workload_venv_sees_the_neuron_venv_and_its_own_packages_first(
    node: FakeNode,
) -> None:
    bootstrap_node(node)
    result = run_bootstrap(node)
    assert result.returncode == 0, output(result)
    probe = (
        "from importlib import metadata as m; import boto3; "
        "print(m.version('numpy'), m.version('torch'), m.version('transformers'))"
    )
    layer = node.root / "workload-venv" / "bin" / "python"
    versions = subprocess.run(
        [str(layer), "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split()
    # numpy and torch are the Neuron venv's; transformers is the workload's, installed in the
    # layer, ahead of the Neuron venv's 4.57.1, which stays where it was.
    assert versions == ["2.2.6", "2.9.0+cpu", "5.23.0"]
    # Its torchrun starts the workers with the workload venv's interpreter.
    torchrun = (node.root / "workload-venv" / "bin" / "torchrun").read_text().splitlines()
    assert torchrun[0] == f"#!{layer}"
    assert "from torch.distributed.run import main" in torchrun
    assert os.access(node.root / "workload-venv" / "bin" / "torchrun", os.X_OK)
    neuron_site = site_packages(node.root / "neuron-venv")
    assert (neuron_site / "transformers-4.57.1.dist-info").is_dir()
    assert not list(neuron_site.glob("transformers-5*"))
    constraints = (node.state / "neuron-constraints.txt").read_text().splitlines()
    assert "numpy==2.2.6" in constraints
    assert "torch==2.9.0+cpu" in constraints
    assert not [line for line in constraints if line.startswith("transformers")]


# ------------------------------------------------------------------------------- reboots
def test_a_reboot_remounts_everything_and_keeps_the_scratch_data(node: FakeNode) -> None:
    bootstrap_node(node)
    assert run_bootstrap(node).returncode == 0
    reboot(node)
    result = run_bootstrap(node)
    assert result.returncode == 0, output(result)
    calls = node.calls()
    assert [c for c in calls if c.startswith("mount ")] == [
        f"mount -o noatime {node.root}/dev/md127 {node.root}/scratch",
        f"mount -t lustre -o relatime,flock {FSX_DEVICE} {node.fsx}",
    ]
    assert not [c for c in calls if c.startswith(("mdadm", "mkfs"))]
    # No pending lifecycle action after a reboot: that is not a failure.
    assert "no pending launch lifecycle action" in result.stdout
    assert not (node.state / "failed").exists()


def test_a_stop_and_start_rebuilds_the_blank_instance_store(node: FakeNode) -> None:
    bootstrap_node(node)
    assert run_bootstrap(node).returncode == 0
    reboot(node)
    (node.root / "mdstat").unlink()
    for blank in (*node.root.glob("fs-*"), node.root / "md-superblocks"):
        blank.unlink()
    result = run_bootstrap(node)
    assert result.returncode == 0, output(result)
    calls = node.calls()
    md = f"{node.root}/dev/md/trainium-scratch"
    assert [c.split()[1] for c in calls if c.startswith("mdadm")] == ["--assemble", "--create"]
    assert f"mkfs.ext4 -F -q -L trainium-scratch -E nodiscard {md}" in calls


def test_a_reboot_after_a_stop_reassembles_the_array_without_formatting_it(
    node: FakeNode,
) -> None:
    bootstrap_node(node)
    assert run_bootstrap(node).returncode == 0
    reboot(node)
    (node.root / "mdstat").unlink()  # not assembled by the kernel: assembled by bootstrap
    result = run_bootstrap(node)
    assert result.returncode == 0, output(result)
    calls = node.calls()
    assert [c.split()[1] for c in calls if c.startswith("mdadm")] == ["--assemble"]
    assert not [c for c in calls if c.startswith("mkfs")]


def test_one_instance_store_device_is_used_without_an_array(node: FakeNode) -> None:
    bootstrap_node(node, instance_store=1)
    result = run_bootstrap(node)
    assert result.returncode == 0, output(result)
    calls = node.calls()
    assert not [c for c in calls if c.startswith("mdadm")]
    assert f"mount -o noatime {node.root}/dev/nvme1n1 {node.root}/scratch" in calls


def test_without_instance_store_scratch_stays_on_the_root_volume(node: FakeNode) -> None:
    bootstrap_node(node, instance_store=0)
    result = run_bootstrap(node)
    assert result.returncode == 0, output(result)
    assert "no instance-store NVMe on this trn1.32xlarge" in result.stdout
    assert "SCRATCH" not in node_env(node)
    assert "TMPDIR" not in node_env(node)


def test_a_new_kernel_gets_its_lustre_modules_after_the_dpkg_lock_is_free(
    node: FakeNode, signing_key: tuple[Path, str]
) -> None:
    bootstrap_node(node)
    (node.root / "no-lustre-module").touch()
    (node.root / "lock-polls").write_text("2")
    (node.root / "downloads").mkdir()
    (node.root / "downloads" / "fsx-ubuntu-public-key.asc").write_text(armored(signing_key))
    result = run_bootstrap(node)
    assert result.returncode == 0, output(result)
    kernel = os.uname().release
    apt = [c for c in node.calls() if c.startswith("apt-get")]
    assert apt == [
        "apt-get -o DPkg::Lock::Timeout=900 update -q",
        f"apt-get -o DPkg::Lock::Timeout=900 install -y -q lustre-client-modules-{kernel}",
    ]
    assert (
        "waiting up to 900 s for the dpkg lock, held by unattended-upgr (pids 4242)"
        in result.stdout
    )
    assert (node.root / "lock-polls").read_text().strip() == "0"
    sources = (node.root / "apt" / "fsxlustreclientrepo.list").read_text()
    assert "https://fsx-lustre-client-repo.s3.amazonaws.com/ubuntu noble main" in sources


def test_the_dpkg_lock_wait_is_bounded(node: FakeNode, signing_key: tuple[Path, str]) -> None:
    bootstrap_node(node)
    (node.root / "no-lustre-module").touch()
    (node.root / "lock-polls").write_text("1000")
    (node.root / "downloads").mkdir()
    (node.root / "downloads" / "fsx-ubuntu-public-key.asc").write_text(armored(signing_key))
    result = run_bootstrap(node, TRAINIUM_APT_LOCK_TIMEOUT="0")
    assert result.returncode == 1
    assert error_lines(result) == [
        "the dpkg lock is still held after 0 s by unattended-upgr (pids 4242): packages cannot "
        "be installed yet"
    ]
    assert not [c for c in node.calls() if c.startswith("apt-get")]


# ------------------------------------------------------------------------ endpoints only
def test_endpoints_mode_refuses_a_missing_lustre_client_at_once(node: FakeNode) -> None:
    bootstrap_node(node)
    node.settings["INTERNET_EGRESS"] = "endpoints"
    node.write_env()
    (node.root / "no-lustre-module").touch()
    result = run_bootstrap(node)
    kernel = os.uname().release
    assert result.returncode == 1
    assert error_lines(result) == [
        f"the Lustre client for kernel {kernel} (lustre-client-modules-{kernel}) is missing and "
        "INTERNET_EGRESS=endpoints installs nothing from the internet: use an AMI that has it"
    ]
    calls = node.calls()
    assert not [c for c in calls if c.startswith(("apt-get", "curl GET https"))]


def test_endpoints_mode_refuses_workload_packages_it_cannot_download(node: FakeNode) -> None:
    bootstrap_node(node)
    node.settings["INTERNET_EGRESS"] = "endpoints"
    node.write_env()
    result = run_bootstrap(node)
    assert result.returncode == 1
    assert error_lines(result) == [
        "the workload needs transformers==5.23.0, which the Neuron venv lacks, and "
        "INTERNET_EGRESS=endpoints installs nothing from the internet: ship its wheels in "
        f"{node.workload}/wheels or use an AMI that has them"
    ]
    assert not [c for c in node.calls() if c.startswith("pip install")]


def test_endpoints_mode_installs_shipped_wheels_without_an_index(node: FakeNode) -> None:
    bootstrap_node(node)
    node.settings["INTERNET_EGRESS"] = "endpoints"
    node.write_env()
    (node.workload / "wheels").mkdir()
    result = run_bootstrap(node)
    assert result.returncode == 0, output(result)
    pip = [c for c in node.calls() if c.startswith("pip ") and " install " in c]
    assert len(pip) == 1
    assert f"--no-index --find-links {node.workload}/wheels -c " in pip[0]


def test_endpoints_mode_refuses_a_missing_cloudwatch_agent(node: FakeNode) -> None:
    bootstrap_node(node)
    node.settings["INTERNET_EGRESS"] = "endpoints"
    node.write_env()
    (node.workload / "wheels").mkdir()
    shutil.rmtree(node.root / "cwagent")
    result = run_bootstrap(node)
    assert result.returncode == 1
    assert error_lines(result) == [
        "the CloudWatch agent is not installed and INTERNET_EGRESS=endpoints installs nothing "
        "from the internet: use an AMI that has it"
    ]
    assert not [c for c in node.calls() if "amazoncloudwatch-agent" in c]


def test_bootstrap_refuses_an_unknown_egress_mode(node: FakeNode) -> None:
    bootstrap_node(node)
    node.settings["INTERNET_EGRESS"] = "proxy"
    node.write_env()
    result = run_bootstrap(node)
    assert result.returncode == 1
    assert error_lines(result) == [
        f"INTERNET_EGRESS 'proxy' in {node.env_file} is not allowed: use nat or endpoints"
    ]


# ------------------------------------------------------------------ compile cache
@pytest.mark.parametrize(
    "url",
    [
        "/var/tmp/neuron-compile-cache",  # the Neuron default: each node compiles alone
        "{fsx}/../neuron-compile-cache",  # beside the mount point, not on it
        "{fsx}",  # the file system's root: the association's directory is below it
        "{root}/elsewhere",  # a link on /fsx to a local directory
    ],
)
def test_a_compile_cache_off_the_shared_file_system_is_refused(node: FakeNode, url: str) -> None:
    """Every rank of every node must find the same entries and lock them on one file system
    (Lustre's flock mount option makes the locks coherent across nodes)."""
    bootstrap_node(node)
    if url == "{root}/elsewhere":
        node.fsx.mkdir()
        (node.root / "elsewhere").mkdir()
        (node.fsx / "neuron-compile-cache").symlink_to(node.root / "elsewhere")
        url = "{fsx}/neuron-compile-cache"
    node.settings["COMPILE_CACHE_URL"] = url.format(fsx=node.fsx, root=node.root)
    node.write_env()
    result = run_bootstrap(node)
    assert result.returncode == 1
    assert error_lines(result) == [
        f"COMPILE_CACHE_URL '{node.settings['COMPILE_CACHE_URL']}' in {node.env_file} is not on "
        f"the mounted shared file system: use a directory under {node.fsx}"
    ]
    assert not (node.state / "ready").exists()


def test_a_relative_compile_cache_is_refused(node: FakeNode) -> None:
    bootstrap_node(node)
    node.settings["COMPILE_CACHE_URL"] = "neuron-compile-cache"
    node.write_env()
    result = run_bootstrap(node)
    assert result.returncode == 1
    assert error_lines(result) == [
        f"COMPILE_CACHE_URL 'neuron-compile-cache' in {node.env_file} is not allowed: use a "
        f"directory under {node.fsx} (or an s3:// URL)"
    ]


def test_a_compile_cache_in_s3_still_works_but_is_warned_about(node: FakeNode) -> None:
    bootstrap_node(node)
    node.settings["COMPILE_CACHE_URL"] = "s3://cache-bucket/neuron-compile-cache/"
    node.write_env()
    result = run_bootstrap(node)
    assert result.returncode == 0, output(result)
    assert (
        "warning: COMPILE_CACHE_URL s3://cache-bucket/neuron-compile-cache/ is in S3: every "
        "rank of a job asks S3 for each graph" in result.stdout
    )
    assert (
        'NEURON_COMPILE_CACHE_URL="s3://cache-bucket/neuron-compile-cache/"'
        in (node.root / "profile.d" / "trainium-cluster.sh").read_text()
    )


# ------------------------------------------------------------------ CloudWatch agent
@pytest.fixture(scope="session")
def signing_key(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A gpg home with one signing key, and that key's fingerprint."""
    if shutil.which("gpg") is None:
        pytest.skip("gpg is not installed")
    home = tmp_path_factory.mktemp("gpg")
    home.chmod(0o700)
    gpg = ["gpg", "--homedir", str(home), "--batch", "--passphrase", ""]
    subprocess.run(
        [*gpg, "--quick-gen-key", "Test Signer <signer@example.com>", "ed25519", "sign", "never"],
        check=True, capture_output=True,
    )  # fmt: skip
    listing = subprocess.run(
        [*gpg, "--with-colons", "--list-keys"], check=True, capture_output=True, text=True
    ).stdout
    fingerprint = next(
        line.split(":")[9] for line in listing.splitlines() if line.startswith("fpr")
    )
    yield home, fingerprint
    subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "all"], check=False)


def armored(key: tuple[Path, str]) -> str:
    home, _ = key
    return subprocess.run(
        ["gpg", "--homedir", str(home), "--batch", "--armor", "--export"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip


def publish_agent(node: FakeNode, key: tuple[Path, str], *, tamper: bool = False) -> None:
    """The agent package, its detached signature and the public key, as the download URLs
    serve them."""
    home, _ = key
    downloads = node.root / "downloads"
    downloads.mkdir(exist_ok=True)
    package = downloads / "amazon-cloudwatch-agent.deb"
    package.write_bytes(b"!<arch>\nfake cloudwatch agent package\n")
    gpg = ["gpg", "--homedir", str(home), "--batch", "--yes"]
    subprocess.run([*gpg, "--detach-sign", "-o", f"{package}.sig", str(package)], check=True)
    exported = subprocess.run([*gpg, "--export"], check=True, capture_output=True).stdout
    (downloads / "amazon-cloudwatch-agent.gpg").write_bytes(exported)
    if tamper:
        package.write_bytes(b"!<arch>\nsomething else\n")
    shutil.rmtree(node.root / "cwagent")


def test_the_cloudwatch_agent_is_installed_after_its_signature_is_verified(
    node: FakeNode, signing_key: tuple[Path, str]
) -> None:
    bootstrap_node(node)
    publish_agent(node, signing_key)
    result = run_bootstrap(node, TRAINIUM_CW_AGENT_FINGERPRINT=signing_key[1])
    assert result.returncode == 0, output(result)
    calls = node.calls()
    base = "https://amazoncloudwatch-agent-us-east-1.s3.us-east-1.amazonaws.com/ubuntu/amd64/latest"
    assert f"curl GET {base}/amazon-cloudwatch-agent.deb" in calls
    assert f"curl GET {base}/amazon-cloudwatch-agent.deb.sig" in calls
    assert (
        "curl GET https://amazoncloudwatch-agent.s3.amazonaws.com/assets/amazon-cloudwatch-agent.gpg"
        in calls
    )
    dpkg = [c for c in calls if c.startswith("dpkg ")]
    assert len(dpkg) == 1 and dpkg[0].startswith("dpkg -i -E ")
    assert f"signature verified (key {signing_key[1]})" in result.stdout


def test_a_cloudwatch_agent_package_with_a_bad_signature_is_not_installed(
    node: FakeNode, signing_key: tuple[Path, str]
) -> None:
    bootstrap_node(node)
    publish_agent(node, signing_key, tamper=True)
    result = run_bootstrap(node, TRAINIUM_CW_AGENT_FINGERPRINT=signing_key[1])
    base = "https://amazoncloudwatch-agent-us-east-1.s3.us-east-1.amazonaws.com/ubuntu/amd64/latest"
    assert result.returncode == 1
    assert error_lines(result) == [
        f"the CloudWatch agent package from {base} is not signed by key {signing_key[1]}: "
        "not installed"
    ]
    assert not [c for c in node.calls() if c.startswith("dpkg ")]


def test_a_signature_by_another_key_is_refused(
    node: FakeNode, signing_key: tuple[Path, str]
) -> None:
    bootstrap_node(node)
    publish_agent(node, signing_key)
    # The default trust anchor is AWS's key: the test key's good signature does not count.
    result = run_bootstrap(node)
    assert result.returncode == 1
    assert "is not signed by key 937616F3450B7D806CBD9725D58167303B789C72" in result.stdout
    assert not [c for c in node.calls() if c.startswith("dpkg ")]


# ------------------------------------------------------------------------ neuron-monitor
def test_neuron_monitor_runs_under_an_interpreter_that_has_boto3(node: FakeNode) -> None:
    bootstrap_node(node)
    unit_file = node.root / "systemd" / "trainium-neuron-monitor.service"
    result = run_bootstrap(node)
    assert result.returncode == 0, output(result)
    assert f"neuron-monitor | {node.root}/neuron-venv/bin/python " in unit_file.read_text()
    # A Neuron venv without boto3: the system python that has it.
    shutil.rmtree(site_packages(node.root / "neuron-venv") / "boto3")
    system = tool(
        node.root / "system",
        "python3",
        '#!/usr/bin/env bash\n[[ "$*" == "-c import boto3" ]]\n',
    )
    result = run_bootstrap(node, TRAINIUM_SYSTEM_PYTHON=str(system))
    assert result.returncode == 0, output(result)
    assert f"neuron-monitor | {system} " in unit_file.read_text()
    assert "systemctl restart trainium-neuron-monitor.service" in node.calls()


def test_neuron_monitor_without_boto3_anywhere_fails_in_one_line(node: FakeNode) -> None:
    bootstrap_node(node)
    shutil.rmtree(site_packages(node.root / "neuron-venv") / "boto3")
    result = run_bootstrap(node)
    assert result.returncode == 1
    assert error_lines(result) == [
        f"neuron-monitor-cloudwatch.py needs boto3 and none of {node.root}/neuron-venv/bin/python,"
        f" {node.root}/no-system-python, {node.root}/workload-venv/bin/python can import it"
    ]


# ------------------------------------------------------------------------------ failures
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
    # The group replaces the node; the alarm sees the failure.
    aws = [c for c in node.calls() if c.startswith("aws ")]
    assert any("--lifecycle-action-result ABANDON" in c for c in aws)
    assert not any("--lifecycle-action-result CONTINUE" in c for c in aws)
    assert any("--metric-name BootstrapFailures" in c and c.endswith("--value 1") for c in aws)
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


@pytest.mark.parametrize(
    ("release", "refused"),
    [("2.29.1", False), ("2.28.0", False), ("2.27.0", False), ("2.30.0", True), ("2.31.1", True)],
)
def test_bootstrap_refuses_an_image_outside_the_neuron_releases_that_train(
    node: FakeNode, release: str, refused: bool
) -> None:
    """Neuron 2.30.0 and later still ship torch-neuronx 2.9, but "PyTorch/XLA is no longer
    supported for training workloads on Trainium" (Neuron's announcement
    announce-no-support-pytorch-xla-training): bootstrap reads the node's torch-neuronx,
    neuronx-cc and libneuronxla (the venv's package metadata), runtime (dpkg-query) and driver
    (/sys/module/neuron/version) and refuses such an image in one line, which the failed
    marker keeps for preflight (exit 3) and the group replaces the node."""
    bootstrap_node(node)
    neuron_release(node, release, venv=node.root / "neuron-venv")
    result = run_bootstrap(node)
    if not refused:
        assert result.returncode == 0, output(result)
        assert re.search(
            rf"\] Neuron software within the supported range \(Neuron [0-9. or]*"
            rf"{re.escape(release)}[0-9. or]*\): torch-neuronx "
            rf"{NEURON_RELEASES[release]['torch-neuronx']}, ",
            result.stdout,
        ), result.stdout
        return
    assert result.returncode == 1
    line = error_lines(result)
    assert len(line) == 1 and line[0].startswith(
        "Neuron software outside the supported range: found torch-neuronx "
        f"{NEURON_RELEASES[release]['torch-neuronx']}, "
    ), line
    if release == "2.31.1":
        assert line == [REFUSED_2_31_1]
    assert (node.state / "failed").read_text().split(" ", 1)[1] == line[0] + "\n"
    assert not (node.state / "ready").exists()
    assert "phase python: start" not in result.stdout, "refused in phase neuron"
    aws = [c for c in node.calls() if c.startswith("aws ")]
    assert any("--lifecycle-action-result ABANDON" in c for c in aws)
    node.settings["PREFLIGHT_MIN_FREE_GB"] = "0"
    node.write_env()
    check = node.run("preflight.sh", "--hosts", "10.1.0.12", "--nproc-per-node", "1")
    assert check.returncode == 3, check.stderr
    assert f"replace this node: bootstrap failed on this boot: {line[0]}" in check.stderr


def test_a_bootstrap_that_fails_on_a_later_boot_gets_the_node_replaced(node: FakeNode) -> None:
    """After a reboot there is no launch to abandon and the EC2 status checks pass: bootstrap
    marks the instance Unhealthy (autoscaling SetInstanceHealth) and leaves the failed marker,
    on which preflight exits 3 (replace this node) even when that call failed."""
    bootstrap_node(node)
    assert run_bootstrap(node).returncode == 0
    reboot(node)
    (node.root / "no-lustre-module").touch()  # a new kernel without its Lustre modules
    node.tool("apt-get", "#!/usr/bin/env bash\necho 'E: Unable to locate package' >&2\nexit 100\n")
    result = run_bootstrap(node)
    assert result.returncode != 0
    aws = [c for c in node.calls() if c.startswith("aws ")]
    assert any("--lifecycle-action-result ABANDON" in c for c in aws)
    assert any(
        "autoscaling set-instance-health --instance-id i-0123456789abcdef0 --health-status "
        "Unhealthy --no-should-respect-grace-period" in c
        for c in aws
    ), aws
    assert (
        "marked i-0123456789abcdef0 Unhealthy in its Auto Scaling group trainium-nodes: the "
        "group replaces it" in result.stdout
    )
    error = (node.state / "failed").read_text().split(" ", 1)[1].strip()
    assert "(phase fsx)" in error, error

    # Should SetInstanceHealth fail, the job supervisor still replaces it: preflight exits 3.
    denied = "An error occurred (AccessDenied) when calling the SetInstanceHealth operation"
    (node.root / "calls.log").unlink()
    result = run_bootstrap(node, FAKE_HEALTH_ERROR=denied)
    assert result.returncode != 0
    assert f"warning: could not mark i-0123456789abcdef0 Unhealthy: {denied}" in result.stdout
    node.settings["PREFLIGHT_MIN_FREE_GB"] = "0"
    node.write_env()
    check = node.run("preflight.sh", "--hosts", "10.1.0.12", "--nproc-per-node", "1")
    assert check.returncode == 3, check.stderr
    assert f"replace this node: bootstrap failed on this boot: {error}" in check.stderr


def test_a_bootstrap_that_fails_on_its_first_boot_is_abandoned_not_marked(
    node: FakeNode,
) -> None:
    bootstrap_node(node)
    node.tool("fi_info", "#!/usr/bin/env bash\nexit 1\n")
    result = run_bootstrap(node)
    assert result.returncode == 1
    aws = [c for c in node.calls() if c.startswith("aws ")]
    assert any("--lifecycle-action-result ABANDON" in c for c in aws)
    assert not any("set-instance-health" in c for c in aws)


def test_a_node_with_fewer_efa_devices_than_its_type_fails_the_bootstrap(node: FakeNode) -> None:
    bootstrap_node(node)
    assert node.settings["EFA_DEVICE_COUNT"] == "8"
    (node.root / "efa-devices").write_text("7")
    result = run_bootstrap(node)
    assert result.returncode != 0
    assert error_lines(result) == [
        "found 7 EFA devices, expected 8 (trn1.32xlarge): a lost EFA device is a hardware fault"
    ]
    aws = [c for c in node.calls() if c.startswith("aws ")]
    assert any("--lifecycle-action-result ABANDON" in c for c in aws)
    (node.root / "efa-devices").write_text("8")
    result = run_bootstrap(node)
    assert result.returncode == 0, output(result)
    assert "8 EFA devices, 8 expected" in result.stdout


def test_a_lifecycle_hook_that_cannot_be_completed_fails_the_bootstrap(node: FakeNode) -> None:
    bootstrap_node(node)
    denied = (
        "An error occurred (AccessDenied) when calling the CompleteLifecycleAction operation: "
        "not authorized"
    )
    result = run_bootstrap(node, FAKE_LIFECYCLE_ERROR=denied)
    assert result.returncode == 1
    assert (
        "could not complete lifecycle hook trainium-launch with CONTINUE: An error occurred "
        "(AccessDenied)" in result.stdout
    )
    assert not (node.state / "ready").exists()
    assert (node.state / "failed").read_text().split(" ", 1)[1] == (
        f"could not complete lifecycle hook trainium-launch with CONTINUE: {denied}\n"
    )


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


def test_bootstrap_outside_ec2_says_so(node: FakeNode) -> None:
    bootstrap_node(node)
    shutil.rmtree(node.root / "imds")
    result = run_bootstrap(node)
    assert result.returncode == 1
    assert error_lines(result)[0] == (
        "instance metadata (IMDSv2 at http://169.254.169.254) did not answer: bootstrap runs on "
        "a cluster node"
    )


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


def test_requirements_plan_keeps_what_the_neuron_stack_depends_on() -> None:
    from scripts.node.requirements_diff import (
        parse_requirements,
        plan,
        runtime_requirements,
        shared_closure,
    )

    installed = {name: version for name, (version, _) in NEURON_VENV_PACKAGES.items()}
    requires = {
        name: runtime_requirements(reqs) for name, (_, reqs) in NEURON_VENV_PACKAGES.items()
    }
    assert requires["torch"] == ["filelock", "typing-extensions"]  # extras left out
    shared = shared_closure({"torch", "torch-xla", "torch-neuronx", "libneuronxla", "neuronx-cc"},
                            requires)  # fmt: skip
    assert shared == {
        "filelock": "torch", "typing-extensions": "torch", "numpy": "libneuronxla",
        "boto3": "libneuronxla", "pyyaml": "torch-xla", "absl-py": "torch-xla",
        "protobuf": "neuronx-cc",
    }  # fmt: skip
    keep = {"torch", "torch-xla", "torch-neuronx", "neuronx-cc", "libneuronxla",
            "torchvision", "neuronx-distributed"}  # fmt: skip
    install, warnings, constraints = plan(
        parse_requirements(WORKLOAD_REQUIREMENTS + "pyyaml==6.0.3\nsafetensors==0.8.0\n"),
        installed, keep, shared,
    )  # fmt: skip
    # transformers is neuronx-distributed's, which the training process does not load: the
    # workload's own version goes into the layer. numpy and pyyaml stay the Neuron venv's.
    assert install == ["transformers==5.23.0", "safetensors==0.8.0"]
    assert warnings == [
        "numpy 2.2.6 is installed, 2.4.6 is pinned: keeping 2.2.6 (libneuronxla in the Neuron "
        "venv depends on it)",
        "pyyaml 6.0.2 is installed, 6.0.3 is pinned: keeping 6.0.2 (torch-xla in the Neuron venv "
        "depends on it)",
    ]
    assert constraints == [
        "absl-py==2.1.0", "boto3==1.40.0", "filelock==3.16.0", "libneuronxla==2.2.16408.0",
        "neuronx-cc==2.24.8799.0", "neuronx-distributed==0.19.28492", "numpy==2.2.6",
        "protobuf==5.29.4", "pyyaml==6.0.2", "torch==2.9.0+cpu", "torch-neuronx==2.9.0.2.13.26312",
        "torch-xla==2.9.0", "typing-extensions==4.12.2",
    ]  # fmt: skip


def test_requirements_diff_reads_the_first_installed_copy_as_python_imports_it(
    tmp_path: Path,
) -> None:
    """The layer's copy of a package shadows the Neuron venv's, for imports and for the plan."""
    first, second = tmp_path / "first", tmp_path / "second"
    for site, version in ((first, "5.23.0"), (second, "4.57.1")):
        info = site / f"transformers-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: transformers\nVersion: {version}\n"
        )
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("transformers==5.23.0\n")
    script = Path(__file__).resolve().parent.parent / "scripts" / "node" / "requirements_diff.py"
    result = subprocess.run(
        [sys.executable, "-S", str(script), str(requirements)], capture_output=True, text=True,
        env={"PYTHONPATH": f"{first}:{second}"}, check=True,
    )  # fmt: skip
    assert result.stdout == ""


def test_identity_comes_from_the_instance_tags_when_the_metadata_has_them(
    node: FakeNode,
) -> None:
    bootstrap_node(node)
    tags = node.root / "imds" / "tags" / "instance"
    tags.mkdir(parents=True)
    (tags / "aws:autoscaling:groupName").write_text("tagged-group")
    (tags / "aws:ec2launchtemplate:version").write_text("12")
    result = run_bootstrap(node)
    assert result.returncode == 0, output(result)
    env = node_env(node)
    assert (env["AUTO_SCALING_GROUP_NAME"], env["LAUNCH_TEMPLATE_VERSION"]) == (
        "tagged-group",
        "12",
    )
    aws = [c for c in node.calls() if c.startswith("aws ")]
    assert not [c for c in aws if "describe-auto-scaling-instances" in c]
    assert any("--auto-scaling-group-name tagged-group" in c for c in aws)


def test_a_group_that_cannot_be_found_fails_in_one_line_and_is_reported(node: FakeNode) -> None:
    bootstrap_node(node)
    denied = (
        "An error occurred (AccessDenied) when calling the DescribeAutoScalingInstances "
        "operation: not authorized"
    )
    result = run_bootstrap(node, FAKE_DESCRIBE_ERROR=denied)
    assert result.returncode == 1
    assert error_lines(result) == [
        f"aws autoscaling describe-auto-scaling-instances failed: {denied}"
    ]
    assert "phase identity: start" in result.stdout
    aws = [c for c in node.calls() if c.startswith("aws ")]
    assert any("--metric-name BootstrapFailures" in c and c.endswith("--value 1") for c in aws)
    assert "Auto Scaling group is unknown: lifecycle hook trainium-launch not completed" in (
        result.stdout
    )


def test_the_last_boots_node_env_does_not_leak_into_bootstrap(node: FakeNode) -> None:
    bootstrap_node(node, instance_store=0)
    (node.root / "node.env").write_text(
        f"SOFTWARE_VERSION=ffffffffffffffff\nTMPDIR={node.root}/gone/tmp\nSCRATCH=/gone\n"
    )
    result = run_bootstrap(node)
    assert result.returncode == 0, output(result)
    env = node_env(node)
    assert env["SOFTWARE_VERSION"] == "0123456789abcdef"
    assert "TMPDIR" not in env
    assert "SCRATCH" not in env


# ------------------------------------------------------------- the layer, with real pip
def build_wheel(directory: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A minimal pure-Python wheel: one module with __version__, and its metadata."""
    module = name.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": f"__version__ = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {requirement}\n" for requirement in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    directory.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(directory / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
        for path, content in files.items():
            wheel.writestr(path, content)
            digest = hashlib.sha256(content.encode()).digest()
            encoded = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
            record.append(f"{path},sha256={encoded},{len(content)}\n")
        wheel.writestr(f"{info}/RECORD", "".join(record) + f"{info}/RECORD,,\n")


# The Neuron venv's python, with this interpreter's real pip standing in for the venv's.
REAL_PIP_NEURON_PYTHON = f"""#!/usr/bin/env bash
if [[ $1 == -m && $2 == pip ]]; then
  echo "pip ${{*:3}}" >> "$FAKE_DIR/calls.log"
  # Only ever into another environment: never into the one running these tests.
  [[ $3 == --python && $4 != {sys.executable} ]] || exit 97
  exec {sys.executable} -m pip "${{@:3}}"
fi
exec "$(dirname "$0")/python-real" "$@"
"""


def test_real_pip_installs_into_the_workload_venv_and_never_into_the_neuron_venv(
    node: FakeNode,
) -> None:
    bootstrap_node(node)
    venv = node.root / "neuron-venv"
    shutil.rmtree(venv)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    dlami, shipped = node.root / "dlami-wheels", node.workload / "wheels"
    # The Neuron packages at Neuron 2.29.1's versions, which bootstrap checks.
    build_wheel(dlami, "libneuronxla", "2.2.16408.0", ("numpy>=1.21.6",))
    build_wheel(dlami, "torch-neuronx", "2.9.0.2.13.26312")
    build_wheel(dlami, "neuronx-cc", "2.24.8799.0")
    build_wheel(dlami, "numpy", "2.2.6")
    build_wheel(dlami, "transformers", "4.57.1", ("numpy>=1.17",))
    build_wheel(dlami, "boto3", "1.40.0")
    build_wheel(shipped, "transformers", "5.23.0", ("numpy>=1.17",))
    build_wheel(shipped, "numpy", "2.4.6")  # offered, and refused by the constraints
    pip = [
        sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
        "--quiet", "--disable-pip-version-check", "--no-index", "--find-links", str(dlami),
    ]  # fmt: skip
    subprocess.run(
        [*pip, "libneuronxla", "torch-neuronx", "neuronx-cc", "transformers==4.57.1", "boto3"],
        check=True, capture_output=True,
    )  # fmt: skip
    (venv / "bin" / "python").rename(venv / "bin" / "python-real")
    tool(venv / "bin", "python", REAL_PIP_NEURON_PYTHON)
    (node.workload / "requirements.txt").write_text("transformers==5.23.0\nnumpy==2.4.6\n")
    node.settings["INTERNET_EGRESS"] = "endpoints"
    node.write_env()
    result = run_bootstrap(node)
    assert result.returncode == 0, output(result)
    layer = node.root / "workload-venv"
    probe = "import numpy, transformers; print(transformers.__file__, numpy.__file__)"
    found = subprocess.run(
        [str(layer / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split()
    assert found[0].startswith(f"{layer}/")  # the workload's transformers 5.23.0
    assert found[1].startswith(f"{venv}/")  # the Neuron venv's numpy 2.2.6
    neuron_site = site_packages(venv)
    assert sorted(p.name for p in neuron_site.glob("*.dist-info")) == [
        "boto3-1.40.0.dist-info", "libneuronxla-2.2.16408.0.dist-info",
        "neuronx_cc-2.24.8799.0.dist-info", "numpy-2.2.6.dist-info",
        "torch_neuronx-2.9.0.2.13.26312.dist-info", "transformers-4.57.1.dist-info",
    ]  # fmt: skip
    assert not list(site_packages(layer).glob("numpy*"))
    assert "No broken requirements found." in result.stdout
