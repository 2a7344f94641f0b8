"""The Run Command stand-in's instances: the nodes its EC2 and Auto Scaling answer for.

Each instance lives in one slot of the rehearsal's network namespaces (hosts.py) and gets a file
system laid out like the Neuron DLAMI's, in overlay folders its node agent mounts over /etc, /opt,
/var and /usr/local in a mount namespace of its own: fake Neuron and EFA tools at their DLAMI
paths, the venv at /opt/aws_neuronx_venv_pytorch_2_9, the node scripts and the workload at
/opt/trainium-cluster, cluster.env and node.env in /etc/trainium-cluster. Its agent
(node_agent.py) then runs the commands the SSM stand-in (ssm_stand_in.py) drops into its spool
folder. A replaced instance gets a new ID in the same slot.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from scripts.cluster_lib import REPO_ROOT, ClusterError
from scripts.rehearsal.hosts import NetnsHosts

REGION = "us-east-1"
ZONE = "us-east-1a"
NEURON_VENV = "/opt/aws_neuronx_venv_pytorch_2_9"
INSTALL_ROOT = "/opt/trainium-cluster"
INSTANCE_TYPE = "trn1.32xlarge"
IMAGE_ID = "ami-0000000000rehearsal"

# Fake Neuron and EFA tools, installed at their DLAMI paths inside each node. neuron-ls
# reports one device whose cores are "in use" by the trainers running in this node's network
# namespace, as the real one lists the processes that hold NeuronCores.
FAKE_NEURON_LS = r"""#!/bin/sh
[ "$1" = -j ] || { echo "neuron-ls (rehearsal): only -j is supported" >&2; exit 2; }
echo "WARNING: rehearsal node: no real Neuron device" >&2
own=$(readlink /proc/self/ns/net)
busy=""
for dir in /proc/[0-9]*; do
  [ "$(readlink "$dir/ns/net" 2>/dev/null)" = "$own" ] || continue
  cmd=$(tr '\0' ' ' < "$dir/cmdline" 2>/dev/null) || continue
  case $cmd in
    *train.py*) busy="$busy{\"pid\": ${dir#/proc/}, \"command\": \"train.py\"}," ;;
  esac
done
busy=${busy%,}
printf '[{"neuron_device": 0, "bdf": "00:1e.0", "nc_count": %s, ' "__CORES__"
printf '"memory_size": 34359738368, "neuron_processes": [%s]}]\n' "$busy"
"""
FAKE_NCCOM_TEST = """#!/bin/sh
case $1 in
  allr|allg|redsct|sendrecv|alltoall) ;;
  *) echo "nccom-test (rehearsal): the operation comes first, got '$1'" >&2; exit 2 ;;
