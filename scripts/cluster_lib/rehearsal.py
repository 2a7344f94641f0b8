"""Local multi-host rehearsal: the cluster's launch path on one machine, without AWS.

Each "node" gets its own address: a Linux network namespace joined to the others by a
bridge (as root with iproute2), or a loopback address 127.0.0.x otherwise. On every node
the rehearsal runs scripts/node/launch.sh exactly as the RunTraining SSM document does
(same script, same arguments, a cluster.env beside it), so a real multi-node torchrun job
(gloo on the CPU) trains workload/train.py. Traffic never leaves the machine: the
namespaces have no route out and the loopback addresses stay on lo.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from scripts.cluster_lib import REPO_ROOT, ClusterError

NODE_SCRIPTS = REPO_ROOT / "scripts" / "node"
SUBNET = "10.77.0"


def _run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def _tagged_pids(job_id: str | None, node_address: str | None) -> list[int]:
    """PIDs whose environment carries launch.sh's tags (TRAINIUM_JOB_ID / _NODE_ADDRESS)."""
    wanted = []
    if job_id is not None:
        wanted.append(f"TRAINIUM_JOB_ID={job_id}".encode())
    if node_address is not None:
        wanted.append(f"TRAINIUM_NODE_ADDRESS={node_address}".encode())
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(tag in environ for tag in wanted):
            pids.append(int(entry.name))
    return pids


def _kill(pids: Sequence[int], sig: signal.Signals = signal.SIGKILL) -> None:
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
            _kill(pids)
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
    """Loopback addresses 127.0.0.1..N on lo: needs no privileges; launch.sh gets
    --node-address because every address is local to every node."""

    mode = "loopback"

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.addresses = [f"127.0.0.{i + 1}" for i in range(count)]

    def launch_options(self, index: int) -> list[str]:
        return ["--node-address", self.addresses[index]]

    def kill(self, index: int) -> None:
        for _ in range(5):
            pids = _tagged_pids(None, self.addresses[index])
            if not pids:
                return
            _kill(pids)
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class NodeProcess:
    index: int
    process: subprocess.Popen[str]
    lines: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=200))
    reader: threading.Thread | None = None

    @property
    def tail(self) -> str:
        return "\n".join(list(self.lines)[-30:])


class RunningCommand:
    """One node script started on every node at once (as SSM Run Command does)."""

    def __init__(
        self, hosts: Hosts, argv: Callable[[int], list[str]], env: dict[str, str],
        echo: Callable[[str], None] | None,
    ) -> None:  # fmt: skip
        self.hosts = hosts
        self.nodes: list[NodeProcess] = []
        for index in range(hosts.count):
            process = subprocess.Popen(
                hosts.command(index, argv(index)),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                env=env,
                start_new_session=True,
            )
            node = NodeProcess(index, process)
            node.reader = threading.Thread(
                target=self._read, args=(node, process.stdout, echo), daemon=True
            )
            node.reader.start()
            self.nodes.append(node)

    @staticmethod
    def _read(
        node: NodeProcess, stream: IO[str] | None, echo: Callable[[str], None] | None
    ) -> None:
        if stream is None:
            return
        for raw in stream:
            line = raw.rstrip("\n")
            node.lines.append(line)
            if echo is not None:
                echo(f"[node {node.index}] {line}")

    def wait(self, timeout: float, failure_grace: float = 60.0) -> list[int]:
        """Waits for every node; when one fails, the others get failure_grace seconds to end
        on their own before they are killed. Returns the exit statuses."""
        deadline = time.monotonic() + timeout
        first_failure: float | None = None
        while True:
            codes = [node.process.poll() for node in self.nodes]
            if all(code is not None for code in codes):
                break
            now = time.monotonic()
            if first_failure is None and any(code not in (None, 0) for code in codes):
                first_failure = now
            if now >= deadline or (
                first_failure is not None and now - first_failure > failure_grace
            ):
                for node, code in zip(self.nodes, codes, strict=True):
                    if code is None:
                        self.hosts.kill(node.index)
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(node.process.pid, signal.SIGKILL)
            time.sleep(0.2)
        for node in self.nodes:
            if node.reader is not None:
                node.reader.join(timeout=10)
        return [int(node.process.returncode) for node in self.nodes]


