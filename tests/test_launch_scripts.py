"""The node scripts (scripts/node/*.sh) run here against fake node tools.

Each test builds a fake node in a temporary directory: a bin/ folder that stands in for
ip, neuron-ls, fi_info, torchrun, mount, systemctl, ... (they record how they were called)
and a cluster.env, ready marker and log folder redirected through TRAINIUM_* variables.
The scripts themselves run unmodified, the SSM documents' command lines included.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from scripts.cluster_lib.documents import load
from scripts.rehearsal.ssm_agent import substitute
from stacks.supervisor import ROLL_FLEET_STATUS

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
        self.workload = root / "workload"
        self.workload.mkdir()
        (self.workload / "train.py").write_text("raise SystemExit('not run by these tests')\n")
        self.env_file = root / "cluster.env"
        self.tool("ip", FAKE_IP)
        self.tool("torchrun", FAKE_TORCHRUN)
        self.settings: dict[str, str] = {
            "CLUSTER_NAME": "trainium",
            "INSTANCE_TYPE": "trn1.32xlarge",
            "NODE_COUNT": "2",
            "FSX_MOUNT_POINT": str(self.fsx),
            "COMPILE_CACHE_URL": "s3://cache-bucket/neuron-compile-cache/",
            "WORKLOAD_DIR": str(self.workload),
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
        )
        env.update(extra)
        return env

    def run(self, script: str, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(NODE / script), *args],
            capture_output=True, text=True, env=self.env(**extra), timeout=120, check=False,
        )  # fmt: skip

    def run_document(
        self, name: str, values: dict[str, str], **extra: str
    ) -> subprocess.CompletedProcess[str]:
        """Runs a document's command line the way SSM does: defaults filled in, placeholders
        replaced, through `sh`, with the scripts at /opt/trainium-cluster (here: the
        repository)."""
        document = load(name)
        defaults = {k: p.default for k, p in document.parameters.items() if p.default is not None}
        command = substitute(document.run_command[0], {**defaults, **values})
        command = command.replace("/opt/trainium-cluster", str(REPO_ROOT))
        return subprocess.run(
            ["sh", "-c", command], capture_output=True, text=True, env=self.env(**extra),
            timeout=120, check=False,
        )  # fmt: skip

    def torchrun_args(self) -> list[str]:
        return (self.root / "torchrun.args").read_text().splitlines()

    def torchrun_env(self) -> dict[str, str]:
        lines = (self.root / "torchrun.env").read_text().splitlines()
        return dict(line.split("=", 1) for line in lines if "=" in line)

    def calls(self) -> list[str]:
        path = self.root / "calls.log"
        return path.read_text().splitlines() if path.exists() else []


@pytest.fixture
def node(tmp_path: Path) -> FakeNode:
    return FakeNode(tmp_path)


def errors(result: subprocess.CompletedProcess[str]) -> list[str]:
    """The `error:` lines a script logged."""
    found = []
    for line in (result.stderr + result.stdout).splitlines():
        match = LOG_LINE.match(line)
        if match and match.group(2).startswith("error: "):
            found.append(match.group(2).removeprefix("error: "))
    return found


# --------------------------------------------------------------------------- shellcheck
def test_shellcheck_passes_on_every_node_script() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (make setup installs it)")
    scripts = sorted(str(p.relative_to(REPO_ROOT)) for p in NODE.glob("*.sh"))
    assert len(scripts) == 6
    result = subprocess.run(
        ["shellcheck", "--severity=style", *scripts], cwd=REPO_ROOT, capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize(
    "script", ["launch.sh", "preflight.sh", "precompile.sh", "stop.sh", "bootstrap.sh"]
)
def test_help_prints_the_usage(script: str, node: FakeNode) -> None:
    result = node.run(script, "--help")
    assert result.returncode == 0
    assert f"{script} " in result.stdout
    assert "set -E" not in result.stdout


# ------------------------------------------------------------------------------- launch
def test_launch_finds_its_rank_from_its_own_address(node: FakeNode) -> None:
    result = node.run(
        "launch.sh", "--hosts", "10.1.0.5,10.1.0.12,10.1.0.40", "--job-id", "bert-1",
        "--nproc-per-node", "2", "--dry-run", "--", "--model", "tiny",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    command = result.stdout.strip().splitlines()[-1].split()
    assert command == [
        "torchrun", "--nnodes", "3", "--node_rank", "1", "--master_addr", "10.1.0.5",
        "--master_port", "29500", "--nproc_per_node", "2", f"{node.workload}/train.py",
        "--output", f"{node.fsx}/jobs/bert-1", "--model", "tiny",
    ]  # fmt: skip
    assert "GLOO_SOCKET_IFNAME=ens5" in result.stdout
    assert "TRAINIUM_NODE_RANK=1" in result.stdout


def test_launch_takes_an_explicit_node_address(node: FakeNode) -> None:
    result = node.run(
        "launch.sh", "--hosts", "127.0.0.1,127.0.0.2", "--job-id", "j", "--nproc-per-node", "1",
        "--node-address", "127.0.0.2", "--jobs-root", str(node.root / "jobs"), "--dry-run",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "--node_rank 1 --master_addr 127.0.0.1" in result.stdout
    assert f"--output {node.root}/jobs/j" in result.stdout
    assert "GLOO_SOCKET_IFNAME=lo" in result.stdout


ONE = ["--hosts", "10.1.0.12", "--job-id", "j"]
BAD_INPUT = [
    (["--job-id", "j"],
     "--hosts is required: the comma-separated addresses of all nodes, master first"),
    (["--hosts", "10.1.0.12"], "--job-id is required"),
    (["--hosts", "10.1.0.12", "--job-id", "a;b"],
     "--job-id 'a;b' is not allowed: use 1-64 letters, digits, '.', '_' or '-', "
     "starting with a letter or digit"),
    (["--hosts", "10.1.0.12,10.1.0.12", "--job-id", "j"],
     "--hosts lists 10.1.0.12 twice: every node must appear once"),
    (["--hosts", "10.1.0.12,node-b", "--job-id", "j"],
     "--hosts entry 'node-b' is not an IPv4 address: give the nodes' private addresses, "
     "comma separated"),
    (["--hosts", "10.9.9.1,10.9.9.2", "--job-id", "j"],
     "none of --hosts (10.9.9.1 10.9.9.2) is an address of this node (127.0.0.1,10.1.0.12); "
     "pass --node-address"),
    ([*ONE, "--node-address", "10.1.0.13"], "--node-address 10.1.0.13 is not in --hosts 10.1.0.12"),
    ([*ONE, "--master-port", "99999"],
     "--master-port '99999' is not a TCP port: use a number from 1 to 65535"),
    ([*ONE, "--nproc-per-node", "many"],
     "--nproc-per-node 'many' is not allowed: use 'auto' (one process per NeuronCore) or a "
     "number from 1 to 999"),
    (ONE,
     "--nproc-per-node auto needs neuron-ls (a Trainium node); pass a number of processes per "
     "node on other machines"),
    ([*ONE, "--nproc-per-node", "1", "--", "--output", "/tmp/x"],
     "train.py arguments must not set --output: the job writes to <jobs-root>/<job-id>"),
    ([*ONE, "--bogus"],
     "unknown option '--bogus': options come first, then -- and the train.py arguments "
     "(see --help)"),
    (["--hosts"], "--hosts needs a value (see --help)"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), BAD_INPUT)
def test_launch_refuses_bad_input_with_one_line(
    node: FakeNode, args: list[str], message: str
) -> None:
    result = node.run("launch.sh", *args)
    assert result.returncode == 1
    assert errors(result) == [message]
    assert "Traceback" not in result.stderr
    assert not (node.root / "torchrun.args").exists()


def test_launch_on_trainium_sets_the_efa_and_neuron_environment(node: FakeNode) -> None:
    node.trainium()
    result = node.run("launch.sh", "--hosts", "10.1.0.12,10.1.0.40", "--job-id", "bert-1",
                      "--master-port", "41000", "--", "--model", "tiny")  # fmt: skip
    assert result.returncode == 0, result.stderr
    args = node.torchrun_args()
    assert args[:10] == [
        "--nnodes", "2", "--node_rank", "0", "--master_addr", "10.1.0.12", "--master_port",
        "41000", "--nproc_per_node", "32",
    ]  # fmt: skip
    env = node.torchrun_env()
    assert env["FI_PROVIDER"] == "efa"
    assert env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["FI_EFA_FORK_SAFE"] == "1"
    assert env["NEURON_RT_ROOT_COMM_ID"] == "10.1.0.12:41001"
    assert env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"
    assert env["NEURON_COMPILE_CACHE_URL"] == "s3://cache-bucket/neuron-compile-cache/"
    assert env["MALLOC_ARENA_MAX"] == "64"
    assert env["CCOM_SOCKET_IFNAME"] == "ens5"
    flags = env["NEURON_CC_FLAGS"].split()
    assert "--model-type=transformer" in flags
    assert "--auto-cast=none" in flags  # precision is train.py's (test_workload_precision.py)
    assert any(flag.startswith("--optlevel=") for flag in flags)
    assert env["TRAINIUM_JOB_ID"] == "bert-1"
    assert env["PYTHONPATH"].split(":")[0] == str(node.root)


def test_neuron_cc_flags_can_be_overridden(node: FakeNode) -> None:
    node.trainium()
    node.settings["NEURON_CC_FLAGS"] = "--model-type=transformer --auto-cast=none --optlevel=1"
    node.write_env()
    result = node.run("launch.sh", "--hosts", "10.1.0.12", "--job-id", "j")
    assert result.returncode == 0, result.stderr
    assert (
        node.torchrun_env()["NEURON_CC_FLAGS"]
        == "--model-type=transformer --auto-cast=none --optlevel=1"
    )


def test_launch_refuses_more_processes_than_neuron_cores(node: FakeNode) -> None:
    node.trainium(trainium_devices(count=1, cores=2))
    result = node.run("launch.sh", "--hosts", "10.1.0.12", "--job-id", "j", "--nproc-per-node", "4")
    assert errors(result) == ["--nproc-per-node 4 exceeds the 2 NeuronCores of this node"]


def test_launch_elsewhere_leaves_neuron_variables_unset(node: FakeNode) -> None:
    result = node.run("launch.sh", "--hosts", "10.1.0.12", "--job-id", "j", "--nproc-per-node", "2")
    assert result.returncode == 0, result.stderr
    env = node.torchrun_env()
    assert not [
        key for key in env if key.startswith(("FI_", "NEURON_", "CCOM_")) and key != "NEURON_VENV"
    ]
    assert env["GLOO_SOCKET_IFNAME"] == "ens5"


def test_run_training_document_runs_launch_and_keeps_a_log_in_the_job(node: FakeNode) -> None:
    values = {
        "Hosts": "10.1.0.12,10.1.0.40", "JobId": "bert-1", "MasterPort": "29500",
        "NprocPerNode": "2", "TrainArgs": "--data /fsx/data/imdb --model tiny --max-steps 5",
    }  # fmt: skip
    result = node.run_document("RunTraining", values)
    assert result.returncode == 0, result.stderr
    assert node.torchrun_args()[10:] == [
        f"{node.workload}/train.py", "--output", f"{node.fsx}/jobs/bert-1",
        "--data", "/fsx/data/imdb", "--model", "tiny", "--max-steps", "5",
    ]  # fmt: skip
    log = (node.fsx / "jobs" / "bert-1" / "logs" / "node-0-10.1.0.12.log").read_text()
    assert "fake torchrun on rank 0" in log
    assert "job bert-1: torchrun finished on node rank 0" in log
    assert (node.logs / "jobs" / "bert-1.log").read_text() == log


def test_launch_passes_on_the_training_exit_status(node: FakeNode) -> None:
    result = node.run("launch.sh", "--hosts", "10.1.0.12", "--job-id", "j", "--nproc-per-node", "1",
                      FAKE_TORCHRUN_EXIT="3")  # fmt: skip
    assert result.returncode == 3
    assert "job j: torchrun failed with status 3 on node rank 0 (10.1.0.12)" in result.stdout


def test_launch_refuses_a_node_whose_bootstrap_has_not_finished(node: FakeNode) -> None:
    (node.state / "ready").unlink()
    result = node.run("launch.sh", "--hosts", "10.1.0.12", "--job-id", "j", "--nproc-per-node", "1")
    assert result.returncode == 1
    assert errors(result) == [
        f"this node is not ready: bootstrap has not finished (no {node.state}/ready; "
        f"see {node.logs}/bootstrap.log)"
    ]


# ------------------------------------------------ launch: the agent's cancel, the leg's end
# A worker for the real torchrun (torch 2.9 starts each worker with start_new_session=True,
# torch/distributed/elastic/multiprocessing/subprocess_handler): it reports its PID, and on
# SIGTERM does what workload/train.py does (save, exit 0) after a short "save".
WORKER = """
import os, signal, sys, time
out = os.environ["WORKER_DIR"]
open(os.path.join(out, f"worker-{os.getpid()}.pid"), "w").close()
def term(signum, frame):
    time.sleep(0.5)
    open(os.path.join(out, "saved"), "w").write(str(os.getpid()))
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def worker_pids(node: FakeNode) -> list[int]:
    return [int(p.stem.split("-")[1]) for p in node.root.glob("worker-*.pid")]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def job_processes(job: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"TRAINIUM_JOB_ID={job}".encode() in environ and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
def test_nothing_of_the_job_survives_the_agents_sigkill_of_the_process_group(
    node: FakeNode,
) -> None:
    """The SSM agent ends a cancelled or timed-out command with kill(-pgid, SIGKILL)
    (aws/amazon-ssm-agent agent/executers/executers_unix.go): no trap runs. torchrun's
    workers sit in sessions of their own; the leg's watchdog must end them."""
    env = real_torchrun(node)
    launch = subprocess.Popen(
        ["sh", "-c", f"bash {NODE / 'launch.sh'} --hosts 127.0.0.1 --job-id cancelled "
         f"--nproc-per-node 2 --master-port {free_port()}"],
        env=node.env(**env), process_group=0, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_for(lambda: len(worker_pids(node)) == 2, 60, "two torchrun workers")
        workers = worker_pids(node)
        assert all(os.getsid(pid) == pid for pid in workers), "workers left the agent's session"
        os.killpg(launch.pid, signal.SIGKILL)
        launch.wait(timeout=10)
        # A process in the middle of exiting has no environment to read any more but is not a
        # zombie yet: wait for the workers themselves too, not only for the tagged processes.
        wait_for(
            lambda: not job_processes("cancelled") and not any(alive(pid) for pid in workers),
            30,
            "the job's processes to end",
        )
    finally:
        for pid in job_processes("cancelled"):
            os.kill(pid, signal.SIGKILL)
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
        launch.communicate(timeout=10)


@pytest.mark.slow
def test_a_leg_ends_itself_before_the_time_limit_with_a_checkpoint(node: FakeNode) -> None:
    env = real_torchrun(node)
    start = time.monotonic()
    result = node.run(
        "launch.sh", "--hosts", "127.0.0.1", "--job-id", "long", "--nproc-per-node", "1",
        "--master-port", str(free_port()), "--time-limit", "40", "--stop-grace", "25", **env,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert result.returncode == 75, result.stderr
    assert (node.root / "saved").is_file(), "the trainer did not get its SIGTERM"
    # The timer fires 15 s in (40 - 25): a bound on torchrun starting its worker, which takes
    # a few seconds on a busy machine; the leg then ends well before the 40-s limit.
    assert 15 <= elapsed < 40, elapsed
    output = result.stdout + result.stderr
    assert "leg time limit reached" in output
    assert "leg ended at its time limit" in output
    assert not job_processes("long")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--time-limit", "172801"], "--time-limit '172801' is not allowed: use 0 (no limit) or "
         "seconds up to 172800 (the SSM limit of one command)"),
        (["--time-limit", "600", "--stop-grace", "600"], "--stop-grace 600 leaves no time to "
         "train within --time-limit 600: use fewer seconds than the limit"),
        (["--stop-grace", "soon"], "--stop-grace 'soon' is not a number of seconds"),
    ],
)  # fmt: skip
def test_launch_refuses_a_bad_time_limit(node: FakeNode, args: list[str], message: str) -> None:
    result = node.run("launch.sh", *ONE, "--nproc-per-node", "1", *args)
    assert result.returncode == 1
    assert errors(result) == [message]


