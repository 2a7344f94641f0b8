"""preflight.sh, the checks a node passes before a job, against fake node tools.

The fake node is tests/node_support.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stacks.supervisor import ROLL_FLEET_STATUS
from tests.node_support import (
    LOG_LINE,
    NODE,
    FakeNode,
    free_ports,
    real_torchrun,
    trainium_devices,
)


@pytest.fixture
def node(tmp_path: Path) -> FakeNode:
    return FakeNode(tmp_path)


# ---------------------------------------------------------------------------- preflight
# `fi_info -p efa -t FI_EP_RDM` on a node with $FAKE_DIR/efa-devices EFA devices (8 when
# absent, a trn1.32xlarge): one block per device, as libfabric prints it.
FAKE_FI_INFO = """#!/usr/bin/env bash
[[ "$*" == "-p efa -t FI_EP_RDM" ]] || { echo "fake fi_info: unexpected arguments $*" >&2; exit 2; }
n=$(cat "$FAKE_DIR/efa-devices" 2>/dev/null || echo 8)
((n > 0)) || { echo 'fi_getinfo: -61 (No data available)'; exit 1; }
for ((i = 0; i < n; i++)); do
  printf 'provider: efa\n    fabric: efa\n    domain: rdmap%ds%d-rdm\n' $((16 * i)) $((27 + i))
  printf '    version: 122.0\n    type: FI_EP_RDM\n    protocol: FI_PROTO_EFA\n'
done
"""

# With $FAKE_DIR/fake-agreement, `python3 agreement.py ...` answers as the real
# agreement does when every node passed and runs the same software (the fake torchrun, from
# tests/node_support.py, answers for the all-reduce); everything else, and the agreement
# without that file, runs the next python3 on PATH (with the node's PATH: the Neuron release's
# reader runs the node's dpkg-query).
FAKE_PYTHON3 = """#!/usr/bin/env bash
if [[ -f "$FAKE_DIR/fake-agreement" && $1 == agreement.py ]]; then
  printf '%s\\n' "${@:2}" > "$FAKE_DIR/agreement.args"
  nodes=$(awk 'prev == "--nodes" {print} {prev = $0}' "$FAKE_DIR/agreement.args")
  software="version=$SOFTWARE_VERSION launch-template-version=$LAUNCH_TEMPLATE_VERSION ami=$AMI_ID"
  software+=" neuron=$NEURON_SOFTWARE"
  echo "PASS node-software: $software on all $nodes nodes"
  exit 0
fi
exec "$(PATH=${PATH//"$(dirname "$0")":/} command -v python3)" "$@"
"""


# ------------------------------------------------------------------ the Neuron release
#: The releases' package versions (scripts/node/neuron_releases.json, copied from Neuron's own
#: manifest, aws-neuron-sdk src/helperscripts/n2-manifest.json, with its source).
NEURON_RELEASES = {
    row["neuron"]: row["packages"]
    for row in json.loads((NODE / "neuron_releases.json").read_text())["releases"]
}
#: `dpkg-query -W -f='${Version}' <package>` as on a DLAMI: the Debian version, upstream and
#: revision ("aws-neuronx-runtime-lib/now 2.27.7.0-765d5f599 amd64 [installed,local]" in
#: Neuron's performance CLI tutorial), no newline; an absent package: status 1 and
#: "dpkg-query: no packages found matching <package>".
FAKE_DPKG_QUERY = """#!/usr/bin/env bash
[[ $1 == -W && $2 == '-f=${Version}' ]] || { echo "fake dpkg-query: unexpected $*" >&2; exit 2; }
f="$FAKE_DIR/dpkg/$3"
[[ -f $f ]] || { echo "dpkg-query: no packages found matching $3" >&2; exit 1; }
printf '%s' "$(cat "$f")"
"""


def neuron_word(neuron: str = "2.29.1") -> str:
    """A release's versions as the agreement compares them (neuron_release.py versions)."""
    packages = NEURON_RELEASES[neuron]
    return (
        f"torch-neuronx:{packages['torch-neuronx']},neuronx-cc:{packages['neuronx-cc']},"
        f"libneuronxla:{packages['libneuronxla']},"
        f"runtime:{packages['aws-neuronx-runtime-lib']},driver:{packages['aws-neuronx-dkms']}"
    )