def prepare_data(
    data: Path, train_size: int = 1600, test_size: int = 400, python: str = sys.executable
) -> Path:
    """Generates the sample data set into `data` unless it is there already."""
    if not any(data.glob("train.*")):
        script = REPO_ROOT / "scripts" / "make_sample_data.py"
        if not script.is_file():
            raise ClusterError(f"{script} not found: cannot generate sample data")
        result = subprocess.run(
            [
                python, str(script), "--output", str(data),
                "--train-size", str(train_size), "--test-size", str(test_size), "--seed", "0",
            ],
            check=False, capture_output=True, text=True,
        )  # fmt: skip
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
            raise ClusterError("sample data generation failed: " + " | ".join(tail))
    return data


class Rehearsal:
    """Runs node scripts on rehearsal hosts with a node-like environment under `output`:
    output/data (sample data), output/jobs (the jobs root, like /fsx/jobs), output/node
    (cluster.env, the ready marker and node-local logs)."""

    def __init__(
        self,
        hosts: Hosts,
        output: Path,
        *,
        echo: Callable[[str], None] | None = print,
        master_port: int | None = None,
        python: str = sys.executable,
    ) -> None:
        self.hosts = hosts
        self.output = output.resolve()
        self.data = self.output / "data"
        self.jobs = self.output / "jobs"
        self.node_dir = self.output / "node"
        self.echo = echo
        self.python = python
        # Namespaces have ports of their own; loopback nodes share the machine's.
        self.master_port = master_port or (29500 if hosts.mode == "netns" else free_port())
        self.env = self._environment()

    def _environment(self) -> dict[str, str]:
        state = self.node_dir / "state"
        state.mkdir(parents=True, exist_ok=True)
        self.jobs.mkdir(parents=True, exist_ok=True)
        settings = {
            "CLUSTER_NAME": "rehearsal",
            "INSTANCE_TYPE": "local",
            "NODE_COUNT": str(self.hosts.count),
            "FSX_MOUNT_POINT": str(self.output),
            "WORKLOAD_DIR": str(REPO_ROOT / "workload"),
        }
        env_file = self.node_dir / "cluster.env"
        env_file.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))
        (state / "ready").write_text("ready (local rehearsal)\n")
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("NEURON_", "FI_", "TRAINIUM_", "GLOO_", "CCOM_"))
        }
        env.update(
            PATH=f"{Path(self.python).parent}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
            TRAINIUM_CLUSTER_ENV=str(env_file),
            TRAINIUM_STATE_DIR=str(state),
            TRAINIUM_LOG_DIR=str(self.node_dir / "log"),
            # Each node gets one process; keep each from taking every core for itself.
            OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
        )
        return env

    def prepare_data(self, train_size: int = 1600, test_size: int = 400) -> Path:
        return prepare_data(self.data, train_size, test_size, self.python)

    def hosts_arg(self) -> str:
        return ",".join(self.hosts.addresses)

    def start(
        self, script: str, options: list[str], train_args: Sequence[str] = ()
    ) -> RunningCommand:
        def argv(index: int) -> list[str]:
            command = ["bash", str(NODE_SCRIPTS / script), "--hosts", self.hosts_arg(), *options]
            command += self.hosts.launch_options(index)
            if script in ("launch.sh", "precompile.sh"):
                command += ["--", *train_args]
            return command

        return RunningCommand(self.hosts, argv, self.env, self.echo)

    def start_job(self, job_id: str, train_args: Sequence[str]) -> RunningCommand:
        options = [
            "--job-id", job_id, "--master-port", str(self.master_port),
            "--nproc-per-node", "1", "--jobs-root", str(self.jobs),
        ]  # fmt: skip
        return self.start("launch.sh", options, train_args)

    def preflight(self, timeout: float = 300) -> RunningCommand:
        options = [
            "--port", str(self.master_port + 100), "--nproc-per-node", "1",
            "--jobs-root", str(self.jobs), "--min-free-gb", "1", "--wait-ready", "0",
        ]  # fmt: skip
        return self.start("preflight.sh", options)

    def job_dir(self, job_id: str) -> Path:
        return self.jobs / job_id

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        path = self.job_dir(job_id) / "metrics.jsonl"
        if not path.is_file():
            return []
        records = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
        return records


