"""preflight.sh, the checks a node passes before a job, against fake node tools.

The fake node is tests/node_support.py.
"""

from __future__ import annotations

import re
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

# With $FAKE_DIR/fake-agreement, `python3 collective_check.py --agree ...` answers as the real
# agreement does when every node passed and runs the same software (the fake torchrun, from
# tests/node_support.py, answers for the all-reduce); everything else, and the agreement
# without that file, runs the next python3 on PATH.
FAKE_PYTHON3 = """#!/usr/bin/env bash
if [[ -f "$FAKE_DIR/fake-agreement" && $1 == collective_check.py && $2 == --agree ]]; then
  printf '%s\\n' "${@:3}" > "$FAKE_DIR/agreement.args"
  nodes=$(awk 'prev == "--nodes" {print} {prev = $0}' "$FAKE_DIR/agreement.args")
  software="version=$SOFTWARE_VERSION launch-template-version=$LAUNCH_TEMPLATE_VERSION ami=$AMI_ID"
  echo "PASS node-software: $software on all $nodes nodes"
  exit 0
fi
PATH=${PATH//"$(dirname "$0")":/}
exec python3 "$@"
"""


def healthy_trainium(node: FakeNode) -> None:
    node.tool("python3", FAKE_PYTHON3)
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
        "efa",
        "jobs-root",
        "collective",
        "nccom-local",
    ):
        assert re.search(rf"\] PASS {check}: ", output), f"no PASS {check}: {output}"
    assert "nccom-multinode" not in output
    assert "PASS neuron: 16 Neuron devices, 32 NeuronCores, all idle" in output
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
) -> list[subprocess.CompletedProcess[str]]:
    """preflight.sh on two loopback nodes at once, with the project's own torchrun running
    collective_check.py for real (gloo); each node's node.env carries its SOFTWARE_VERSION
    (None: no node.env, as on nodes older than the variables); `args` are each node's own
    extra arguments."""
    healthy_trainium(node)
    (node.root / "fake-agreement").unlink()  # the real agreement, through a real TCPStore
    env = real_torchrun(node)
    node.settings["PREFLIGHT_MIN_FREE_GB"] = "0"
    node.write_env()
    hosts, port = ("127.0.0.1", "127.0.0.2"), str(free_ports(3))
    runs = []
    for address, version, extra in zip(hosts, versions, args, strict=True):
        node_env = node.root / f"node-{address}.env"
        if version is not None:
            node_env.write_text(
                f"AMI_ID=ami-0123456789abcdef0\nLAUNCH_TEMPLATE_VERSION=7\nSOFTWARE_VERSION={version}\n"
            )
        command = [
            "bash", str(NODE / "preflight.sh"), "--hosts", ",".join(hosts), "--port", port,
            "--node-address", address, "--nproc-per-node", "1", *extra,
        ]  # fmt: skip
        runs.append(subprocess.Popen(
            command, env=node.env(**env, TRAINIUM_NODE_ENV=str(node_env)),
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
        "version=5f0e2d9c1a7b3e44 launch-template-version=7 ami=ami-0123456789abcdef0; "
        "node 1 (127.0.0.2) runs version=0badc0ffee000001 launch-template-version=7 "
        "ami=ami-0123456789abcdef0: roll the fleet so that every node runs the current "
        "launch template (python scripts/cluster.py roll, see the README)"
    )
    for address, result in zip(("127.0.0.1", "127.0.0.2"), results, strict=True):
        assert result.returncode == ROLL_FLEET_STATUS == 4, result.stderr
        lines = [m.group(2) for m in map(LOG_LINE.match, result.stderr.splitlines()) if m]
        verdicts = [line for line in lines if re.match(r"(PASS|FAIL) node-software: ", line)]
        assert verdicts == [expected], result.stderr
        assert "collective" not in "".join(lines), "no all-reduce runs on a mixed fleet"
        assert f"preflight FAILED on {address}: node-software" in result.stderr


def test_preflight_passes_where_the_nodes_run_the_same_software(node: FakeNode) -> None:
    results = preflight_on_two_nodes(node, ("5f0e2d9c1a7b3e44", "5f0e2d9c1a7b3e44"))
    for result in results:
        assert result.returncode == 0, result.stderr
        assert (
            "PASS node-software: version=5f0e2d9c1a7b3e44 launch-template-version=7 "
            "ami=ami-0123456789abcdef0 on all 2 nodes"
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


def test_the_agreement_names_a_node_that_never_reports() -> None:
    """A node whose preflight never reaches the agreement (no Python, not started) holds the
    others only until the agreement's --timeout (preflight: --wait-ready + 180 s)."""
    port = free_ports(1)
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(NODE / "collective_check.py"), "--agree", "--master-addr",
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
        [sys.executable, str(NODE / "collective_check.py"), "--agree", "--nodes", "2"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "--agree needs --master-addr --port --node-rank --node-address" in bad.stderr