def neuron_release(node: FakeNode, neuron: str = "2.29.1", venv: Path | None = None) -> None:
    """The node presents Neuron release `neuron` as a DLAMI does: the runtime's Debian package
    (dpkg-query), the loaded driver's /sys/module/neuron/version (here under
    TRAINIUM_SYS_MODULE) and, in `venv` (default: a venv of package metadata only, made the
    node's NEURON_VENV), torch-neuronx, neuronx-cc and libneuronxla's dist-info."""
    packages = NEURON_RELEASES[neuron]
    (node.root / "dpkg").mkdir(exist_ok=True)
    (node.root / "dpkg" / "aws-neuronx-runtime-lib").write_text(
        f"{packages['aws-neuronx-runtime-lib']}-6f1e6c0cc"
    )
    node.tool("dpkg-query", FAKE_DPKG_QUERY)
    set_driver(node, packages["aws-neuronx-dkms"])
    if venv is None:
        venv = node.root / "dlami-venv"
        node.settings["NEURON_VENV"] = str(venv)
    site = next(venv.glob("lib/python3*/site-packages"), venv / "lib/python3.12/site-packages")
    for name in ("torch-neuronx", "neuronx-cc", "libneuronxla"):
        for old in site.glob(f"{name.replace('-', '_')}-*.dist-info"):
            (old / "METADATA").unlink()
            old.rmdir()
        info = site / f"{name.replace('-', '_')}-{packages[name]}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {packages[name]}\n"
        )
    node.write_env()


def set_driver(node: FakeNode, version: str, folder: str = "sys-module") -> Path:
    """The loaded Neuron driver's version file (/sys/module/neuron/version), under `folder`,
    made the node's TRAINIUM_SYS_MODULE; the folder."""
    sys_module = node.root / folder
    (sys_module / "neuron").mkdir(parents=True, exist_ok=True)
    (sys_module / "neuron" / "version").write_text(f"{version}\n")
    node.settings["TRAINIUM_SYS_MODULE"] = str(sys_module)
    node.write_env()
    return sys_module


def healthy_trainium(node: FakeNode) -> None:
    node.tool("python3", FAKE_PYTHON3)
    neuron_release(node)
    (node.root / "fake-agreement").touch()
    node.trainium()
    node.tool("lsmod", "#!/usr/bin/env bash\necho 'neuron 462848 0'\n")
    node.tool("dmesg", "#!/usr/bin/env bash\necho '[ 1.0] neuron: driver loaded'\n")
    node.tool("fi_info", FAKE_FI_INFO)
    node.settings["EFA_DEVICE_COUNT"] = "8"  # trn1.32xlarge (stacks/instance_types.py)
    node.write_env()
    # The operation comes first (NCCOM-TEST user guide); the fake refuses anything else.
    node.tool(
        "nccom-test",
        '#!/usr/bin/env bash\necho "$*" >> "$FAKE_DIR/nccom.log"\n'
        'case $1 in allr|allg|redsct|sendrecv|alltoall) ;; *) echo "unknown operation $1" >&2;'
        " exit 2;; esac\n"
        "echo 'Avg bus bandwidth: 40.1GB/s'\n",
    )