def default_train_args(data: Path) -> list[str]:
    """A tiny model trained long enough to learn the sample set (eval accuracy about 0.9):
    about a minute on two CPU cores."""
    return [
        "--data", str(data), "--model", "tiny", "--device", "cpu", "--tiny-hidden-size", "64",
        "--max-steps", "200", "--batch-size", "16", "--lr", "2e-3", "--max-length", "64",
        "--checkpoint-every", "50", "--eval-every", "100",
    ]  # fmt: skip


def check_failed(what: str, codes: list[int], running: RunningCommand) -> None:
    failed = [i for i, code in enumerate(codes) if code != 0]
    if failed:
        node = running.nodes[failed[0]]
        raise ClusterError(
            f"{what} failed on node {failed[0]} (exit status {codes[failed[0]]}); "
            f"its last output:\n{node.tail}"
        )


def rehearse(
    nodes: int,
    output: Path,
    job_id: str,
    extra_args: Sequence[str],
    *,
    mode: str = "auto",
    preflight: bool = True,
    fresh: bool = False,
    quiet: bool = False,
    timeout: float = 1800,
    out: Callable[[str], None] = print,
) -> dict[str, Any]:
    """What `cluster.py rehearse` does; returns the job's summary metrics line.

    With network namespaces (root), the job goes through every layer AWS has: the operator
    CLI's own `train` starts an execution of the operations stack's job supervisor (its
    synthesized definition, in moto's Step Functions interpreter), which waits for the nodes,
    runs preflight, sends RunTraining and retries through the local Run Command stand-in
    (scripts/cluster_lib/localcloud.py), which runs the real SSM documents on the nodes as the
    SSM agent does. On loopback addresses (no privileges) the node
    scripts are started directly, without the agent's layer."""
    if not 1 <= nodes <= 8:
        raise ClusterError(f"--nodes {nodes} is not allowed: rehearse with 1 to 8 nodes")
    if mode not in ("auto", "netns", "loopback"):
        raise ClusterError(f"--mode {mode!r} is not allowed: use auto, netns or loopback")
    through_agent = mode != "loopback" and NetnsHosts.available() and shutil.which("unshare")
    if mode == "netns" and not through_agent:
        raise ClusterError("--mode netns needs root, iproute2 and unshare; use --mode loopback")
    if through_agent:
        return _rehearse_through_run_command(
            nodes, output, job_id, extra_args, preflight=preflight, fresh=fresh, quiet=quiet,
            out=out,
        )  # fmt: skip
    return _rehearse_direct(
        nodes, output, job_id, extra_args, mode=mode, preflight=preflight, fresh=fresh,
        quiet=quiet, timeout=timeout, out=out,
    )  # fmt: skip


#: Folders the stand-in's nodes see through overlays: writes there stay on the node.
NODE_PRIVATE = ("/etc", "/opt", "/var", "/usr/local")