def test_launch_stops_what_an_earlier_job_left_on_the_node(node: FakeNode) -> None:
    leftover = tagged("an-older-job")
    try:
        result = node.run("launch.sh", *ONE, "--nproc-per-node", "1")
        assert result.returncode == 0, result.stderr
        assert leftover.wait(timeout=60) == -signal.SIGTERM
        assert "stopped processes left over from an earlier job or attempt" in result.stdout
    finally:
        if leftover.poll() is None:
            leftover.kill()
            leftover.wait()


# --------------------------------------------------------------------------------- stop
def tagged(job: str, *, ignore_term: bool = False) -> subprocess.Popen[str]:
    """A process tagged the way launch.sh tags a job's processes, returned once it is ready:
    its trap set (and its child started) when it ignores SIGTERM."""
    env = {**os.environ, "TRAINIUM_JOB_ID": job, "TRAINIUM_NODE_ADDRESS": "10.1.0.12"}
    script = (
        "trap '' TERM; sleep 300 & echo ready; wait"
        if ignore_term
        else "echo ready; exec sleep 300"
    )
    process = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    return process


def test_stop_ends_only_the_jobs_processes(node: FakeNode) -> None:
    target = tagged("bert-1")
    stubborn = tagged("bert-1", ignore_term=True)
    other = tagged("bert-2")
    try:
        result = node.run("stop.sh", "--job-id", "bert-1", "--grace", "2")
        assert result.returncode == 0, result.stderr
        assert target.wait(timeout=60) == -signal.SIGTERM
        assert stubborn.wait(timeout=60) == -signal.SIGKILL
        assert other.poll() is None
        assert "sending SIGKILL to processes still running after 2 s" in result.stderr
        again = node.run("stop.sh", "--job-id", "bert-1")
        assert "job bert-1 has no running processes on this node" in again.stderr
    finally:
        for process in (target, stubborn, other):
            if process.poll() is None:
                process.kill()
                process.wait()