def test_preflight_passes_on_a_healthy_node(node: FakeNode) -> None:
    healthy_trainium(node)
    node.settings["PREFLIGHT_MIN_FREE_GB"] = "0"
    node.write_env()
    (node.root / "node.env").write_text(
        "AMI_ID=ami-0123456789abcdef0\nLAUNCH_TEMPLATE_VERSION=7\nSOFTWARE_VERSION=5f0e2d9c1a7b3e44\n"
    )
    result = node.run_document(
        "Preflight", {"Hosts": "10.1.0.12,10.1.0.40", "Port": "29600"},
        TRAINIUM_NODE_ENV=str(node.root / "node.env"),
    )  # fmt: skip
    output = result.stderr
    assert result.returncode == 0, output
    for check in (
        "ready",
        "neuron-driver",
        "neuron",
        "neuron-hardware",
        "neuron-release",
        "efa",
        "jobs-root",
        "collective",
        "nccom-local",
    ):
        assert re.search(rf"\] PASS {check}: ", output), f"no PASS {check}: {output}"
    assert "nccom-multinode" not in output
    assert "PASS neuron: 16 Neuron devices, 32 NeuronCores, all idle" in output
    assert (
        "PASS neuron-release: Neuron software within the supported range (Neuron 2.29.1): "
        "torch-neuronx "
        "2.9.0.2.13.26312, neuronx-cc 2.24.8799.0, libneuronxla 2.2.16408.0, runtime 2.31.24.0, "
        "driver 2.27.4.0"
    ) in output
    assert (node.root / "nccom.log").read_text().startswith("allr -r 32 -b 8 -e 1MB")
    assert result.stdout.splitlines()[0] == (
        "node-software: version=5f0e2d9c1a7b3e44 launch-template-version=7 "
        "ami=ami-0123456789abcdef0"
    )
    args = node.torchrun_args()
    assert args[:10] == [
        "--nnodes", "2", "--node_rank", "0", "--master_addr", "10.1.0.12", "--master_port",
        "29600", "--nproc_per_node", "32",
    ]  # fmt: skip
    assert node.torchrun_env()["NEURON_RT_ROOT_COMM_ID"] == "10.1.0.12:29601"


#: Mounts a small tmpfs at $1 as the node's scratch volume (bootstrap's phase_scratch makes
#: $SCRATCH_DIR/tmp on it, mode 1777), then runs the rest of the arguments with bash.
ON_SMALL_SCRATCH = (
    'mount -t tmpfs -o size=64m trainium-scratch "$1" && mkdir -m 1777 "$1/tmp" && shift && '
    'exec bash "$@"'
)


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)
def test_preflight_checks_the_free_space_where_the_jobs_temporary_files_go(
    node: FakeNode,
) -> None:
    """On an instance type with instance store, bootstrap puts TMPDIR (the Neuron compiler's
    work directories) on the scratch volume and writes it to node.env: preflight checks the
    free space there, not /tmp's on the root volume. The scratch volume here is a real 64 MiB
    tmpfs (in a mount namespace of the test's own), so df reads 0 GiB free: below
    --min-free-gb 1, while / has more. A TMPDIR that is not there fails the check by name
    (preflight's own temporary files then go to /tmp)."""
    healthy_trainium(node)
    scratch = node.root / "scratch"
    scratch.mkdir()
    (node.root / "node.env").write_text(f"SCRATCH={scratch}\nTMPDIR={scratch}/tmp\n")
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", ON_SMALL_SCRATCH, "sh",
         str(scratch), str(NODE / "preflight.sh"), "--hosts", "10.1.0.12", "--nproc-per-node",
         "1", "--min-free-gb", "1"],
        capture_output=True, text=True, env=node.env(), timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    disk = [line.split("] ", 1)[1] for line in result.stderr.splitlines() if " disk: " in line]
    assert disk[0].startswith("PASS disk: / has "), disk
    assert disk[1:] == [f"FAIL disk: {scratch}/tmp has 0 GiB free, less than --min-free-gb 1"]
    assert "preflight FAILED on 10.1.0.12: disk" in result.stderr

    (node.root / "node.env").write_text(f"TMPDIR={node.root}/gone\n")
    result = node.run("preflight.sh", "--hosts", "10.1.0.12", "--nproc-per-node", "1",
                      "--min-free-gb", "0")  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert (
        f"] FAIL disk: TMPDIR {node.root}/gone (node.env) is not a writable folder: the job's "
        "temporary files cannot go there\n"
    ) in result.stderr
    assert "preflight FAILED on 10.1.0.12: disk" in result.stderr


#: The one line a node outside the range gets (bootstrap and preflight), here for Neuron 2.31.1,
#: whose torch-neuronx 2.9 no longer trains (Neuron's announcement "Neuron no longer supports
#: PyTorch/XLA for training starting with Neuron 2.30").
REFUSED_2_31_1 = (
    "Neuron software outside the supported range: found torch-neuronx 2.9.0.2.15.32035, "
    "neuronx-cc 2.26.6360.0, libneuronxla 2.2.17544.0, runtime 2.33.10.0, driver 2.29.0.0 "
    "(Neuron 2.31.0 or 2.31.1); supported: Neuron 2.27.0 to 2.29.1, the releases that train "
    "with PyTorch/XLA (torch-neuronx 2.9.0.2.11.19912 to 2.9.0.2.13.26312, neuronx-cc "
    "2.22.12471.0 to 2.24.8799.0, libneuronxla 2.2.14584.0 to 2.2.16408.0, runtime 2.29.40.0 "
    "to 2.31.24.0, driver 2.25.4.0 to 2.27.4.0); launch an image of Neuron 2.29.1 (Deep "
    "Learning AMI Neuron PyTorch 2.9 (Ubuntu 24.04), see docs/deploy.md)"
)