def _rehearse_through_run_command(
    nodes: int,
    output: Path,
    job_id: str,
    extra_args: Sequence[str],
    *,
    preflight: bool,
    fresh: bool,
    quiet: bool,
    out: Callable[[str], None],
) -> dict[str, Any]:
    from scripts.cluster_lib.cluster import Cluster
    from scripts.cluster_lib.jobs import Jobs
    from scripts.cluster_lib.local_supervisor import local_supervisor, synthesize_operations
    from scripts.cluster_lib.localcloud import local_cloud

    if not preflight:
        raise ClusterError(
            "--skip-preflight is for --mode loopback only: through the Run Command stand-in "
            "the job supervisor runs preflight before every attempt, as it does in AWS"
        )
    output = output.resolve()
    for private in NODE_PRIVATE:
        if output == Path(private) or Path(private) in output.parents:
            raise ClusterError(
                f"--output {output} is inside {private}, which each rehearsal node overlays "
                "with its own files: choose a folder elsewhere (e.g. build/rehearsal)"
            )
    data = prepare_data(output / "data")
    if fresh:
        shutil.rmtree(output / "jobs" / job_id, ignore_errors=True)
    shutil.rmtree(output / "nodes", ignore_errors=True)
    out("rehearsal: synthesizing the operations stack for its job supervisor")
    template = synthesize_operations(REHEARSAL_CLUSTER, nodes)
    with (
        local_cloud(nodes, output, cluster_name=REHEARSAL_CLUSTER) as cloud,
        local_supervisor(cloud, template),
    ):
        addresses = ", ".join(i.address for i in cloud.running())
        out(
            f"rehearsal: {nodes} nodes (netns: {addresses}) behind the local Run Command "
            f"stand-in, the job supervisor in moto's Step Functions interpreter, output {output}"
        )
        cluster = Cluster(
            cloud.clients(), cloud.cluster_name, out=out, poll_interval=1.0,
            wait_timeout=120, failure_grace=60,
        )  # fmt: skip
        jobs = Jobs(cluster)
        execution = jobs.start(
            job_id,
            [*default_train_args(data), *extra_args],
            max_retries=1,
            retry_delay=5,
            options=REHEARSAL_SUPERVISOR,
        )
        jobs.follow(execution, job_id, stream=not quiet)  # Ctrl-C ends the rehearsal
    return _summary(output, job_id, out)


#: The rehearsal cluster's name (the stand-in's and the synthesized stack's).
REHEARSAL_CLUSTER = "rehearsal"
#: The supervisor's timing for a rehearsal: poll every second, cancel the rest of an attempt
#: a minute after one node ended.
REHEARSAL_SUPERVISOR = {"PollSeconds": 1, "FailureGraceSeconds": 60}


def _summary(output: Path, job_id: str, out: Callable[[str], None]) -> dict[str, Any]:
    metrics = output / "jobs" / job_id / "metrics.jsonl"
    records = []
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    summaries = [r for r in records if r.get("event") == "summary"]
    if not summaries:
        raise ClusterError(f"job {job_id} ended without a summary line in {metrics}")
    out(f"rehearsal: job {job_id} finished; metrics in {metrics}")
    out("summary: " + json.dumps(summaries[-1]))
    return summaries[-1]


def _rehearse_direct(
    nodes: int,
    output: Path,
    job_id: str,
    extra_args: Sequence[str],
    *,
    mode: str,
    preflight: bool,
    fresh: bool,
    quiet: bool,
    timeout: float,
    out: Callable[[str], None],
) -> dict[str, Any]:
    with make_hosts(nodes, mode) as hosts:
        rehearsal = Rehearsal(hosts, output, echo=None if quiet else out)
        out(
            f"rehearsal: {nodes} nodes ({hosts.mode}: {', '.join(hosts.addresses)}), "
            f"output {rehearsal.output} (node scripts started directly, without the SSM "
            "agent's layer: run as root for the Run Command stand-in)"
        )
        data = rehearsal.prepare_data()
        if fresh:
            shutil.rmtree(rehearsal.job_dir(job_id), ignore_errors=True)
        if preflight:
            out("rehearsal: preflight.sh on every node")
            running = rehearsal.preflight()
            check_failed("preflight", running.wait(timeout=600), running)
        out(f"rehearsal: launch.sh on every node, job {job_id}")
        running = rehearsal.start_job(job_id, [*default_train_args(data), *extra_args])
        check_failed(f"job {job_id}", running.wait(timeout=timeout), running)
        return _summary(rehearsal.output, job_id, out)
