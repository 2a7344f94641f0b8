"""A fake node for the node scripts' tests (scripts/node/*.sh).

Each test builds a fake node in a temporary directory: a bin/ folder that stands in for
ip, neuron-ls, fi_info, torchrun, mount, systemctl, ... (they record how they were called)
and a cluster.env, ready marker and log folder redirected through TRAINIUM_* variables.
The scripts themselves run unmodified, the SSM documents' command lines included.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from scripts.cluster_lib.arguments import JOB_ID
from scripts.cluster_lib.code import snapshot
from scripts.cluster_lib.documents import load
from scripts.rehearsal import ports
from scripts.rehearsal.ssm_agent import substitute

REPO_ROOT = Path(__file__).resolve().parent.parent
NODE = REPO_ROOT / "scripts" / "node"
LOG_LINE = re.compile(r"^\[(\w+) \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\] (.*)$")

FAKE_IP = """#!/usr/bin/env bash
# ip -o -4 addr show, as on a node with one ENI
if [[ "$*" == "-o -4 addr show" ]]; then
  echo "1: lo    inet ${FAKE_LOOPBACK:-127.0.0.1}/8 scope host lo\\       valid_lft forever \\
preferred_lft forever"
  echo "2: ens5    inet ${FAKE_ADDRESS:-10.1.0.12}/24 brd 10.1.0.255 scope global ens5"
  exit 0
fi
exec /usr/sbin/ip "$@"
"""

# Records its arguments and environment; the collective check prints what the real one would.
FAKE_TORCHRUN = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$FAKE_DIR/torchrun.args"
env > "$FAKE_DIR/torchrun.env"
if [[ "$*" == *collective_check.py* ]]; then
  echo '{"event": "collective", "backend": "gloo", "world_size": 2}'
fi
echo "fake torchrun on rank $4"
exit "${FAKE_TORCHRUN_EXIT:-0}"
"""

# Like the real tool, it warns on stderr while printing the JSON on stdout.
FAKE_NEURON_LS = """#!/usr/bin/env bash
[[ "$1" == -j ]] || exit 2
echo "WARNING: neuron-ls could not read the instance type from IMDS" >&2
cat "$FAKE_DIR/neuron-ls.json"
"""