@pytest.mark.parametrize(
    ("release", "status"),
    [("2.27.1", 0), ("2.28.1", 0), ("2.29.0", 0), ("2.30.0", 3), ("2.31.1", 3)],
)
def test_preflight_checks_the_neuron_release(node: FakeNode, release: str, status: int) -> None:
    """Inside Neuron 2.27.0 to 2.29.1 the node passes; from 2.30.0 on (torch-neuronx 2.9 still
    shipped, training no longer supported) it is refused in one line, and replaced (exit 3):
    bootstrap refuses such an image, so a node that passed it has had its software changed."""
    healthy_trainium(node)
    neuron_release(node, release, venv=node.root / "dlami-venv")
    result = node.run("preflight.sh", "--hosts", "10.1.0.12", "--nproc-per-node", "1",
                      "--min-free-gb", "0")  # fmt: skip
    assert result.returncode == status, result.stderr
    if status:
        assert f"] FAIL neuron-release: {REFUSED_2_31_1 if release == '2.31.1' else ''}" in (
            result.stderr
        )
        assert "replace this node: its Neuron software is outside the supported range" in (
            result.stderr
        )
    else:
        line = next(x for x in result.stderr.splitlines() if "] PASS neuron-release: " in x)
        assert release in line.split("): ")[0].split(" (Neuron ")[1], line


def test_preflight_reports_busy_cores_and_a_hardware_fault(node: FakeNode) -> None:
    healthy_trainium(node)
    node.trainium(trainium_devices(busy=True))
    node.tool(
        "dmesg",
        "#!/usr/bin/env bash\necho '[ 9.0] NEURON_HW_ERR=SRAM_UNCORRECTABLE_ERROR "
        "instance-id=i-1 action=TERMINATE_INSTANCE'\n",
    )
    result = node.run("preflight.sh", "--hosts", "10.1.0.12", "--min-free-gb", "0")
    assert result.returncode == 3, result.stderr
    assert "FAIL neuron: NeuronCores are in use by processes 4242" in result.stderr
    assert "FAIL neuron-hardware: kernel log reports NEURON_HW_ERR" in result.stderr
    assert "replace this node: it reports a Neuron hardware error" in result.stderr


def test_preflight_fails_without_efa_or_fsx_or_collective(node: FakeNode) -> None:
    healthy_trainium(node)
    node.tool(
        "fi_info", "#!/usr/bin/env bash\necho 'fi_getinfo: -61 (No data available)'\nexit 1\n"
    )
    node.settings["FSX_DNS_NAME"] = "fs-1.fsx.us-east-1.amazonaws.com"
    node.write_env()
    node.tool("mountpoint", "#!/usr/bin/env bash\nexit 1\n")
    result = node.run("preflight.sh", "--hosts", "10.1.0.12,10.1.0.40", "--min-free-gb", "0",
                      FAKE_TORCHRUN_EXIT="1")  # fmt: skip
    assert result.returncode == 1
    assert "FAIL efa: fi_info -p efa found no EFA provider" in result.stderr
    assert (
        f"FAIL fsx: {node.fsx} is not mounted (FSx for Lustre fs-1.fsx.us-east-1.amazonaws.com)"
        in result.stderr
    )
    # A node that failed its local checks runs no all-reduce: the agreement told the others.
    assert "collective: not run: this node failed its local checks (efa fsx)" in result.stderr
    assert not (node.root / "torchrun.args").exists()
    assert "preflight FAILED on 10.1.0.12: efa fsx" in result.stderr
    healthy_trainium(node)
    node.settings.pop("FSX_DNS_NAME")
    node.write_env()
    result = node.run("preflight.sh", "--hosts", "10.1.0.12,10.1.0.40", "--min-free-gb", "0",
                      FAKE_TORCHRUN_EXIT="1")  # fmt: skip
    assert result.returncode == 1
    assert "FAIL collective: all-reduce across 2 nodes failed (status 1)" in result.stderr
    assert "preflight FAILED on 10.1.0.12: collective" in result.stderr


