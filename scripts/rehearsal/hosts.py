"""The rehearsal's hosts: one address per node, and a way to run and kill a node's processes.

Each node is a Linux network namespace joined to the others by a bridge (`NetnsHosts`, as root
with iproute2), or a loopback address 127.X.Y.n (`LoopbackHosts`, no privileges). Traffic never
leaves the machine: the namespaces have no route out and the loopback addresses stay on lo.
launch.sh tags a job's processes with TRAINIUM_JOB_ID and TRAINIUM_NODE_ADDRESS in their
environment; `tagged_pids` and `job_processes` find them by those tags.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from scripts.cluster_lib import ClusterError
from scripts.node import job_processes as node_processes

SUBNET = "10.77.0"


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def tagged_pids(
    job_id: str | None, node_address: str | None, state_dir: Path | None = None
) -> list[int]:
    """PIDs whose environment carries launch.sh's tags (TRAINIUM_JOB_ID / _NODE_ADDRESS), and
    the node's TRAINIUM_STATE_DIR when given: a node's state folder is its own, where an
    address drawn at random can be another rehearsal's on the same machine (lib.sh job_pids
    keeps to its node's the same way). In every network namespace, zombies left out; a
    process in the middle of an exec is read again until it has its environment
    (scripts/node/job_processes.py, which job_pids runs)."""
    tags = {}
    if job_id is not None:
        tags["TRAINIUM_JOB_ID"] = job_id
    if node_address is not None:
        tags["TRAINIUM_NODE_ADDRESS"] = node_address
    if state_dir is not None:
        tags["TRAINIUM_STATE_DIR"] = str(state_dir)
    return node_processes.tagged_pids(tags)


def kill_pids(pids: Sequence[int], sig: signal.Signals = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class Hosts:
    """The rehearsal's nodes: their addresses and how to run a command on each."""

    mode = "base"

    def __init__(self, count: int) -> None:
        self.count = count
        self.addresses: list[str] = []

    def command(self, index: int, argv: list[str]) -> list[str]:
        return argv

    def launch_options(self, index: int) -> list[str]:
        return []

    def kill(self, index: int) -> None:
        """Kills every process of one node, as if the machine had died."""
        raise NotImplementedError

    def close(self) -> None:
        """Removes what the hosts created."""

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NetnsHosts(Hosts):
    """One network namespace per node, all on one bridge in a namespace of its own.

    Names carry a random token so that concurrent rehearsals never collide; the root
    namespace is not touched (the veth pairs are created inside the namespaces).
    """

    mode = "netns"

    def __init__(self, count: int) -> None:
        super().__init__(count)
        token = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
        self.switch = f"tcr-{token}-sw"
        self.namespaces = [f"tcr-{token}-n{i}" for i in range(count)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(count)]
        try:
            _run("ip", "netns", "add", self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i, namespace in enumerate(self.namespaces):
                _run("ip", "netns", "add", namespace)
                _run(
                    "ip", "-n", self.switch, "link", "add", f"p{i}", "type", "veth",
                    "peer", "name", "eth0", "netns", namespace,
                )  # fmt: skip
                _run("ip", "-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
                _run("ip", "-n", namespace, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
                _run("ip", "-n", namespace, "link", "set", "eth0", "up")
                _run("ip", "-n", namespace, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, OSError) as error:
            self.close()
            detail = getattr(error, "stderr", "") or str(error)
            raise ClusterError(f"cannot create network namespaces: {detail.strip()}") from None

    def command(self, index: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[index], *argv]

    def pids(self, index: int) -> list[int]:
        result = subprocess.run(
            ["ip", "netns", "pids", self.namespaces[index]],
            check=False,
            capture_output=True,
            text=True,
        )
        return [int(pid) for pid in result.stdout.split()]

    def kill(self, index: int) -> None:
        # Repeat: a dying parent may still be forking.
        for _ in range(5):
            pids = self.pids(index)
            if not pids:
                return
            kill_pids(pids)
            time.sleep(0.2)

    def close(self) -> None:
        for index in range(len(self.namespaces)):
            with contextlib.suppress(Exception):
                self.kill(index)
        for namespace in [*self.namespaces, self.switch]:
            subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True)

    @staticmethod
    def available() -> bool:
        return hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("ip") is not None


class LoopbackHosts(Hosts):
    """Loopback addresses 127.X.Y.1..N on lo (Linux answers all of 127.0.0.0/8 there): needs
    no privileges; launch.sh gets --node-address because every address is local to every
    node. X.Y is drawn for each rehearsal: launch.sh stops whatever any job left on its node
    address and `kill` ends every process tagged with a node's address, so two rehearsals on
    one machine must not share addresses (one in 65,000 that two draws meet)."""

    mode = "loopback"

    def __init__(self, count: int) -> None:
        super().__init__(count)
        if not 1 <= count <= 254:
            raise ClusterError(f"{count} loopback nodes: use 1 to 254")
        block = secrets.randbelow(254 * 256)
        self.prefix = f"127.{block // 256 + 1}.{block % 256}"
        self.addresses = [f"{self.prefix}.{i + 1}" for i in range(count)]

    def launch_options(self, index: int) -> list[str]:
        return ["--node-address", self.addresses[index]]

    def kill(self, index: int) -> None:
        for _ in range(5):
            pids = tagged_pids(None, self.addresses[index])
            if not pids:
                return
            kill_pids(pids)
            time.sleep(0.2)


@contextlib.contextmanager
def make_hosts(count: int, mode: str = "auto") -> Iterator[Hosts]:
    if mode not in ("auto", "netns", "loopback"):
        raise ClusterError(f"--mode {mode!r} is not allowed: use auto, netns or loopback")
    if mode == "netns" and not NetnsHosts.available():
        raise ClusterError("--mode netns needs root and iproute2 (`ip`); use --mode loopback")
    hosts: Hosts
    if mode == "loopback" or (mode == "auto" and not NetnsHosts.available()):
        hosts = LoopbackHosts(count)
    else:
        try:
            hosts = NetnsHosts(count)
        except ClusterError:
            if mode == "netns":
                raise
            hosts = LoopbackHosts(count)
    try:
        yield hosts
    finally:
        hosts.close()


def job_processes(job_id: str) -> list[int]:
    """PIDs on this machine tagged with the job (any node), zombies left out: what must be
    gone after a cancel or a stop."""
    return tagged_pids(job_id, None)