RECORDER = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$FAKE_DIR/calls.log"
"""


def trainium_devices(count: int = 16, cores: int = 2, busy: bool = False) -> list[dict[str, Any]]:
    processes = [{"pid": 4242, "command": "python train.py"}] if busy else []
    return [
        {"neuron_device": i, "bdf": f"{i:02x}:1e.0", "nc_count": cores,
         "memory_size": 34359738368, "neuron_processes": processes}
        for i in range(count)
    ]  # fmt: skip


def _process_address() -> str:
    """10.2.X.Y, drawn once per test process (see NODE_ADDRESS)."""
    value = secrets.randbelow(256 * 250)
    return f"10.2.{value // 250}.{value % 250 + 2}"


#: A node address of this test process's own (10.2.X.Y) for test nodes that run launch.sh:
#: launch.sh first stops whatever any job left on its node address (scripts/node/lib.sh
#: job_pids "*"), so two test processes on one machine (two runs, two pytest-xdist workers)
#: must not share one; the tests of one process run one at a time.
NODE_ADDRESS = _process_address()


class FakeNode:
    def __init__(self, root: Path, address: str = "10.1.0.12") -> None:
        """`address`: the node's own address (fake `ip`'s ens5), unless FAKE_ADDRESS says."""
        self.root = root
        self.address = address
        self.bin = root / "bin"
        self.bin.mkdir()
        self.state = root / "state"
        self.logs = root / "log"
        self.fsx = root / "fsx"
        # The job's code (launch.sh --code-dir): the reference trainer's layout, a workload/
        # package whose train.py these tests replace with what they need.
        self.code = root / "code"
        self.workload = self.code / "workload"
        self.workload.mkdir(parents=True)
        (self.workload / "train.py").write_text("raise SystemExit('not run by these tests')\n")
        self.env_file = root / "cluster.env"
        # The node's address for jobs whose processes really start (real_torchrun): one of
        # its own, so that no other test run's launch.sh stops them (loopback_address).
        self.loopback = loopback_address()
        self.tool("ip", FAKE_IP)
        self.tool("torchrun", FAKE_TORCHRUN)
        self.settings: dict[str, str] = {
            "CLUSTER_NAME": "trainium",
            "INSTANCE_TYPE": "trn1.32xlarge",
            "NODE_COUNT": "2",
            "FSX_MOUNT_POINT": str(self.fsx),
            "COMPILE_CACHE_URL": f"{self.fsx}/neuron-compile-cache",
            "NEURON_VENV": str(root / "no-venv"),
        }
        self.write_env()
        self.ready()

    def write_env(self) -> None:
        lines = (f"{key}={shlex.quote(value)}\n" for key, value in self.settings.items())
        self.env_file.write_text("".join(lines))

    def ready(self) -> None:
        self.state.mkdir(exist_ok=True)
        (self.state / "ready").write_text("ready 2026-01-01T00:00:00Z, bootstrap took 90 s\n")

    def tool(self, name: str, script: str = RECORDER) -> None:
        path = self.bin / name
        path.write_text(script)
        path.chmod(0o755)

    def trainium(self, devices: list[dict[str, Any]] | None = None) -> None:
        (self.root / "neuron-ls.json").write_text(json.dumps(devices or trainium_devices()))
        self.tool("neuron-ls", FAKE_NEURON_LS)

    def env(self, **extra: str) -> dict[str, str]:
        keep = ("HOME", "LANG", "TMPDIR")
        env = {k: v for k, v in os.environ.items() if k in keep}
        env.update(
            PATH=f"{self.bin}:/usr/bin:/bin:/usr/sbin:/sbin",
            FAKE_DIR=str(self.root),
            TRAINIUM_CLUSTER_ENV=str(self.env_file),
            TRAINIUM_STATE_DIR=str(self.state),
            TRAINIUM_LOG_DIR=str(self.logs),
            TRAINIUM_CODE_CACHE=str(self.root / "code-cache"),
            TRAINIUM_ENV_CACHE=str(self.root / "env-cache"),
            TRAINIUM_PRECOMPILE_DIR=str(self.root / "precompile"),
            FAKE_ADDRESS=self.address,
        )
        env.update(extra)
        return env

    def run(self, script: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        """Runs a node script; launch.sh and precompile.sh get `--code-dir` (the node's code
        folder, as it is) unless the arguments name the code."""
        if script in ("launch.sh", "precompile.sh") and not {"--code", "--code-dir"} & set(args):
            args = ("--code-dir", str(self.code), *args)
        return subprocess.run(
            ["bash", str(NODE / script), *args],
            capture_output=True, text=True, env=self.env(**extra), timeout=120, check=False,
        )  # fmt: skip

    def run_document(
        self, name: str, values: dict[str, str], **extra: str
    ) -> subprocess.CompletedProcess[str]:
        """Runs a document's command line the way SSM does: defaults filled in, placeholders
        replaced, through `sh`, with the scripts at /opt/trainium-cluster (here: the
        repository). A job's document gets the node's code as a snapshot unless `values`
        names one."""
        if name in ("RunTraining", "Precompile") and "CodeSnapshot" not in values:
            values = {**values, "CodeSnapshot": self.snapshot()}
        return subprocess.run(
            ["sh", "-c", document_command(name, values)], capture_output=True, text=True,
            env=self.env(**extra), timeout=120, check=False,
        )  # fmt: skip

    def snapshot(self) -> str:
        """Packs the node's code folder as `train` does and puts it where the file system
        shows the data bucket's code/ objects (/fsx/data/code/); returns its sha256."""
        packed = snapshot(self.code)
        path = self.fsx / "data" / packed.key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(packed.data)
        return packed.sha256

    def torchrun_args(self) -> list[str]:
        return (self.root / "torchrun.args").read_text().splitlines()

    def torchrun_env(self) -> dict[str, str]:
        lines = (self.root / "torchrun.env").read_text().splitlines()
        return dict(line.split("=", 1) for line in lines if "=" in line)

    def calls(self) -> list[str]:
        path = self.root / "calls.log"
        return path.read_text().splitlines() if path.exists() else []


def document_command(name: str, values: dict[str, str]) -> str:
    """A document's command line as SSM runs it: defaults filled in, placeholders replaced,
    the scripts at /opt/trainium-cluster (here: the repository)."""
    document = load(name)
    defaults = {k: p.default for k, p in document.parameters.items() if p.default is not None}
    command = substitute(document.run_command[0], {**defaults, **values})
    return command.replace("/opt/trainium-cluster", str(REPO_ROOT))