def test_preflight_asks_for_a_replacement_when_an_efa_device_is_lost(node: FakeNode) -> None:
    """A trn1.32xlarge has 8 EFA devices (EFA_DEVICE_COUNT, from the instance type table);
    with 7 it trains at a fraction of the bandwidth: a hardware fault, exit 3."""
    healthy_trainium(node)
    (node.root / "efa-devices").write_text("7")
    result = node.run("preflight.sh", "--hosts", "10.1.0.12,10.1.0.40", "--min-free-gb", "0")
    assert result.returncode == 3, result.stderr
    lines = [m.group(2) for m in map(LOG_LINE.match, result.stderr.splitlines()) if m]
    assert [line for line in lines if line.startswith(("PASS efa", "FAIL efa"))] == [
        "FAIL efa: found 7 EFA devices, expected 8 (trn1.32xlarge): a lost EFA device"
    ]
    assert "replace this node: found 7 of its 8 EFA devices" in lines
    (node.root / "efa-devices").write_text("8")
    result = node.run("preflight.sh", "--hosts", "10.1.0.12,10.1.0.40", "--min-free-gb", "0")
    assert "PASS efa: 8 EFA devices, 8 expected" in result.stderr
    node.settings["EFA_DEVICE_COUNT"] = "eight"
    node.write_env()
    result = node.run("preflight.sh", "--hosts", "10.1.0.12,10.1.0.40", "--min-free-gb", "0")
    assert result.returncode == 1
    assert f"FAIL efa: EFA_DEVICE_COUNT 'eight' in {node.env_file} is not a number of devices" in (
        result.stderr
    )


def test_nccom_test_output_is_its_verdict_whatever_its_exit_status(node: FakeNode) -> None:
    """nccom-test's exit status on a failed check is not documented: its output counts."""
    healthy_trainium(node)
    node.tool(
        "nccom-test",
        "#!/usr/bin/env bash\necho 'size(B) count(elems) type time(us) algbw(GB/s) busbw(GB/s)'\n"
        "echo 'Check: 3 errors found in output buffer of rank 5'\necho 'Test failed'\nexit 0\n",
    )
    result = node.run("preflight.sh", "--hosts", "10.1.0.12", "--min-free-gb", "0")
    assert result.returncode == 1, result.stderr
    assert (
        "FAIL nccom-local: nccom-test all-reduce over 32 NeuronCores failed (status 0, Check: 3 "
        "errors found in output buffer of rank 5 Test failed)" in result.stderr
    )
    node.tool(
        "nccom-test",
        "#!/usr/bin/env bash\necho 'Check: 0 errors found'\necho 'Avg bus bandwidth: 40.1GB/s'\n",
    )
    result = node.run("preflight.sh", "--hosts", "10.1.0.12", "--min-free-gb", "0")
    assert "PASS nccom-local: Avg bus bandwidth: 40.1GB/s" in result.stderr, result.stderr


def test_preflight_raises_the_open_file_limit_and_checks_the_hard_one(node: FakeNode) -> None:
    """Run Command starts scripts with a soft limit of 1024 (systemd's DefaultLimitNOFILE); the
    collective check needs about nodes x processes + 1024 descriptors (lib.sh)."""
    healthy_trainium(node)
    script = NODE / "preflight.sh"
    hosts = "10.1.0.12,10.1.0.40"  # 2 nodes x 32 NeuronCores: 64 + 1024 = 1088
    for hard, expected in (("4096", "PASS open-files: soft limit 4096, about 1088 needed"),
                           ("1050", "FAIL open-files: the open-file hard limit is 1050, below the "
                                    "1088 descriptors the collective check may need (2 nodes x 32 "
                                    "processes + 1024): raise LimitNOFILE of the amazon-ssm-agent "
                                    "unit")):  # fmt: skip
        result = subprocess.run(
            ["bash", "-c", f'ulimit -Sn 1024 && ulimit -Hn {hard} && exec bash "$0" "$@"',
             str(script), "--hosts", hosts, "--min-free-gb", "0"],
            capture_output=True, text=True, env=node.env(), timeout=120, check=False,
        )  # fmt: skip
        assert expected in result.stderr, result.stderr
        assert result.returncode == (0 if expected.startswith("PASS") else 1), result.stderr