esac
echo "Avg bus bandwidth: 1.0GB/s (rehearsal)"
"""
FAKE_FI_INFO = """#!/bin/sh
echo "provider: efa"
echo "    fabric: efa"
echo "    domain: rdmap0s0-rdm"
"""
FAKE_LSMOD = """#!/bin/sh
echo "Module                  Size  Used by"
echo "neuron                462848  0"
"""
FAKE_DMESG = """#!/bin/sh
echo "[    1.000000] neuron: driver loaded (rehearsal node)"
"""


def now() -> datetime:
    return datetime.now(UTC)


@dataclass
class Instance:
    slot: int
    instance_id: str
    address: str
    root: Path
    state: str = "running"
    launched: datetime = field(default_factory=now)
    agent: subprocess.Popen[bytes] | None = None
    health: str = "Healthy"

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    def online(self) -> bool:
        return self.state == "running" and self.agent is not None and self.agent.poll() is None


def software_version() -> str:
    """What the nodes report as SOFTWARE_VERSION: a digest of the node scripts and the
    workload, as they are in this checkout."""
    digest = hashlib.sha256()
    for folder in ("scripts/node", "workload"):
        for path in sorted((REPO_ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class Instances:
    """The stand-in's instances, one launched per host slot at the start."""

    def __init__(
        self,
        hosts: NetnsHosts,
        output: Path,
        ids: Iterator[int],
        *,
        cluster_name: str,
        cores_per_node: int,
        node_settings: dict[str, str],
        python: str = sys.executable,
    ) -> None:
        self.hosts = hosts
        self.output = output
        #: The stand-in's one counter of IDs (instances and commands).
        self.ids = ids
        self.cluster_name = cluster_name
        self.cores_per_node = cores_per_node
        #: Lines every node's cluster.env gets after the rehearsal's own (launch.sh exports
        #: them to the job), e.g. TRAINIUM_HOLD_AFTER_STEP (workload/stop.py).
        self.node_settings = node_settings
        self.python = python
        self.software_version = software_version()
        self.instances: list[Instance] = []
        for slot in range(hosts.count):
            self.instances.append(self.launch(slot))

    def launch(self, slot: int) -> Instance:
        """Starts a node: its DLAMI-like file system and its agent, in the slot's namespace."""
        instance_id = f"i-{next(self.ids):017x}"
        root = self.output / "nodes" / instance_id
        shutil.rmtree(root, ignore_errors=True)
        instance = Instance(slot, instance_id, self.hosts.addresses[slot], root)
        mounts = self.lay_out(instance)
        (root / "mounts.json").write_text(json.dumps(mounts))
        log = (root / "agent.log").open("ab")
        instance.agent = subprocess.Popen(
            self.hosts.command(
                slot,
                [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    self.python,
                    str(Path(__file__).with_name("node_agent.py")),
                    "--spool",
                    str(instance.spool),
                    "--mounts",
                    str(root / "mounts.json"),
                ],
            ),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while not (instance.spool / "agent.json").is_file():
            if instance.agent.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(
                    f"the rehearsal node agent of {instance_id} did not start: "
                    f"{(root / 'agent.log').read_text().strip()[-500:]}"
                )
            time.sleep(0.1)
        return instance

    def lay_out(self, instance: Instance) -> list[dict[str, str]]:
        """Writes the node's files into overlay upper folders; returns the mounts."""
        root = instance.root
        mounts: list[dict[str, str]] = []
        uppers = {}
        for target in ("/etc", "/opt", "/var", "/usr/local"):
            name = target.strip("/").replace("/", "-")
            upper, work = root / "upper" / name, root / "work" / name
            upper.mkdir(parents=True)
            work.mkdir(parents=True)
            uppers[target] = upper
            mounts.append(
                {"type": "overlay", "target": target, "upper": str(upper), "work": str(work)}
            )

        def install(target: str, relative: str, text: str, mode: int = 0o755) -> None:
            path = uppers[target] / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            path.chmod(mode)

        install(
            "/opt",
            "aws/neuron/bin/neuron-ls",
            FAKE_NEURON_LS.replace("__CORES__", str(self.cores_per_node)),
        )
        install("/opt", "aws/neuron/bin/nccom-test", FAKE_NCCOM_TEST)
        install("/opt", "amazon/efa/bin/fi_info", FAKE_FI_INFO)
        install("/usr/local", "sbin/lsmod", FAKE_LSMOD)
        install("/usr/local", "sbin/dmesg", FAKE_DMESG)
        settings = {
            "CLUSTER_NAME": self.cluster_name,
            "AWS_REGION": REGION,
            "INSTANCE_TYPE": INSTANCE_TYPE,
            "NODE_COUNT": str(self.hosts.count),
            "FSX_MOUNT_POINT": str(self.output),
            "WORKLOAD_DIR": f"{INSTALL_ROOT}/workload",
            "NEURON_VENV": NEURON_VENV,
            "METRICS_NAMESPACE": "TrainiumCluster",
            "SOFTWARE_VERSION": self.software_version,
            "PREFLIGHT_MIN_FREE_GB": "1",
            # Rehearsal nodes share two cores and have no network beyond the bridge.
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            **self.node_settings,
        }
        install("/etc", "trainium-cluster/cluster.env",
                "".join(f"{k}={v}\n" for k, v in settings.items()), 0o644)  # fmt: skip
        node_env = {
            "AMI_ID": IMAGE_ID,
            "LAUNCH_TEMPLATE_VERSION": "1",
            "SOFTWARE_VERSION": self.software_version,
        }
        install("/etc", "trainium-cluster/node.env",
                "".join(f"{k}={v}\n" for k, v in node_env.items()), 0o644)  # fmt: skip
        install("/var", "lib/trainium-cluster/ready", "ready (rehearsal node)\n", 0o644)
        (uppers["/var"] / "log" / "trainium-cluster").mkdir(parents=True)
        for target in (NEURON_VENV, f"{INSTALL_ROOT}/scripts/node", f"{INSTALL_ROOT}/workload"):
            (uppers["/opt"] / target.removeprefix("/opt/")).mkdir(parents=True, exist_ok=True)
        venv = Path(self.python).parent.parent
        mounts += [
            {"type": "bind", "source": str(venv), "target": NEURON_VENV},
            {"type": "bind", "source": str(REPO_ROOT / "scripts" / "node"),
             "target": f"{INSTALL_ROOT}/scripts/node"},
            {"type": "bind", "source": str(REPO_ROOT / "workload"),
             "target": f"{INSTALL_ROOT}/workload"},
        ]  # fmt: skip
        return mounts

    def node_pids(self, slot: int) -> list[int]:
        return self.hosts.pids(slot)

    def terminate(self, instance: Instance) -> None:
        """The instance goes away: every process in its namespace dies, the agent too."""
        instance.state = "terminated"
        self.hosts.kill(instance.slot)
        if instance.agent is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                instance.agent.wait(timeout=10)

    def replace(self, instance: Instance) -> Instance:
        """The instance goes away and a new one starts in its slot."""
        self.terminate(instance)
        replacement = self.launch(instance.slot)
        self.instances.append(replacement)
        return replacement

    def close(self) -> None:
        for instance in self.instances:
            if instance.state == "running":
                self.terminate(instance)

    def running(self) -> list[Instance]:
        return [i for i in self.instances if i.state == "running"]

    def instance(self, instance_id: str) -> Instance | None:
        return next((i for i in self.instances if i.instance_id == instance_id), None)