def test_stop_document_runs_stop(node: FakeNode) -> None:
    result = node.run_document("StopTraining", {"JobId": "nothing-running"})
    assert result.returncode == 0, result.stderr
    assert "job nothing-running has no running processes on this node" in result.stderr


# ---------------------------------------------------------------------------- preflight
def healthy_trainium(node: FakeNode) -> None:
    node.trainium()
    node.tool("lsmod", "#!/usr/bin/env bash\necho 'neuron 462848 0'\n")
    node.tool("dmesg", "#!/usr/bin/env bash\necho '[ 1.0] neuron: driver loaded'\n")
    node.tool(
        "fi_info",
        "#!/usr/bin/env bash\n"
        "for i in 0 1; do echo 'provider: efa'; echo \"    domain: rdmap${i}-rdm\"; done\n",
    )
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
    assert "FAIL collective: all-reduce across 2 nodes failed (status 1)" in result.stderr
    assert "preflight FAILED on 10.1.0.12: efa fsx collective" in result.stderr


def test_preflight_waits_for_the_ready_marker_and_reports_a_missing_one(node: FakeNode) -> None:
    (node.state / "ready").unlink()
    result = node.run("preflight.sh", "--hosts", "10.1.0.12", "--wait-ready", "0",
                      "--nproc-per-node", "1", "--min-free-gb", "0")  # fmt: skip
    assert result.returncode == 1
    assert "FAIL ready: bootstrap has not finished after 0 s" in result.stderr