def test_preflight_waits_for_the_ready_marker_and_reports_a_missing_one(node: FakeNode) -> None:
    (node.state / "ready").unlink()
    result = node.run("preflight.sh", "--hosts", "10.1.0.12", "--wait-ready", "0",
                      "--nproc-per-node", "1", "--min-free-gb", "0")  # fmt: skip
    assert result.returncode == 1
    assert "FAIL ready: bootstrap has not finished after 0 s" in result.stderr


def test_preflight_asks_for_a_replacement_when_bootstrap_failed(node: FakeNode) -> None:
    """bootstrap.sh leaves $STATE_DIR/failed ("<time> <error>") when it fails, on any boot; no
    retry on this node helps: preflight exits 3, on which the job supervisor replaces it."""
    (node.state / "ready").unlink()
    error = "'modprobe lustre' failed with status 1 at bootstrap.sh line 412 (phase fsx)"
    (node.state / "failed").write_text(f"2026-01-01T00:00:00Z {error}\n")
    result = node.run("preflight.sh", "--hosts", "10.1.0.12", "--wait-ready", "900",
                      "--nproc-per-node", "1", "--min-free-gb", "0")  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert f"FAIL ready: bootstrap failed: 2026-01-01T00:00:00Z {error}" in result.stderr
    assert f"replace this node: bootstrap failed on this boot: {error}" in result.stderr


def preflight_on_two_nodes(
    node: FakeNode,
    versions: tuple[str | None, str | None],
    args: tuple[list[str], list[str]] = ([], []),
    node_settings: tuple[str, str] = ("", ""),
    envs: tuple[dict[str, str], dict[str, str]] = ({}, {}),
) -> list[subprocess.CompletedProcess[str]]:
    """preflight.sh on two loopback nodes at once, with the project's own torchrun running
    collective_check.py for real (gloo); each node's node.env carries its SOFTWARE_VERSION
    (None: no node.env, as on nodes older than the variables); `args` are each node's own
    extra arguments, `node_settings` lines added to each node's node.env and `envs` each
    node's own environment variables."""
    healthy_trainium(node)
    (node.root / "fake-agreement").unlink()  # the real agreement, over real sockets
    env = real_torchrun(node)
    node.settings["PREFLIGHT_MIN_FREE_GB"] = "0"
    node.write_env()
    hosts, port = ("127.0.0.1", "127.0.0.2"), str(free_ports(3))
    runs = []
    for address, version, extra, lines, own in zip(
        hosts, versions, args, node_settings, envs, strict=True
    ):
        node_env = node.root / f"node-{address}.env"
        if version is not None:
            node_env.write_text(
                f"AMI_ID=ami-0123456789abcdef0\nLAUNCH_TEMPLATE_VERSION=7\nSOFTWARE_VERSION={version}\n"
                + lines
            )
        command = [
            "bash", str(NODE / "preflight.sh"), "--hosts", ",".join(hosts), "--port", port,
            "--node-address", address, "--nproc-per-node", "1", *extra,
        ]  # fmt: skip
        runs.append(subprocess.Popen(
            command, env=node.env(**{**env, **own}, TRAINIUM_NODE_ENV=str(node_env)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))  # fmt: skip
    results = []
    for run in runs:
        stdout, stderr = run.communicate(timeout=180)
        results.append(subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr))
    return results


