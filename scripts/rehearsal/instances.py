"""The Run Command stand-in's instances: the nodes its EC2 and Auto Scaling answer for.

Each instance lives in one slot of the rehearsal's network namespaces (hosts.py) and gets a file
system laid out like the Neuron DLAMI's, in overlay folders its node agent mounts over /etc, /opt,
/var and /usr/local in a mount namespace of its own: fake Neuron and EFA tools at their DLAMI
paths, the venv at /opt/aws_neuronx_venv_pytorch_2_9, the node scripts at
/opt/trainium-cluster, cluster.env and node.env in /etc/trainium-cluster. Its agent
(node_agent.py) then runs the commands the SSM stand-in (ssm_stand_in.py) drops into its spool
folder. A replaced instance gets a new ID in the same slot.

Faults a rehearsal can give a node (tests/test_fault_rehearsals.py): `reboot` (every process
dies, the agent starts again, and the node is left as its bootstrap leaves it, failed or
ready), `sigkill` (SIGKILL from outside the agent to the process the kernel's OOM killer
picks, or to torchrun) and `remove_efa_device` (fi_info lists one EFA device fewer).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from scripts.cluster_lib import REPO_ROOT, ClusterError
from scripts.node.neuron_release import load_table
from scripts.rehearsal.hosts import NetnsHosts
from stacks.instance_types import INSTANCE_TYPES

REGION = "us-east-1"
ZONE = "us-east-1a"
NEURON_VENV = "/opt/aws_neuronx_venv_pytorch_2_9"
INSTALL_ROOT = "/opt/trainium-cluster"
INSTANCE_TYPE = "trn1.32xlarge"
IMAGE_ID = "ami-0000000000rehearsal"
CLUSTER_ENV = "/etc/trainium-cluster/cluster.env"
#: Bootstrap's markers (scripts/node/lib.sh READY_MARKER, bootstrap.sh FAILED_MARKER).
READY_MARKER = "/var/lib/trainium-cluster/ready"
BOOTSTRAP_FAILED_MARKER = "/var/lib/trainium-cluster/failed"

# Fake Neuron and EFA tools, installed at their DLAMI paths inside each node. neuron-ls
# reports one device whose cores are "in use" by the trainers running in this node's network
# namespace, as the real one lists the processes that hold NeuronCores.
FAKE_NEURON_LS = r"""#!/bin/bash
[ "$1" = -j ] || { echo "neuron-ls (rehearsal): only -j is supported" >&2; exit 2; }
echo "WARNING: rehearsal node: no real Neuron device" >&2
busy=""
# One grep over every command line ([t]: not grep's own), then this node's among them (`-ef`:
# the same namespace inode), rather than a readlink and a tr for each process.
for file in $(grep -l '[t]rain\.py' /proc/[0-9]*/cmdline 2>/dev/null); do
  dir=${file%/cmdline}
  [ "$dir/ns/net" -ef /proc/self/ns/net ] || continue
  busy="$busy{\"pid\": ${dir#/proc/}, \"command\": \"train.py\"},"
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
# fi_info lists the node's EFA devices, one per line of EFA_DEVICES (a test takes one away
# with `Instances.remove_efa_device`), in the form `fi_info -p efa -t FI_EP_RDM` prints on an
# EFA instance: one block per device, its domain the device's name with "-rdm" (the RDM
# endpoint; "-dgrm" for FI_EP_DGRAM). Without a device, fi_getinfo fails with -FI_ENODATA:
# fi_info prints "fi_getinfo: -61 (No data available)" and exits 61 (libfabric util/info.c:
# print_short_info, run, and main's `return -ret`).
EFA_DEVICES = "/opt/amazon/efa/rehearsal-devices"
FAKE_FI_INFO = r"""#!/bin/sh
provider="" type=""
while [ $# -gt 0 ]; do
  case $1 in
    -p|--provider) provider=$2; shift 2 ;;
    -t|--ep_type) type=$2; shift 2 ;;
    *) echo "fi_info (rehearsal): only -p and -t are supported, got '$1'" >&2; exit 2 ;;
  esac
done
found=0
for device in $(cat __DEVICES__ 2>/dev/null); do
  for kind in FI_EP_RDM FI_EP_DGRAM; do
    [ -z "$type" ] || [ "$type" = "$kind" ] || continue
    [ -z "$provider" ] || [ "$provider" = efa ] || continue
    suffix=rdm
    [ "$kind" = FI_EP_DGRAM ] && suffix=dgrm
    echo "provider: efa"
    echo "    fabric: efa"
    echo "    domain: $device-$suffix"
    echo "    version: 122.0"
    echo "    type: $kind"
    echo "    protocol: FI_PROTO_EFA"
    found=1
  done
done
if [ $found = 0 ]; then
  echo "fi_getinfo: -61 (No data available)" >&2
  exit 61
fi
""".replace("__DEVICES__", EFA_DEVICES)
FAKE_LSMOD = """#!/bin/sh
echo "Module                  Size  Used by"
echo "neuron                462848  0"
"""
FAKE_DMESG = """#!/bin/sh
echo "[    1.000000] neuron: driver loaded (rehearsal node)"
"""
# The Neuron release a node presents: the one the stack's default image carries
# (neuron_releases.json), each of its five versions where a DLAMI shows it and
# scripts/node/neuron_release.py reads it: torch-neuronx, neuronx-cc and libneuronxla as
# package metadata in the Neuron venv's site-packages (an overlay over the venv), the
# runtime's Debian package through dpkg-query (a Debian version: upstream-revision), the
# loaded driver's /sys/module/neuron/version (a folder mounted over /sys/module in the node's
# mount namespace).
FAKE_DPKG_QUERY = r"""#!/bin/sh
if [ "$1" = -W ] && [ "$2" = '-f=${Version}' ] && [ "$3" = aws-neuronx-runtime-lib ]; then
  printf '%s' "__RUNTIME__-6f1e6c0cc"
  exit 0
fi
exec /usr/bin/dpkg-query "$@"
"""
NEURON_PIP_PACKAGES = ("torch-neuronx", "neuronx-cc", "libneuronxla")