def preflight_on_two_nodes(
    node: FakeNode, versions: tuple[str | None, str | None]
) -> list[subprocess.CompletedProcess[str]]:
    """preflight.sh on two loopback nodes at once, with the project's own torchrun running
    collective_check.py for real (gloo); each node's node.env carries its SOFTWARE_VERSION
    (None: no node.env, as on nodes older than the variables)."""
    healthy_trainium(node)
    env = real_torchrun(node)
    node.settings["PREFLIGHT_MIN_FREE_GB"] = "0"
    node.write_env()
    hosts, port = ("127.0.0.1", "127.0.0.2"), str(free_port())
    runs = []
    for address, version in zip(hosts, versions, strict=True):
        node_env = node.root / f"node-{address}.env"
        if version is not None:
            node_env.write_text(
                f"AMI_ID=ami-0123456789abcdef0\nLAUNCH_TEMPLATE_VERSION=7\nSOFTWARE_VERSION={version}\n"
            )
        command = [
            "bash", str(NODE / "preflight.sh"), "--hosts", ",".join(hosts), "--port", port,
            "--node-address", address, "--nproc-per-node", "1",
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


# --------------------------------------------------------------------------- precompile
def test_precompile_runs_the_job_under_neuron_parallel_compile(node: FakeNode) -> None:
    """neuron_parallel_compile sits in the Neuron venv's bin (not on Run Command's PATH):
    precompile.sh finds it by activating NEURON_VENV itself."""
    venv = node.root / "neuron-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'PATH="{venv}/bin:$PATH"\n')
    npc = venv / "bin" / "neuron_parallel_compile"
    npc.write_text('#!/usr/bin/env bash\nprintf \'%s\\n\' "$@" > "$FAKE_DIR/npc.args"\n')
    npc.chmod(0o755)
    node.settings["NEURON_VENV"] = str(venv)
    node.write_env()
    scratch = node.root / "scratch"
    values = {
        "Hosts": "10.1.0.12,10.1.0.40", "JobId": "bert-1", "MasterPort": "29500",
        "NprocPerNode": "2", "Steps": "7", "TrainArgs": "--model tiny",
    }  # fmt: skip
    result = node.run_document("Precompile", values, TRAINIUM_PRECOMPILE_DIR=str(scratch))
    assert result.returncode == 0, result.stderr
    args = (node.root / "npc.args").read_text().splitlines()
    assert args[0] == "torchrun"
    assert args[args.index("--output") + 1] == f"{scratch}/bert-1"
    assert args[-4:] == ["--model", "tiny", "--max-steps", "7"]
    assert not (node.fsx / "jobs" / "bert-1").exists()  # the real job's output stays untouched


def test_precompile_needs_the_neuron_sdk(node: FakeNode) -> None:
    result = node.run("precompile.sh", "--hosts", "10.1.0.12", "--job-id", "j")
    assert result.returncode == 1
    assert errors(result) == [
        "neuron_parallel_compile not found: precompiling needs the Neuron SDK "
        f"(NEURON_VENV={node.root / 'no-venv'} has none)"
    ]