def test_preflight_fails_where_the_nodes_run_different_software(node: FakeNode) -> None:
    """The supervisor only sees exit codes: the nodes themselves must refuse a mixed fleet,
    with status 4, which the supervisor ends the job on (stacks/supervisor.py
    ROLL_FLEET_STATUS): not 3 (no node is to be replaced: the fleet is to be rolled), not 1
    (a retry on the same nodes would fail the same way)."""
    results = preflight_on_two_nodes(node, ("5f0e2d9c1a7b3e44", "0badc0ffee000001"))
    expected = (
        "FAIL node-software: the nodes run different software: node 0 (127.0.0.1) runs "
        f"version=5f0e2d9c1a7b3e44 launch-template-version=7 ami=ami-0123456789abcdef0 "
        f"neuron={neuron_word()}; node 1 (127.0.0.2) runs version=0badc0ffee000001 "
        f"launch-template-version=7 ami=ami-0123456789abcdef0 neuron={neuron_word()}: roll "
        "the fleet so that every node runs the current "
        "launch template (python scripts/cluster.py roll, see the README)"
    )
    for address, result in zip(("127.0.0.1", "127.0.0.2"), results, strict=True):
        assert result.returncode == ROLL_FLEET_STATUS == 4, result.stderr
        lines = [m.group(2) for m in map(LOG_LINE.match, result.stderr.splitlines()) if m]
        verdicts = [line for line in lines if re.match(r"(PASS|FAIL) node-software: ", line)]
        assert verdicts == [expected], result.stderr
        assert "collective" not in "".join(lines), "no all-reduce runs on a mixed fleet"
        assert f"preflight FAILED on {address}: node-software" in result.stderr


def test_preflight_fails_where_the_nodes_run_different_neuron_releases(node: FakeNode) -> None:
    """Same launch template and AMI, but node 1's driver is Neuron 2.28.1's (a node whose
    driver was changed after launch): the agreement compares the Neuron release's versions
    too, and refuses the mixed fleet (status 4) naming both."""
    other = set_driver(node, NEURON_RELEASES["2.28.1"]["aws-neuronx-dkms"], "sys-module-other")
    results = preflight_on_two_nodes(
        node, ("5f0e2d9c1a7b3e44", "5f0e2d9c1a7b3e44"),
        node_settings=("", f"TRAINIUM_SYS_MODULE={other}\n"),
    )  # fmt: skip
    mixed = neuron_word().replace("driver:2.27.4.0", "driver:2.26.10.0")
    for result in results:
        assert result.returncode == ROLL_FLEET_STATUS, result.stderr
        assert (
            "FAIL node-software: the nodes run different software: node 0 (127.0.0.1) runs "
            "version=5f0e2d9c1a7b3e44 launch-template-version=7 ami=ami-0123456789abcdef0 "
            f"neuron={neuron_word()}; node 1 (127.0.0.2) runs version=5f0e2d9c1a7b3e44 "
            f"launch-template-version=7 ami=ami-0123456789abcdef0 neuron={mixed}: roll"
        ) in result.stderr


def test_preflight_passes_where_the_nodes_run_the_same_software(node: FakeNode) -> None:
    results = preflight_on_two_nodes(node, ("5f0e2d9c1a7b3e44", "5f0e2d9c1a7b3e44"))
    for result in results:
        assert result.returncode == 0, result.stderr
        assert (
            "PASS node-software: version=5f0e2d9c1a7b3e44 launch-template-version=7 "
            f"ami=ami-0123456789abcdef0 neuron={neuron_word()} on all 2 nodes"
        ) in result.stderr
        assert "PASS collective: all-reduce across 2 nodes x 1 processes" in result.stderr


def test_a_node_that_failed_a_local_check_does_not_hold_up_the_others(node: FakeNode) -> None:
    """Node 1 fails a local check (disk). It still takes part in the agreement, says so there,
    and the healthy node 0 fails at once, naming it, instead of starting an all-reduce that
    node 1 would join with other settings, or not at all, and waiting for the rendezvous
    (torchrun's static rendezvous: 600 s) or the process group (300 s) to time out."""
    start = time.monotonic()
    results = preflight_on_two_nodes(
        node, ("5f0e2d9c1a7b3e44", "5f0e2d9c1a7b3e44"), ([], ["--min-free-gb", "999999"])
    )
    elapsed = time.monotonic() - start
    healthy, broken = results
    assert healthy.returncode == 1, healthy.stderr
    assert (
        "FAIL collective: not run: failed local checks on node 1 (127.0.0.2): disk\n"
        in healthy.stderr
    )
    assert "preflight FAILED on 127.0.0.1: collective" in healthy.stderr
    assert broken.returncode == 1, broken.stderr
    assert "collective: not run: this node failed its local checks (disk disk)" in broken.stderr
    assert "all-reduce" not in healthy.stderr + broken.stderr
    assert elapsed < 120, f"{elapsed:.0f} s: the healthy node waited for the broken one"


