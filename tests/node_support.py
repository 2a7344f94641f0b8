"""A fake node for the node scripts' tests (scripts/node/*.sh).

Each test builds a fake node in a temporary directory: a bin/ folder that stands in for
ip, neuron-ls, fi_info, torchrun, mount, systemctl, ... (they record how they were called)
and a cluster.env, ready marker and log folder redirected through TRAINIUM_* variables.
The scripts themselves run unmodified, the SSM documents' command lines included.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from scripts.cluster_lib.code import snapshot
from scripts.cluster_lib.documents import load
from scripts.rehearsal.ssm_agent import substitute

REPO_ROOT = Path(__file__).resolve().parent.parent
NODE = REPO_ROOT / "scripts" / "node"
LOG_LINE = re.compile(r"^\[(\w+) \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\] (.*)$")

FAKE_IP = """#!/usr/bin/env bash
# ip -o -4 addr show, as on a node with one ENI
if [[ "$*" == "-o -4 addr show" ]]; then
  echo "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever"
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


class FakeNode:
    def __init__(self, root: Path) -> None:
        self.root = root
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
    """The node with the project's own torchrun and a worker script as train.py."""
    (node.bin / "torchrun").unlink()
    (node.workload / "train.py").write_text(WORKER)
    venv_bin = Path(sys.executable).parent
    path = f"{node.bin}:{venv_bin}:/usr/bin:/bin:/usr/sbin:/sbin"
    return {"PATH": path, "WORKER_DIR": str(node.root)}


def free_ports(count: int) -> int:
    """A port P with P .. P + count - 1 free (preflight uses --port, +1 and +2), below the
    ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default), as
    29600 is on the nodes: a client that retries connecting to a loopback port in that range
    before its server listens can be given that very port as its own source port and connect
    to itself (a TCP self-connect), which then keeps the server from binding it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, low - count)
        try:
            with contextlib.ExitStack() as stack:
                for offset in range(count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("", port + offset))
        except OSError:
            continue
        return port
    raise AssertionError(f"no {count} consecutive free ports below {low}")


def free_port() -> int:
    """A free port below the ephemeral range (free_ports says why)."""
    return free_ports(1)
