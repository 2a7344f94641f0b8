"""Node scripts started directly on the rehearsal's hosts, as SSM Run Command would start them.

`Rehearsal` gives every node a node-like environment under one output folder: output/data (the
sample data), output/jobs (the jobs root, like /fsx/jobs), output/node (cluster.env, the ready
marker and node-local logs). It runs scripts/node/launch.sh or preflight.sh on every node at once
with the same arguments the SSM documents pass (`RunningCommand`), so a real multi-node torchrun
job (gloo on the CPU) trains workload/train.py. This is the rehearsal on loopback addresses
(without root) and what the tests of the node scripts drive; as root the rehearsal goes through
the Run Command stand-in instead (runner.py).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from scripts.cluster_lib import REPO_ROOT, ClusterError
from scripts.cluster_lib.code import Snapshot, reference_snapshot
from scripts.rehearsal.hosts import Hosts
from scripts.rehearsal.ports import free_port

NODE_SCRIPTS = REPO_ROOT / "scripts" / "node"
#: preflight.sh's ports from the master port: its --port and the two after it.
PREFLIGHT_PORT_OFFSETS = (100, 101, 102)


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
        # Namespaces have ports of their own; loopback nodes share the machine's: the master
        # port and preflight's (+100, +101, +102) come from below the ephemeral range, chosen
        # so that two rehearsals on one machine do not take the same (ports.py says how).
        self.master_port = master_port or (
            29500 if hosts.mode == "netns" else free_port(*PREFLIGHT_PORT_OFFSETS)
        )
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
            # The nodes share this machine: one cache of unpacked code snapshots (job_code.sh).
            TRAINIUM_CODE_CACHE=str(self.node_dir / "code"),
            TRAINIUM_ENV_CACHE=str(self.node_dir / "envs"),
            TRAINIUM_PRECOMPILE_DIR=str(self.node_dir / "precompile"),
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

    def place_code(self, packed: Snapshot) -> str:
        """Puts a code snapshot where the nodes find it, /fsx/data/code/<sha256>.tar.gz (the
        data bucket's object, as the file system imports it); returns its sha256."""
        path = self.data / packed.key
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            staging = path.with_name(f".{path.name}.{os.getpid()}")
            staging.write_bytes(packed.data)
            staging.replace(path)
        return packed.sha256

    def start_job(
        self, job_id: str, train_args: Sequence[str], *, code: str | None = None,
        entry: str | None = None,
    ) -> RunningCommand:  # fmt: skip
        """launch.sh on every node; `code` is a snapshot's sha256 (by default the reference
        workload's, placed here as `train` uploads it)."""
        sha = code or self.place_code(reference_snapshot())
        options = [
            "--job-id", job_id, "--master-port", str(self.master_port),
            "--nproc-per-node", "1", "--jobs-root", str(self.jobs), "--code", sha,
            *(["--entry", entry] if entry else []),
        ]  # fmt: skip
        return self.start("launch.sh", options, train_args)

    def preflight(self, timeout: float = 300) -> RunningCommand:
        options = [
            "--port", str(self.master_port + PREFLIGHT_PORT_OFFSETS[0]), "--nproc-per-node", "1",
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