def test_a_node_without_torchrun_still_tells_the_others(node: FakeNode) -> None:
    """Node 1 has no torchrun (a broken Neuron venv). The agreement needs only the standard
    library's python3, so node 1 still takes part and says so, and node 0 fails at once,
    naming it, rather than after the agreement's timeout (--wait-ready + 180 s: 1,080 s)."""
    no_torchrun = {"PATH": f"{node.bin}:/usr/bin:/bin:/usr/sbin:/sbin"}
    healthy, broken = preflight_on_two_nodes(
        node, ("5f0e2d9c1a7b3e44", "5f0e2d9c1a7b3e44"), envs=({}, no_torchrun)
    )
    assert broken.returncode == 1, broken.stderr
    assert re.search(
        r"FAIL collective: torchrun not found \(NEURON_VENV=\S+\): this node cannot join the "
        r"all-reduce\n",
        broken.stderr,
    ), broken.stderr
    assert healthy.returncode == 1, healthy.stderr
    assert (
        "FAIL collective: not run: failed local checks on node 1 (127.0.0.2): collective\n"
        in healthy.stderr
    )
    assert "all-reduce across" not in healthy.stderr + broken.stderr


def test_the_agreement_names_a_node_that_never_reports() -> None:
    """A node whose preflight never reaches the agreement (no Python, not started) holds the
    others only until the agreement's --timeout (preflight: --wait-ready + 180 s)."""
    port = free_ports(1)
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(NODE / "agreement.py"), "--master-addr",
         "127.0.0.1", "--port", str(port), "--node-rank", "0", "--nodes", "3",
         "--node-address", "127.0.0.1", "--timeout", "5"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stdout.splitlines() == [
        "FAIL collective: not run: node 1, 2 did not report within 5 s (its preflight did not "
        "start or could not run Python)"
    ]
    assert time.monotonic() - start < 60
    bad = subprocess.run(
        [sys.executable, str(NODE / "agreement.py"), "--nodes", "2"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.splitlines()[-1] == (
        "agreement.py: error: the following arguments are required: --master-addr, --port, "
        "--node-rank, --node-address"
    )


# A process in a mount namespace of its own with a rehearsal node's mounts (the node agent's
# own mount()), running the node's reader of its Neuron release as preflight does.
PRESENTED = """
import json, subprocess, sys
sys.path.insert(0, sys.argv[2])
from scripts.rehearsal.node_agent import mount
for spec in json.loads(open(sys.argv[1]).read()):
    mount(spec)
command = ["python3", "/opt/trainium-cluster/scripts/node/neuron_release.py", "check", "--venv",
           "/opt/aws_neuronx_venv_pytorch_2_9"]
env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
sys.exit(subprocess.run(command, env=env, check=False).returncode)
"""


@pytest.mark.netns
def test_a_rehearsal_node_presents_the_default_images_neuron_release(tmp_path: Path) -> None:
    """The rehearsal's nodes (scripts/rehearsal/instances.py) show their Neuron release where a
    DLAMI does, so that bootstrap's and preflight's reader sees Neuron 2.29.1 there exactly as
    on a node of the stack's default image."""
    from types import SimpleNamespace

    from scripts.rehearsal.instances import Instance, Instances

    stand_in = object.__new__(Instances)
    stand_in.hosts = SimpleNamespace(count=1)  # type: ignore[assignment]
    stand_in.output, stand_in.cluster_name, stand_in.cores_per_node = tmp_path, "rehearsal", 2
    stand_in.node_settings, stand_in.software_version = {}, "0123456789abcdef"
    stand_in.python = sys.executable
    instance = Instance(0, "i-0000000000000000a", "127.0.0.1", tmp_path / "node")
    mounts = tmp_path / "mounts.json"
    mounts.write_text(json.dumps(stand_in.lay_out(instance)))
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", PRESENTED,
         str(mounts), str(NODE.parent.parent)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == (
        "Neuron software within the supported range (Neuron 2.29.1): torch-neuronx "
        "2.9.0.2.13.26312, neuronx-cc 2.24.8799.0, libneuronxla 2.2.16408.0, runtime 2.31.24.0, "
        "driver 2.27.4.0\n"
    )