def errors(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The `error:` lines a script logged."""
    found = []
    for line in (result.stderr + result.stdout).splitlines():
        match = LOG_LINE.match(line)
        if match and match.group(2).startswith("error: "):
            found.append(match.group(2).removeprefix("error: "))
    return found


# A trainer for the real torchrun: it reports its PID and, on SIGTERM, does what
# workload/train.py does (save, exit 0) after a "save" of WORKER_SAVE_SECONDS (0.5 s unless
# set), writing saving-<pid> when the signal arrives and saved-<pid> (and `saved`) when done.
# A second SIGTERM during the save does not start another one.
WORKER = """
import os, signal, sys, time
out = os.environ["WORKER_DIR"]
open(os.path.join(out, f"worker-{os.getpid()}.pid"), "w").close()
def term(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(os.path.join(out, f"saving-{os.getpid()}"), "w").close()
    time.sleep(float(os.environ.get("WORKER_SAVE_SECONDS", "0.5")))
    open(os.path.join(out, f"saved-{os.getpid()}"), "w").close()
    open(os.path.join(out, "saved"), "w").write(str(os.getpid()))
    sys.exit(0)
# WORKER_HANDLER_AFTER: a file the worker waits for before it handles SIGTERM (a trainer still
# importing its libraries when the leg ends).
gate = os.environ.get("WORKER_HANDLER_AFTER")
while gate and not os.path.exists(gate):
    time.sleep(0.1)
signal.signal(signal.SIGTERM, term)
open(os.path.join(out, f"handling-{os.getpid()}"), "w").close()
while True:
    time.sleep(0.2)
"""


def real_torchrun(node: FakeNode) -> dict[str, str]:
    """The node with the project's own torchrun and a worker script as train.py; its lo
    carries node.loopback (fake `ip`), the address to give launch.sh in --hosts."""
    (node.bin / "torchrun").unlink()
    (node.workload / "train.py").write_text(WORKER)
    venv_bin = Path(sys.executable).parent
    path = f"{node.bin}:{venv_bin}:/usr/bin:/bin:/usr/sbin:/sbin"
    return {"PATH": path, "WORKER_DIR": str(node.root), "FAKE_LOOPBACK": node.loopback}


def free_ports(count: int) -> int:
    """A port P with P .. P + count - 1 free (preflight uses --port, +1 and +2), below the
    ephemeral range, as 29600 is on the nodes; chosen so that two test runs on one machine do
    not take the same one (scripts/rehearsal/ports.py says how and why)."""
    return ports.free_port(*range(1, count))


def free_port() -> int:
    """A free port below the ephemeral range (free_ports says why)."""
    return free_ports(1)


def unique_job_id(name: str) -> str:
    """A job ID of its own for a test whose job's processes really start: `name` and a
    random token. Tests and the node scripts find a job's processes by TRAINIUM_JOB_ID in
    every process of the machine (scripts/node/lib.sh job_pids, hosts.job_processes), so
    with a fixed ID two test runs on one machine would stop or kill each other's jobs. The
    token keeps the ID inside launch.sh's pattern (1-64 letters, digits, '.', '_', '-')."""
    job_id = f"{name}-{secrets.token_hex(4)}"
    if not JOB_ID.fullmatch(job_id):
        raise ValueError(f"{job_id!r} is not a job ID (1-64 letters, digits, '.', '_', '-')")
    return job_id


def loopback_address() -> str:
    """A loopback address of its own (127.X.Y.Z, X from 1) for a test's node: launch.sh stops
    whatever any job left on its node address (job_pids "*" with TRAINIUM_NODE_ADDRESS), so
    two test runs on one machine must not share one. Linux answers all of 127.0.0.0/8 on lo."""
    value = secrets.randbelow(254 * 256 * 254)
    return f"127.{value // (256 * 254) + 1}.{value // 254 % 256}.{value % 254 + 1}"


def tagged(
    job: str, address: str, *, state: Path | None = None, ignore_term: bool = False
) -> subprocess.Popen[str]:
    """A process tagged the way launch.sh tags a job's processes on the node at `address`
    whose state directory is `state` (job_pids in lib.sh finds a node's processes by it),
    returned once it is ready: its trap set (and its child started) when it ignores SIGTERM.
    Job and address are the test's own (unique_job_id, loopback_address): launch.sh and
    stop.sh in another test run on this machine stop processes by those tags."""
    env = {**os.environ, "TRAINIUM_JOB_ID": job, "TRAINIUM_NODE_ADDRESS": address}
    if state is not None:
        env["TRAINIUM_STATE_DIR"] = str(state)
    script = (
        "trap '' TERM; sleep 300 & echo ready; wait"
        if ignore_term
        else "echo ready; exec sleep 300"
    )
    process = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    return process