def presented_release() -> dict[str, str]:
    """The package versions of the release the default image carries."""
    table = load_table()
    release = table["image"]["neuron"]
    packages: dict[str, str] = next(
        row["packages"] for row in table["releases"] if row["neuron"] == release
    )
    return packages


def now() -> datetime:
    return datetime.now(UTC)


def _proc(pid: int, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_text(errors="replace")
    except OSError:
        return ""


@dataclass(frozen=True)
class Killed:
    """A process a fault killed: its PID and command line."""

    pid: int
    command: str


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
    """What the nodes report as SOFTWARE_VERSION: a digest of the node scripts, as they are
    in this checkout (a job's code travels as its snapshot, not as node software)."""
    digest = hashlib.sha256()
    for path in sorted((REPO_ROOT / "scripts" / "node").rglob("*")):
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
        self.node_settings = dict(node_settings)
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
        self.start_agent(instance)
        return instance

    def start_agent(self, instance: Instance) -> None:
        """Starts the node's agent (at boot): it mounts the node's file system in a mount
        namespace of its own and serves the spool."""
        root, instance_id, slot = instance.root, instance.instance_id, instance.slot
        (instance.spool / "agent.json").unlink(missing_ok=True)
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

    def cluster_env(self) -> str:
        """The nodes' cluster.env: the rehearsal's settings, then the node settings."""
        settings = {
            "CLUSTER_NAME": self.cluster_name,
            "AWS_REGION": REGION,
            "INSTANCE_TYPE": INSTANCE_TYPE,
            "NODE_COUNT": str(self.hosts.count),
            "FSX_MOUNT_POINT": str(self.output),
            "NEURON_VENV": NEURON_VENV,
            "METRICS_NAMESPACE": "TrainiumCluster",
            "SOFTWARE_VERSION": self.software_version,
            "PREFLIGHT_MIN_FREE_GB": "1",
            # The instance type's EFA devices: preflight expects fi_info to list that many.
            "EFA_DEVICE_COUNT": str(INSTANCE_TYPES[INSTANCE_TYPE].efa_interfaces),
            # Rehearsal nodes share two cores and have no network beyond the bridge.
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            **self.node_settings,
        }
        return "".join(f"{k}={v}\n" for k, v in settings.items())

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
        devices = [f"rdmap{n}s0" for n in range(INSTANCE_TYPES[INSTANCE_TYPE].efa_interfaces)]
        install("/opt", EFA_DEVICES.removeprefix("/opt/"), "".join(f"{d}\n" for d in devices),
                0o644)  # fmt: skip
        install("/usr/local", "sbin/lsmod", FAKE_LSMOD)
        install("/usr/local", "sbin/dmesg", FAKE_DMESG)
        install("/etc", "trainium-cluster/cluster.env", self.cluster_env(), 0o644)
        node_env = {
            "AMI_ID": IMAGE_ID,
            "LAUNCH_TEMPLATE_VERSION": "1",
            "SOFTWARE_VERSION": self.software_version,
        }
        if INSTANCE_TYPES[INSTANCE_TYPE].instance_store_volumes:
            # bootstrap's phase_scratch mounts the instance store at SCRATCH_DIR and gives the
            # jobs TMPDIR on it (node.env); the rehearsal node's scratch is a folder of its own,
            # so its jobs' temporary files (torchrun's among them) stay with the node.
            scratch = instance.root / "scratch"
            (scratch / "tmp").mkdir(parents=True)
            (scratch / "tmp").chmod(0o1777)
            node_env.update(SCRATCH=str(scratch), TMPDIR=str(scratch / "tmp"))
        install("/etc", "trainium-cluster/node.env",
                "".join(f"{k}={v}\n" for k, v in node_env.items()), 0o644)  # fmt: skip
        install("/var", "lib/trainium-cluster/ready", "ready (rehearsal node)\n", 0o644)
        (uppers["/var"] / "log" / "trainium-cluster").mkdir(parents=True)
        for target in (NEURON_VENV, f"{INSTALL_ROOT}/scripts/node"):
            (uppers["/opt"] / target.removeprefix("/opt/")).mkdir(parents=True, exist_ok=True)
        venv = Path(self.python).parent.parent
        mounts += [
            {"type": "bind", "source": str(venv), "target": NEURON_VENV},
            {"type": "bind", "source": str(REPO_ROOT / "scripts" / "node"),
             "target": f"{INSTALL_ROOT}/scripts/node"},
        ]  # fmt: skip
        mounts += self.lay_out_neuron_release(instance, venv, install)
        return mounts

    def lay_out_neuron_release(
        self, instance: Instance, venv: Path, install: Callable[[str, str, str, int], None]
    ) -> list[dict[str, str]]:
        """The Neuron release's versions where a DLAMI has them (FAKE_DPKG_QUERY says where);
        the mounts that put them there, after the venv's own."""
        packages = presented_release()
        runtime = packages["aws-neuronx-runtime-lib"]
        install(
            "/usr/local", "bin/dpkg-query", FAKE_DPKG_QUERY.replace("__RUNTIME__", runtime), 0o755
        )
        upper = instance.root / "upper" / "neuron-venv"
        work = instance.root / "work" / "neuron-venv"
        site = next(venv.glob("lib/python3*/site-packages")).relative_to(venv)
        for name in NEURON_PIP_PACKAGES:
            info = upper / site / f"{name.replace('-', '_')}-{packages[name]}.dist-info"
            info.mkdir(parents=True)
            (info / "METADATA").write_text(
                f"Metadata-Version: 2.1\nName: {name}\nVersion: {packages[name]}\n"
            )
        work.mkdir(parents=True)
        sys_module = instance.root / "sys-module"
        (sys_module / "neuron").mkdir(parents=True)
        (sys_module / "neuron" / "version").write_text(f"{packages['aws-neuronx-dkms']}\n")
        return [
            {"type": "overlay", "target": NEURON_VENV, "upper": str(upper), "work": str(work)},
            {"type": "bind", "source": str(sys_module), "target": "/sys/module"},
        ]

    def node_pids(self, slot: int) -> list[int]:
        return self.hosts.pids(slot)

    def terminate(self, instance: Instance) -> None:
        """The instance goes away: every process in its namespace dies, the agent too."""
        instance.state = "terminated"
        self.hosts.kill(instance.slot)
        if instance.agent is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                instance.agent.wait(timeout=10)

    # ------------------------------------------------------------------ faults
    def upper(self, instance: Instance, path: str) -> Path:
        """Where a file of the node (an absolute path under /etc, /opt, /var or /usr/local)
        lies on this machine: in the overlay's upper folder, which outlives a reboot."""
        top = next(t for t in ("/etc", "/opt", "/var", "/usr/local") if path.startswith(t + "/"))
        return instance.root / "upper" / top.strip("/").replace("/", "-") / path[len(top) + 1 :]

    def set_node_setting(self, name: str, value: str) -> None:
        """Changes one node setting in every running node's cluster.env (and in the nodes
        launched later): the node scripts read it when they next start, e.g. a new
        TRAINIUM_HOLD_AFTER_STEP for a retry."""
        self.node_settings[name] = value
        for instance in self.running():
            self.upper(instance, CLUSTER_ENV).write_text(self.cluster_env())

    def reboot(self, instance: Instance, *, bootstrap_error: str | None) -> None:
        """The instance reboots: every process on it dies (the job's, the agent's), the agent
        starts again and the node is left as its bootstrap leaves it: with `bootstrap_error`,
        no ready marker and the failed marker holding the time and that line; without, the
        ready marker. Bootstrap's own tests show it leaves exactly that
        (tests/test_bootstrap.py,
        test_bootstrap_failure_names_the_phase_and_line_and_leaves_no_ready_marker): this
        writes its end state instead of running it, the phases needing AWS and hardware.
        Bootstrap also asks the Auto Scaling group to replace a node whose later boot failed
        (SetInstanceHealth); the stand-in leaves that call out, as when it fails, so that the
        node stays until the supervisor's preflight finds it (exit 3), the harder case.

        The SSM agent keeps its documents' state on disk: at its start it leaves the finished
        commands alone and runs the step of a command that was in progress again
        (amazon-ssm-agent agent/framework/processor/processor.go,
        processInProgressDocuments; agent/framework/runpluginutil/runpluginutil.go runs a
        plugin whose status is InProgress). The spool is left that way for the new agent:
        the ended commands' specs move to done/, those in progress stay and run again."""
        self.hosts.kill(instance.slot)
        if instance.agent is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                instance.agent.wait(timeout=10)
        for spec in sorted((instance.spool / "commands").glob("*.json")):
            status = Path(json.loads(spec.read_text())["dir"]) / "status.json"
            ended = status.is_file() and json.loads(status.read_text())["status"] != "InProgress"
            if ended:
                done = instance.spool / "done"
                done.mkdir(exist_ok=True)
                spec.replace(done / spec.name)
        ready = self.upper(instance, READY_MARKER)
        failed = self.upper(instance, BOOTSTRAP_FAILED_MARKER)
        ready.unlink(missing_ok=True)
        failed.unlink(missing_ok=True)
        if bootstrap_error is None:
            ready.write_text("ready (rehearsal node, rebooted)\n")
        else:
            failed.write_text(f"{now():%Y-%m-%dT%H:%M:%SZ} {bootstrap_error}\n")
        self.start_agent(instance)

    def sigkill(self, instance: Instance, victim: str = "largest") -> Killed:
        """SIGKILL from outside the agent to one process of the node, as the kernel's OOM
        killer sends it: `largest` is the process it picks, the highest
        /proc/<pid>/oom_score (the kernel's own badness, mm/oom_kill.c oom_badness: mostly
        resident memory; on a training node, a trainer); `torchrun` is the node's torchrun.
        Tests also end a node's trainer this way where a failing collective would end it."""
        if victim not in ("largest", "torchrun"):
            raise ClusterError(f"victim {victim!r} is not allowed: use largest or torchrun")
        candidates = []
        for pid in self.node_pids(instance.slot):
            argv = _proc(pid, "cmdline").split("\0")
            score = _proc(pid, "oom_score").strip()
            if not score or not argv[0]:
                continue
            is_torchrun = any(a.rsplit("/", 1)[-1] == "torchrun" for a in argv[:2])
            if victim == "torchrun" and not is_torchrun:
                continue
            candidates.append((int(score), pid, " ".join(argv).strip()))
        if not candidates:
            raise ClusterError(f"no {victim} process runs on {instance.instance_id}")
        _, pid, command = max(candidates)
        os.kill(pid, signal.SIGKILL)
        return Killed(pid, command)

    def remove_efa_device(self, instance: Instance) -> str:
        """One of the node's EFA devices goes away (fi_info no longer lists it); its name."""
        path = self.upper(instance, EFA_DEVICES)
        devices = path.read_text().split()
        if not devices:
            raise ClusterError(f"{instance.instance_id} has no EFA device left to lose")
        path.write_text("".join(f"{d}\n" for d in devices[:-1]))
        return devices[-1]

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
