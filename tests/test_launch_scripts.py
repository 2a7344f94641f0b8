"""The node scripts (scripts/node/*.sh) but preflight, against fake node tools.

The fake node is tests/node_support.py; preflight's tests are tests/test_preflight.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from scripts.rehearsal.ssm_agent import agent_environment
from scripts.rehearsal.ssm_agent.runscript import plugin_result, start_script
from tests.node_support import (
    NODE,
    NODE_ADDRESS,
    REPO_ROOT,
    FakeNode,
    document_command,
    errors,
    free_port,
    loopback_address,
    real_torchrun,
    tagged,
    trainium_devices,
    unique_job_id,
)

#: The test node's address: this test process's own (NODE_ADDRESS says why).
ADDRESS = NODE_ADDRESS


@pytest.fixture
def node(tmp_path: Path) -> FakeNode:
    return FakeNode(tmp_path, address=ADDRESS)


# --------------------------------------------------------------------------- shellcheck
def test_shellcheck_passes_on_every_node_script() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (make setup installs it)")
    scripts = sorted(str(p.relative_to(REPO_ROOT)) for p in NODE.glob("*.sh"))
    assert len(scripts) == 9
    result = subprocess.run(
        ["shellcheck", "--severity=style", *scripts], cwd=REPO_ROOT, capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize(
    "script",
    [
        "launch.sh",
        "preflight.sh",
        "precompile.sh",
        "stop.sh",
        "bootstrap.sh",
        "termination_watch.sh",
    ],
)
def test_help_prints_the_usage(script: str, node: FakeNode) -> None:
    result = node.run(script, "--help")
    assert result.returncode == 0
    assert f"{script} " in result.stdout
    assert "set -E" not in result.stdout


# ------------------------------------------------------------------------------- launch
def test_launch_finds_its_rank_from_its_own_address(node: FakeNode) -> None:
    result = node.run(
        "launch.sh", "--hosts", f"10.1.0.5,{ADDRESS},10.1.0.40", "--job-id", "bert-1",
        "--nproc-per-node", "2", "--dry-run", "--", "--model", "tiny",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    command = result.stdout.strip().splitlines()[-1].split()
    assert command == [
        "torchrun", "--nnodes", "3", "--node_rank", "1", "--master_addr", "10.1.0.5",
        "--master_port", "29500", "--nproc_per_node", "2", "-m", "workload.train",
        "--model", "tiny",
    ]  # fmt: skip
    # The job's directory comes through the contract's environment, not --output.
    assert f"TRAINIUM_OUTPUT_DIR={node.fsx}/jobs/bert-1" in result.stdout
    assert f"TRAINIUM_CHECKPOINT_DIR={node.fsx}/jobs/bert-1/checkpoints" in result.stdout
    assert f"TRAINIUM_CODE_DIR={node.code}" in result.stdout
    assert f"PYTHONPATH={node.code}" in result.stdout
    assert "TRAINIUM_LEG_DEADLINE=0" in result.stdout
    assert "GLOO_SOCKET_IFNAME=ens5" in result.stdout
    assert "TRAINIUM_NODE_RANK=1" in result.stdout


def test_launch_takes_an_explicit_node_address(node: FakeNode) -> None:
    result = node.run(
        "launch.sh", "--hosts", "127.0.0.1,127.0.0.2", "--job-id", "j", "--nproc-per-node", "1",
        "--node-address", "127.0.0.2", "--jobs-root", str(node.root / "jobs"), "--dry-run",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "--node_rank 1 --master_addr 127.0.0.1" in result.stdout
    assert f"TRAINIUM_OUTPUT_DIR={node.root}/jobs/j\n" in result.stdout
    assert "GLOO_SOCKET_IFNAME=lo" in result.stdout


ONE = ["--hosts", ADDRESS, "--job-id", "j"]
BAD_INPUT = [
    (["--job-id", "j"],
     "--hosts is required: the comma-separated addresses of all nodes, master first"),
    (["--hosts", ADDRESS], "--job-id is required"),
    (["--hosts", ADDRESS, "--job-id", "a;b"],
     "--job-id 'a;b' is not allowed: use 1-64 letters, digits, '.', '_' or '-', "
     "starting with a letter or digit"),
    (["--hosts", f"{ADDRESS},{ADDRESS}", "--job-id", "j"],
     f"--hosts lists {ADDRESS} twice: every node must appear once"),
    (["--hosts", f"{ADDRESS},node-b", "--job-id", "j"],
     "--hosts entry 'node-b' is not an IPv4 address: give the nodes' private addresses, "
     "comma separated"),
    (["--hosts", "10.9.9.1,10.9.9.2", "--job-id", "j"],
     f"none of --hosts (10.9.9.1 10.9.9.2) is an address of this node (127.0.0.1,{ADDRESS}); "
     "pass --node-address"),
    ([*ONE, "--node-address", "10.1.0.13"],
     f"--node-address 10.1.0.13 is not in --hosts {ADDRESS}"),
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
     "unknown option '--bogus': options come first, then -- and the entry point's arguments "
     "(see --help)"),
    (["--hosts"], "--hosts needs a value (see --help)"),
]  # fmt: skip


# The IDs name the address as <address>: it is drawn per test process (node_support), and
# pytest-xdist needs every worker to collect the same test IDs.
@pytest.mark.parametrize(
    ("args", "message"), BAD_INPUT, ids=[m.replace(ADDRESS, "<address>") for _, m in BAD_INPUT]
)
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
    result = node.run("launch.sh", "--hosts", f"{ADDRESS},10.1.0.40", "--job-id", "bert-1",
                      "--master-port", "41000", "--", "--model", "tiny")  # fmt: skip
    assert result.returncode == 0, result.stderr
    args = node.torchrun_args()
    assert args[:10] == [
        "--nnodes", "2", "--node_rank", "0", "--master_addr", ADDRESS, "--master_port",
        "41000", "--nproc_per_node", "32",
    ]  # fmt: skip
    env = node.torchrun_env()
    assert env["FI_PROVIDER"] == "efa"
    assert env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["FI_EFA_FORK_SAFE"] == "1"
    assert env["NEURON_RT_ROOT_COMM_ID"] == f"{ADDRESS}:41001"
    assert env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"
    assert env["NEURON_COMPILE_CACHE_URL"] == f"{node.fsx}/neuron-compile-cache"
    assert env["MALLOC_ARENA_MAX"] == "64"
    assert env["CCOM_SOCKET_IFNAME"] == "ens5"
    flags = env["NEURON_CC_FLAGS"].split()
    assert "--model-type=transformer" in flags
    assert "--auto-cast=none" in flags  # precision is train.py's (test_workload_precision.py)
    assert any(flag.startswith("--optlevel=") for flag in flags)
    # Neuron's persistent cache documentation: without it a failed or interrupted compile in
    # the shared cache is skipped ("Got a cached failed neff") by every later run.
    assert "--retry_failed_compilation" in flags
    assert env["TRAINIUM_JOB_ID"] == "bert-1"
    assert env["PYTHONPATH"].split(":")[0] == str(node.code)


# neuron-ls -j as the Neuron LS User Guide shows it (tools/neuron-sys-tools/neuron-ls.rst): a
# trn1.32xlarge has 16 devices of 2 NeuronCores; a trn2.48xlarge 16 devices of 8 physical
# NeuronCore-v3 that the default logical NeuronCore configuration 2 pairs into 4 logical ones,
# which is what nc_count reports there ("nc_count": 4, "logical_neuroncore_config": 2).
TRN2_DEVICE = {"nc_count": 4, "logical_neuroncore_config": 2, "memory_size": 103079215104,
               "neuron_processes": []}  # fmt: skip


@pytest.mark.parametrize(
    ("devices", "processes"),
    [
        (trainium_devices(count=16, cores=2), 32),
        ([{**TRN2_DEVICE, "neuron_device": i} for i in range(16)], 64),
    ],
    ids=["trn1.32xlarge", "trn2.48xlarge-lnc2"],
)
def test_auto_starts_one_process_per_logical_neuron_core(
    node: FakeNode, devices: list[dict[str, Any]], processes: int
) -> None:
    node.trainium(devices)
    result = node.run("launch.sh", "--hosts", ADDRESS, "--job-id", "j", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert f"--nproc_per_node {processes} " in result.stdout


def test_neuron_cc_flags_can_be_overridden(node: FakeNode) -> None:
    node.trainium()
    node.settings["NEURON_CC_FLAGS"] = "--model-type=transformer --auto-cast=none --optlevel=1"
    node.write_env()
    result = node.run("launch.sh", "--hosts", ADDRESS, "--job-id", "j")
    assert result.returncode == 0, result.stderr
    # ... but a failed entry in the shared compile cache is always compiled again.
    assert (
        node.torchrun_env()["NEURON_CC_FLAGS"]
        == "--model-type=transformer --auto-cast=none --optlevel=1 --retry_failed_compilation"
    )
    node.settings["NEURON_CC_FLAGS"] = "--retry_failed_compilation --optlevel=1"
    node.write_env()
    assert node.run("launch.sh", "--hosts", ADDRESS, "--job-id", "j").returncode == 0
    assert node.torchrun_env()["NEURON_CC_FLAGS"] == "--retry_failed_compilation --optlevel=1"


def test_launch_refuses_more_processes_than_neuron_cores(node: FakeNode) -> None:
    node.trainium(trainium_devices(count=1, cores=2))
    result = node.run("launch.sh", "--hosts", ADDRESS, "--job-id", "j", "--nproc-per-node", "4")
    assert errors(result) == ["--nproc-per-node 4 exceeds the 2 NeuronCores of this node"]


def test_launch_elsewhere_leaves_neuron_variables_unset(node: FakeNode) -> None:
    result = node.run("launch.sh", "--hosts", ADDRESS, "--job-id", "j", "--nproc-per-node", "2")
    assert result.returncode == 0, result.stderr
    env = node.torchrun_env()
    assert not [
        key for key in env if key.startswith(("FI_", "NEURON_", "CCOM_")) and key != "NEURON_VENV"
    ]
    assert env["GLOO_SOCKET_IFNAME"] == "ens5"


def test_run_training_document_runs_launch_and_keeps_a_log_in_the_job(node: FakeNode) -> None:
    values = {
        "Hosts": f"{ADDRESS},10.1.0.40", "JobId": "bert-1", "MasterPort": "29500",
        "NprocPerNode": "2", "TrainArgs": "--data /fsx/data/imdb --model tiny --max-steps 5",
    }  # fmt: skip
    result = node.run_document("RunTraining", values)
    assert result.returncode == 0, result.stderr
    assert node.torchrun_args()[10:] == [
        "-m", "workload.train", "--data", "/fsx/data/imdb", "--model", "tiny", "--max-steps", "5",
    ]  # fmt: skip
    log = (node.fsx / "jobs" / "bert-1" / "logs" / f"node-0-{ADDRESS}.log").read_text()
    assert "fake torchrun on rank 0" in log
    assert "job bert-1: torchrun finished on node rank 0" in log
    assert (node.logs / "jobs" / "bert-1.log").read_text() == log


@pytest.mark.parametrize("status", [0, 1, 3, 4])
def test_launch_passes_on_the_contracts_exit_statuses(node: FakeNode, status: int) -> None:
    result = node.run("launch.sh", "--hosts", ADDRESS, "--job-id", "j", "--nproc-per-node", "1",
                      FAKE_TORCHRUN_EXIT=str(status))  # fmt: skip
    assert result.returncode == status
    if status:
        assert f"job j: torchrun failed with status {status} on node rank 0 ({ADDRESS})" in (
            result.stdout
        )
    assert "reporting 1" not in result.stdout + result.stderr


# A job whose compiles failed, with the lines Neuron's documentation shows for them: the
# cache's wrapper skipping a failed entry (Neuron persistent cache documentation,
# neuron-caching.rst), the runtime failing to read an entry on a shared file system (the
# PyTorch 2.x application note, introducing-pytorch-2-x.rst), a compiler log line naming the
# module only ("<time>: <pid> [INFO]: Compilation Successfully Completed for
# model.MODULE_<hash>+<flags>.hlo_module.pb" in the NKI quickstart, here at ERROR); and one
# that succeeded.
FAILED_COMPILES = """#!/usr/bin/env bash
echo "INFO ||NCC_WRAPPER||: Using a cached neff at $CACHE/neuronxcc-2.24.8799.0+f1d1b0b0/\
MODULE_198775565831884870+d41d8cd9/model.neff. Exiting with a successfully compiled graph."
echo "INFO ||NCC_WRAPPER||: Got a cached failed neff at $CACHE/neuronxcc-2.24.8799.0+f1d1b0b0/\
MODULE_12486829708343293975+d41d8cd9/model.neff. Will skip compilation, please set \
--retry_failed_compilation for recompilation."
echo "[rank3]: RuntimeError: Bad StatusOr access: INVALID_ARGUMENT: RunNeuronCCImpl: error \
condition !(error != 400): <class 'OSError'>: [Errno 61] No data available: \
'$CACHE/neuronxcc-2.24.8799.0+f1d1b0b0/MODULE_3540044791706521849+4eb52b03/model.neff' -> \
'/tmp/tmpx7bvfpmm/model.neff'"
echo "2026-04-13 01:46:33.000003: 837617 [ERROR]: Compilation failed for \
model.MODULE_9886333626096130500+70e3f644.hlo_module.pb"
exit 1
"""


def test_a_failed_compile_is_named_by_its_compile_cache_entry(node: FakeNode) -> None:
    """The job's log and the agent's output name each compile cache entry the failed
    compiles of this leg left (MODULE_<graph hash>+<flags hash> under neuronxcc-<version>);
    a later leg's failure does not name the earlier leg's entries again."""
    node.trainium()
    cache = node.fsx / "neuron-compile-cache"
    looked_up = cache / "neuronxcc-2.24.8799.0+f1d1b0b0" / "MODULE_9886333626096130500+70e3f644"
    looked_up.mkdir(parents=True)
    (looked_up / "model.hlo_module.pb").write_bytes(b"")
    node.tool("torchrun", FAILED_COMPILES)
    result = node.run("launch.sh", "--hosts", ADDRESS, "--job-id", "j", "--nproc-per-node",
                      "1", CACHE=str(cache))  # fmt: skip
    assert result.returncode == 1, result.stdout
    named = [
        line.split("its compile cache entry: ", 1)[1]
        for line in result.stdout.splitlines()
        if "a Neuron compile failed; its compile cache entry: " in line
    ]
    version = cache / "neuronxcc-2.24.8799.0+f1d1b0b0"
    assert named == [
        f"{version}/MODULE_12486829708343293975+d41d8cd9 (the next attempt compiles it again: "
        "NEURON_CC_FLAGS has --retry_failed_compilation)",
        f"{version}/MODULE_3540044791706521849+4eb52b03 (the next attempt compiles it again: "
        "NEURON_CC_FLAGS has --retry_failed_compilation)",
        f"{looked_up} (the next attempt compiles it again: NEURON_CC_FLAGS has "
        "--retry_failed_compilation)",
    ], result.stdout
    log = (node.logs / "jobs" / "j.log").read_text()
    assert all(f"its compile cache entry: {entry}" in log for entry in named)
    node.tool("torchrun", "#!/usr/bin/env bash\necho 'a failure of another kind'\nexit 1\n")
    again = node.run("launch.sh", "--hosts", ADDRESS, "--job-id", "j", "--nproc-per-node",
                     "1", CACHE=str(cache))  # fmt: skip
    assert again.returncode == 1
    # The job's log keeps the first leg's three lines (the agent's tail shows them too), and
    # the second leg adds none.
    assert (node.logs / "jobs" / "j.log").read_text().count("its compile cache entry: ") == 3


# The SSM agent reads some exit statuses itself (aws/amazon-ssm-agent
# agent/plugins/pluginutil/pluginutil_unix.go GetStatus): 194 reboots the instance, 137 is
# TimedOut though the agent killed nothing, 168 ends the document with success
# (runpluginutil.go). plugin_result is the stand-in's copy of those rules.
ODD_STATUSES = [
    (137, "killed by SIGKILL: out of memory? the SSM agent would report a time-out"),
    (194, "the SSM agent would take it as a request to reboot the instance"),
    (168, "the SSM agent would end the document there with success or failure"),
    (143, "killed by SIGTERM"),
    (2, "not a status of the scripts' contract: 0, 1, 3, 4, 75"),
]


@pytest.mark.parametrize(("status", "meaning"), ODD_STATUSES)
def test_launch_reports_any_other_status_of_torchrun_as_1(
    node: FakeNode, status: int, meaning: str
) -> None:
    values = {"Hosts": ADDRESS, "JobId": "j", "NprocPerNode": "1"}
    result = node.run_document("RunTraining", values, FAKE_TORCHRUN_EXIT=str(status))
    assert result.returncode == 1
    assert plugin_result(result.returncode)[0] == "Failed"
    assert f"torchrun ended with status {status} ({meaning}); reporting 1" in result.stdout


def test_a_75_of_torchrun_is_not_a_legs_end(node: FakeNode) -> None:
    result = node.run("launch.sh", "--hosts", ADDRESS, "--job-id", "j", "--nproc-per-node", "1",
                      FAKE_TORCHRUN_EXIT="75")  # fmt: skip
    assert result.returncode == 1
    assert (
        "torchrun ended with status 75, which only a leg that launch.sh ended at its time limit "
        "reports; reporting 1"
    ) in result.stdout


def test_a_failing_command_of_the_script_itself_is_reported_as_1(node: FakeNode) -> None:
    """The ERR trap (on_err) exits with the failed command's status; the EXIT trap maps it."""
    node.tool("mkdir", "#!/usr/bin/env bash\nexit 137\n")  # a tool that fails oddly
    result = node.run("launch.sh", "--hosts", ADDRESS, "--job-id", "j", "--nproc-per-node", "1")
    assert result.returncode == 1
    assert (
        errors(result)[0].startswith("'mkdir -p ") and "failed with status 137" in errors(result)[0]
    )
    assert "launch.sh ended with status 137 (killed by SIGKILL" in result.stderr


def test_launch_refuses_a_node_whose_bootstrap_has_not_finished(node: FakeNode) -> None:
    (node.state / "ready").unlink()
    result = node.run("launch.sh", "--hosts", ADDRESS, "--job-id", "j", "--nproc-per-node", "1")
    assert result.returncode == 1
    assert errors(result) == [
        f"this node is not ready: bootstrap has not finished (no {node.state}/ready; "
        f"see {node.logs}/bootstrap.log)"
    ]


# ------------------------------------------------ launch: the agent's cancel, the leg's end
# A worker for the real torchrun (torch 2.9 starts each worker with start_new_session=True,
# torch/distributed/elastic/multiprocessing/subprocess_handler): it reports its PID, and on
# SIGTERM does what workload/train.py does (save, exit 0) after a short "save".
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
    job = unique_job_id("cancelled")
    launch = subprocess.Popen(
        ["sh", "-c", f"bash {NODE / 'launch.sh'} --hosts {node.loopback} --job-id {job} "
         f"--nproc-per-node 2 --master-port {free_port()} --code-dir {node.code}"],
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
            lambda: not job_processes(job) and not any(alive(pid) for pid in workers),
            30,
            "the job's processes to end",
        )
    finally:
        for pid in job_processes(job):
            os.kill(pid, signal.SIGKILL)
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
        launch.communicate(timeout=10)


@pytest.mark.slow
def test_a_leg_ends_itself_before_the_time_limit_with_a_checkpoint(node: FakeNode) -> None:
    """The leg timer fires 2 s in (30 - 28) while the worker is not yet handling SIGTERM (it
    waits for a gate the test opens only after launch.sh logged the leg's end): the worker is
    asked once it handles SIGTERM, saves, and the leg ends with 75, however late torchrun
    started it. Asked earlier, it would have died of the signal; asked only when the timer
    fired, never."""
    job = unique_job_id("long")
    gate = node.root / "handler-gate"
    env = {**real_torchrun(node), "WORKER_HANDLER_AFTER": str(gate)}
    output_path = node.root / "launch.out"
    start = time.monotonic()
    with output_path.open("w") as output_file:
        launch = subprocess.Popen(
            ["bash", str(NODE / "launch.sh"), "--hosts", node.loopback, "--job-id", job,
             "--nproc-per-node", "1", "--master-port", str(free_port()),
             "--time-limit", "30", "--stop-grace", "28", "--code-dir", str(node.code)],
            stdout=output_file, stderr=subprocess.STDOUT, text=True, env=node.env(**env),
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(lambda: "leg time limit reached" in output_path.read_text(), 120, "the leg end")
        wait_for(lambda: list(node.root.glob("worker-*.pid")), 120, "the worker to start")
        assert not (node.root / "saved").exists()
        gate.touch()
        assert launch.wait(timeout=120) == 75, output_path.read_text()
    finally:
        for pid in job_processes(job):
            os.kill(pid, signal.SIGKILL)
        if launch.poll() is None:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.wait(timeout=10)
    assert time.monotonic() - start >= 2
    assert (node.root / "saved").is_file(), "the trainer did not get its SIGTERM"
    output = output_path.read_text()
    assert output.count("leg time limit reached") == 1, output
    assert "leg ended at its time limit" in output
    assert not job_processes(job)


# torch 2.9's torchrun SIGKILLs its workers 30 s after it passes them a SIGTERM
# (torch/distributed/elastic/multiprocessing/api.py, SubprocessContext._close(timeout=30)):
# a save longer than that survives a stop only if the workers get the signal, not torchrun.
LONG_SAVE_SECONDS = 35


def start_job(node: FakeNode, job: str, *args: str, **extra: str) -> subprocess.Popen[str]:
    """launch.sh (more options: `args`) with the real torchrun and two workers whose save
    takes 35 s, returned once both workers run."""
    env = {**real_torchrun(node), "WORKER_SAVE_SECONDS": str(LONG_SAVE_SECONDS), **extra}
    launch = subprocess.Popen(
        ["bash", str(NODE / "launch.sh"), "--hosts", node.loopback, "--job-id", job,
         "--nproc-per-node", "2", "--master-port", str(free_port()), "--code-dir", str(node.code),
         *args],
        env=node.env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    wait_for(lambda: len(worker_pids(node)) == 2, 60, "two torchrun workers")
    return launch


def end_job(job: str, launch: subprocess.Popen[str]) -> None:
    for pid in job_processes(job):
        os.kill(pid, signal.SIGKILL)
    if launch.poll() is None:
        launch.kill()
    launch.communicate(timeout=60)


def saves_done(node: FakeNode) -> dict[int, bool]:
    return {pid: (node.root / f"saved-{pid}").exists() for pid in worker_pids(node)}


@pytest.mark.slow
def test_stop_gives_the_trainers_their_whole_grace_to_save(node: FakeNode) -> None:
    job = unique_job_id("saving")
    launch = start_job(node, job)
    try:
        result = node.run("stop.sh", "--job-id", job, "--grace", "120",
                          "--node-address", node.loopback)  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert saves_done(node) == dict.fromkeys(worker_pids(node), True), (
            f"a {LONG_SAVE_SECONDS}-s save was cut short under a 120-s grace: {result.stderr}"
        )
        output, _ = launch.communicate(timeout=60)
        assert launch.returncode == 0, output
        assert not job_processes(job)
        assert "sending SIGKILL" not in result.stderr
    finally:
        end_job(job, launch)


def test_a_torchrun_slow_to_see_its_workers_exit_still_ends_by_itself(node: FakeNode) -> None:
    """After the trainers have saved and exited, stop.sh waits for torchrun to exit by itself
    for what is left of the grace. On a loaded machine torchrun took more than the 5 s stop.sh
    used to give it; its SIGTERM then made torchrun's status 143 and a clean stop a failed
    leg (launch.sh's 1). Here torchrun is held (SIGSTOP) until 8 s after its workers exited."""
    job = unique_job_id("slow-torchrun")
    launch = start_job(node, job, WORKER_SAVE_SECONDS="0.5")
    try:
        workers = worker_pids(node)
        (torchrun,) = {int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                       for pid in workers}  # fmt: skip
        os.kill(torchrun, signal.SIGSTOP)
        stop = subprocess.Popen(
            ["bash", str(NODE / "stop.sh"), "--job-id", job, "--grace", "120",
             "--node-address", node.loopback],
            env=node.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        wait_for(lambda: not any(alive(pid) for pid in workers), 60, "the workers' exit")
        time.sleep(8)  # a hold longer than the old 5 s, not a race: the grace is 120 s
        os.kill(torchrun, signal.SIGCONT)
        _, stderr = stop.communicate(timeout=60)
        assert stop.returncode == 0, stderr
        assert saves_done(node) == dict.fromkeys(workers, True)
        assert "remaining processes" not in stderr, stderr
        output, _ = launch.communicate(timeout=60)
        assert launch.returncode == 0, output
    finally:
        end_job(job, launch)


def descendants(pid: int) -> dict[int, int]:
    """{pid: parent} of every process below `pid` (/proc/<pid>/task/*/children)."""
    found: dict[int, int] = {}
    parents = [pid]
    while parents:
        parent = parents.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for child in children:
                found[child] = parent
                parents.append(child)
    return found


def command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_launch_sh_s_own_sleeps_are_not_processes_of_the_job(node: FakeNode) -> None:
    """What a stop on the node takes for the job's processes (lib.sh job_pids: the tagged
    ones) is torchrun and its workers, never launch.sh's sleeps beside them: its look every
    0.5 s for torchrun's end and the leg timer. stop.sh took the look's sleep for a leftover
    of a clean stop ("sending SIGTERM to 1 remaining processes"), and killed it. Looked at
    until both sleeps were seen at once (the timer's runs for the whole leg)."""
    job = unique_job_id("sleeps")
    launch = start_job(node, job, "--time-limit", "3600")
    job_pids = ["bash", "-c", 'source "$1"; job_pids "$2"', "job_pids", str(NODE / "lib.sh"), job]
    try:
        workers = set(worker_pids(node))
        seen = {"poll": False, "timer": False}

        def both_sleeps_seen_untagged() -> bool:
            below = descendants(launch.pid)
            sleeps = {pid: parent for pid, parent in below.items() if command_name(pid) == "sleep"}
            tagged = subprocess.run(
                job_pids, env=node.env(), capture_output=True, text=True, check=True
            ).stdout.split()
            ours = {int(pid) for pid in tagged}
            assert not ours & set(sleeps), f"launch.sh's sleeps {sorted(sleeps)} are tagged"
            torchruns = {below[w] for w in workers}
            assert ours == workers | torchruns, (ours, workers, torchruns)
            still = set(sleeps) & set(descendants(launch.pid))
            seen["poll"] |= any(sleeps[pid] == launch.pid for pid in still)
            seen["timer"] |= any(sleeps[pid] != launch.pid for pid in still)
            return all(seen.values())

        wait_for(both_sleeps_seen_untagged, 60, "launch.sh's poll and timer sleeps")
    finally:
        # The leg timer would hold launch.sh's output open for its hour (the agent's SIGKILL
        # goes to the whole process group, this test's to the processes it knows).
        for pid in descendants(launch.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        end_job(job, launch)


@pytest.mark.slow
def test_a_term_to_launch_gives_the_trainers_the_stop_grace_to_save(node: FakeNode) -> None:
    job = unique_job_id("termed")
    launch = start_job(node, job)
    try:
        launch.send_signal(signal.SIGTERM)
        output, _ = launch.communicate(timeout=LONG_SAVE_SECONDS + 60)
        assert saves_done(node) == dict.fromkeys(worker_pids(node), True), output
        assert "asked to stop" in output
        assert launch.returncode == 0, output
        assert not job_processes(job)
    finally:
        end_job(job, launch)


@pytest.mark.slow
def test_launch_stops_the_workers_a_killed_torchrun_left(node: FakeNode) -> None:
    """The OOM killer's SIGKILL to torchrun leaves its workers running in sessions of their
    own (start_new_session=True); launch.sh stops them before it exits, not a watchdog
    some time after, and reports 1, not the 137 the agent would read as a time-out."""
    job = unique_job_id("oom")
    launch = start_job(node, job, WORKER_SAVE_SECONDS="5")
    try:
        workers = worker_pids(node)
        (torchrun,) = [pid for pid in job_processes(job) if pid not in workers and
                       "torchrun" in Path(f"/proc/{pid}/cmdline").read_text()]  # fmt: skip
        os.kill(torchrun, signal.SIGKILL)
        assert launch.wait(timeout=120) == 1
        assert not [pid for pid in workers if alive(pid)], "launch.sh exited before its workers"
        assert saves_done(node) == dict.fromkeys(workers, True)  # a SIGTERM first, not a SIGKILL
        output, _ = launch.communicate(timeout=60)
        assert "torchrun ended with status 137 (killed by SIGKILL: out of memory?" in output
        assert "stopped the processes torchrun left running (it ended with status 137)" in output
    finally:
        end_job(job, launch)


@pytest.mark.slow
def test_a_leg_end_that_comes_after_torchrun_ended_does_not_end_launch(node: FakeNode) -> None:
    """The leg timer, or end_leg's recheck (`sleep 2 && kill -USR1 $$`), can fire just as
    torchrun ends. Past its wait launch.sh has nothing more to do for a leg's end, and must not
    die of the signal either (bash, which has an EXIT trap, ends on a signal it does not trap,
    with 128 + its number): that would leave the workers a killed torchrun left running and
    report 138 to the agent. The USR1 comes here while launch.sh stops those workers (each
    saves for 5 s on its SIGTERM)."""
    job = unique_job_id("lateusr1")
    env = {**real_torchrun(node), "WORKER_SAVE_SECONDS": "5"}
    output_path = node.root / "launch.out"
    with output_path.open("w") as output_file:
        launch = subprocess.Popen(
            ["bash", str(NODE / "launch.sh"), "--hosts", node.loopback, "--job-id", job,
             "--nproc-per-node", "2", "--master-port", str(free_port()), "--time-limit", "600",
             "--stop-grace", "60", "--code-dir", str(node.code)],
            env=node.env(**env), stdout=output_file, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        wait_for(lambda: len(worker_pids(node)) == 2, 60, "two torchrun workers")
        workers = worker_pids(node)
        (torchrun,) = [pid for pid in job_processes(job) if pid not in workers and
                       "torchrun" in Path(f"/proc/{pid}/cmdline").read_text()]  # fmt: skip
        os.kill(torchrun, signal.SIGKILL)
        # Past its wait: stopping the workers torchrun left, which are still saving.
        wait_for(lambda: "sending SIGTERM to 2 worker" in output_path.read_text(), 60,
                 "launch.sh stopping the leftover workers")  # fmt: skip
        assert launch.poll() is None and any(alive(pid) for pid in workers)
        os.kill(launch.pid, signal.SIGUSR1)
        assert launch.wait(timeout=120) == 1, output_path.read_text()
        output = output_path.read_text()
        assert "stopped the processes torchrun left running (it ended with status 137)" in output
        assert not [pid for pid in workers if alive(pid)], "launch.sh exited before its workers"
    finally:
        end_job(job, launch)


# A trainer that needs as many descriptors as a gloo group over a world of 40 trn1.32xlarge
# nodes would take (1,280 ranks): it measures what a gloo group costs per peer (a group over
# this job's world less a group of one, which has no peer), holds that many descriptors for
# each of the peers it does not have, then creates a gloo group and all-reduces over it.
GLOO_WORKER = """
import json, math, os, resource
import torch
import torch.distributed as dist

STANDS_FOR = 40 * 32  # ranks of a 40-node trn1.32xlarge job

def open_files():
    return len(os.listdir("/proc/self/fd"))

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
before = open_files()
alone, _ = dist.new_subgroups(group_size=1)
fixed = open_files() - before
before = open_files()
measured = dist.new_group(backend="gloo")
per_peer = (open_files() - before - fixed) / (world - 1)
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(math.ceil(per_peer * (STANDS_FOR - world)))]
group = dist.new_group(backend="gloo")
total = torch.ones(1)
dist.all_reduce(total, group=group)
report = {"rank": rank, "fixed": fixed, "per_peer": per_peer, "held": len(held),
          "open_files": open_files(), "soft_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
          "sum": total.item()}
with open(os.path.join(os.environ["WORKER_DIR"], f"gloo-{rank}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_job_past_1024_open_files_runs_when_started_as_the_agent_starts_it(
    node: FakeNode,
) -> None:
    """RunTraining started as the SSM agent starts it (ssm_agent.runscript.start_script: sh -c,
    the agent's environment, RLIMIT_NOFILE soft 1024). Two cores cannot run 1,280 ranks: each
    of the two workers holds the descriptors that the peers of a 1,280-rank gloo group would
    take (the per-peer cost measured on a real gloo group here) and then creates a real gloo
    group and all-reduces over it. Without launch.sh raising the soft limit the workers die
    with `OSError: [Errno 24] Too many open files`."""
    env = {
        **agent_environment("i-0123456789abcdef0", "us-east-1", command_id="c-nofile"),
        **{k: v for k, v in node.env(**real_torchrun(node)).items() if k != "HOME"},
    }
    (node.workload / "train.py").write_text(GLOO_WORKER)
    command = document_command("RunTraining", {
        "Hosts": node.loopback, "JobId": unique_job_id("nofile"), "NprocPerNode": "2",
        "MasterPort": str(free_port()), "CodeSnapshot": node.snapshot(),
    })  # fmt: skip
    script = start_script(command, node.root / "agent", env)
    try:
        code = script.wait(timeout=300)
    finally:
        script.kill()
    output = script.stdout_path.read_text() + script.stderr_path.read_text()
    assert code == 0, output
    reports = [json.loads(p.read_text()) for p in sorted(node.root.glob("gloo-*.json"))]
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["sum"] == 2
        assert report["per_peer"] >= 1  # gloo: at least one socket per peer
        assert report["open_files"] > 1024 < report["soft_limit"], report
    assert "open files: soft limit raised from 1024 to " in output


def test_launch_refuses_a_hard_open_file_limit_below_what_the_job_needs(node: FakeNode) -> None:
    result = subprocess.run(
        ["bash", "-c", 'ulimit -Sn 1024 && ulimit -Hn 1500 && exec bash "$@"', "limit",
         str(NODE / "launch.sh"), *ONE, "--nproc-per-node", "999", "--code-dir", str(node.code)],
        capture_output=True, text=True, env=node.env(), timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert errors(result) == [
        "the open-file hard limit is 1500, below the 2023 descriptors a process of this job may "
        "need (one per rank for gloo and the rendezvous store, + 1024): raise LimitNOFILE of the "
        "amazon-ssm-agent unit"
    ]
    assert not (node.root / "torchrun.args").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--time-limit", "172801"], "--time-limit '172801' is not allowed: use 0 (no limit) or "
         "seconds up to 172800 (the SSM limit of one command)"),
        (["--time-limit", "600", "--stop-grace", "600"], "--stop-grace 600 leaves no time to "
         "train within --time-limit 600: use fewer seconds than the limit"),
        (["--stop-grace", "soon"], "--stop-grace 'soon' is not a number of seconds"),
        (["--log-folder", "tmp"], "--log-folder 'tmp' is not allowed: use jobs or precompile"),
    ],
)  # fmt: skip
def test_launch_refuses_a_bad_time_limit(node: FakeNode, args: list[str], message: str) -> None:
    result = node.run("launch.sh", *ONE, "--nproc-per-node", "1", *args)
    assert result.returncode == 1
    assert errors(result) == [message]


def test_launch_stops_what_an_earlier_job_left_on_the_node(node: FakeNode) -> None:
    leftover = tagged(unique_job_id("an-older-job"), node.loopback, state=node.state)
    try:
        result = node.run("launch.sh", "--hosts", node.loopback, "--job-id", unique_job_id("j"),
                          "--nproc-per-node", "1", FAKE_LOOPBACK=node.loopback)  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert leftover.wait(timeout=60) == -signal.SIGTERM
        assert "stopped processes left over from an earlier job or attempt" in result.stdout
    finally:
        if leftover.poll() is None:
            leftover.kill()
            leftover.wait()


#: `env`, `setsid` and `tee` as a busy machine runs them: one that launch.sh (an untagged
#: process) exec'd with a job's tags (TRAINIUM_JOB_ID in its environment, which
#: /proc/<pid>/environ shows as long as the process is that program) takes until torchrun has
#: started to exec the real one, as a descheduled process would, and notes that it carried
#: them. (The job's own processes, torchrun's children, are tagged by design.)
SLOW_EXEC = """#!/bin/bash
name=$(basename "$0")
if [[ -n ${TRAINIUM_JOB_ID:-} ]] && ! grep -qz '^TRAINIUM_JOB_ID=' "/proc/$PPID/environ"; then
  parent=$(tr '\\0' ' ' < "/proc/$PPID/cmdline")
  echo "$name $* ($$, parent $parent) carried the job's tags" >> "$FAKE_DIR/tagged-helpers.log"
  for ((i = 0; i < 600; i++)); do [[ -e $FAKE_DIR/torchrun.args ]] && break; sleep 0.1; done
fi
exec "/usr/bin/$name" "$@"
"""


def test_the_jobs_tee_and_watchdog_are_never_tagged_even_while_they_start(node: FakeNode) -> None:
    """launch.sh exports the job's tags before it starts its own helpers (the job log's tee,
    the leg's watchdog), and stops whatever is tagged on its node (stop_job "*") in between. A
    helper exec'd with the tags, even for the moment before it drops them (`env -u`), is a
    leftover worker to that scan while it has not exec'd its real program: it got SIGTERM,
    the tee was gone, and launch.sh died of SIGPIPE (status 141, the supervisor's 'RunTraining
    failed with status 141') on a busy machine. Here every such exec stalls; nothing may be
    exec'd tagged but the job itself."""
    for name in ("env", "setsid", "tee"):
        node.tool(name, SLOW_EXEC)
    job = unique_job_id("j")
    result = node.run("launch.sh", "--hosts", node.loopback, "--job-id", job,
                      "--nproc-per-node", "1", FAKE_LOOPBACK=node.loopback)  # fmt: skip
    tagged_helpers = node.root / "tagged-helpers.log"
    assert not tagged_helpers.exists(), tagged_helpers.read_text()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "left over" not in result.stdout
    log = (node.fsx / "jobs" / job / "logs" / f"node-0-{node.loopback}.log").read_text()
    assert "fake torchrun on rank 0" in log  # through the tee


# --------------------------------------------------------------------------------- stop
def test_stop_ends_only_the_jobs_processes(node: FakeNode) -> None:
    job, address = unique_job_id("bert-1"), loopback_address()
    target = tagged(job, address, state=node.state)
    stubborn = tagged(job, address, state=node.state, ignore_term=True)
    other = tagged(unique_job_id("bert-2"), address, state=node.state)
    try:
        result = node.run("stop.sh", "--job-id", job, "--grace", "2")
        assert result.returncode == 0, result.stderr
        assert target.wait(timeout=60) == -signal.SIGTERM
        assert stubborn.wait(timeout=60) == -signal.SIGKILL
        assert other.poll() is None
        assert "sending SIGKILL to processes still running after 2 s" in result.stderr
        again = node.run("stop.sh", "--job-id", job)
        assert f"job {job} has no running processes on this node" in again.stderr
    finally:
        for process in (target, stubborn, other):
            if process.poll() is None:
                process.kill()
                process.wait()


def test_stop_document_runs_stop(node: FakeNode) -> None:
    result = node.run_document("StopTraining", {"JobId": "nothing-running"})
    assert result.returncode == 0, result.stderr
    assert "job nothing-running has no running processes on this node" in result.stderr


# --------------------------------------------------------------------------- precompile
def neuron_venv(node: FakeNode, then: str = "") -> None:
    """A Neuron venv (NEURON_VENV) whose neuron_parallel_compile records its arguments and
    then runs `then`."""
    venv = node.root / "neuron-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'PATH="{venv}/bin:$PATH"\n')
    npc = venv / "bin" / "neuron_parallel_compile"
    npc.write_text(
        f'#!/usr/bin/env bash\nprintf \'%s\\n\' "$@" > "$FAKE_DIR/npc.args"\n'
        f'printf \'%s\\n\' "$TRAINIUM_OUTPUT_DIR" "$TRAINIUM_CODE_DIR" > "$FAKE_DIR/npc.env"\n'
        f"{then}\n"
    )
    npc.chmod(0o755)
    node.settings["NEURON_VENV"] = str(venv)
    node.write_env()


def test_precompile_runs_the_job_under_neuron_parallel_compile(node: FakeNode) -> None:
    """neuron_parallel_compile sits in the Neuron venv's bin (not on Run Command's PATH):
    precompile.sh finds it by activating NEURON_VENV itself."""
    neuron_venv(node)
    scratch = node.root / "scratch"
    values = {
        "Hosts": f"{ADDRESS},10.1.0.40", "JobId": "bert-1", "MasterPort": "29500",
        "NprocPerNode": "2", "Steps": "7", "TrainArgs": "--model tiny",
    }  # fmt: skip
    result = node.run_document("Precompile", values, TRAINIUM_PRECOMPILE_DIR=str(scratch))
    assert result.returncode == 0, result.stderr
    args = (node.root / "npc.args").read_text().splitlines()
    assert args[0] == "torchrun"
    assert args[11:13] == ["-m", "workload.train"]
    # The trial run writes to the scratch folder (its TRAINIUM_OUTPUT_DIR) and runs the job's
    # code snapshot, unpacked in the node's cache.
    output, code = (node.root / "npc.env").read_text().splitlines()
    assert output == f"{scratch}/bert-1"
    assert Path(code).parent == node.root / "code-cache"
    assert args[-4:] == ["--model", "tiny", "--max-steps", "7"]
    assert not (node.fsx / "jobs" / "bert-1").exists()  # the real job's output stays untouched
    # The CloudWatch agent ships only the newest file matching a wildcard (jobs/*.log): the
    # precompile's node log has a folder of its own, not the jobs' one.
    assert not (node.logs / "jobs").exists()
    log = (node.logs / "precompile" / "bert-1.log").read_text()
    assert "job bert-1: node rank 0 of 2" in log
    assert "job bert-1: torchrun finished on node rank 0" in log


def test_precompile_compiles_again_what_a_failed_compile_left_in_the_cache(
    node: FakeNode,
) -> None:
    """neuron_parallel_compile fills the shared cache with the job's flags: a failed entry
    there is compiled again (--retry_failed_compilation, Neuron persistent cache
    documentation), not skipped for every job after it."""
    node.trainium()
    neuron_venv(node, 'printf "%s" "$NEURON_CC_FLAGS" > "$FAKE_DIR/npc.flags"')
    scratch = str(node.root / "scratch")
    result = node.run("precompile.sh", "--hosts", ADDRESS, "--job-id", "j",
                      "--nproc-per-node", "1", TRAINIUM_PRECOMPILE_DIR=scratch)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--retry_failed_compilation" in (node.root / "npc.flags").read_text().split()


def test_precompile_reports_an_odd_status_of_the_compiler_as_1(node: FakeNode) -> None:
    neuron_venv(node, "exit 194")
    scratch = str(node.root / "scratch")
    result = node.run("precompile.sh", "--hosts", ADDRESS, "--job-id", "j",
                      "--nproc-per-node", "1", TRAINIUM_PRECOMPILE_DIR=scratch)  # fmt: skip
    assert result.returncode == 1
    assert plugin_result(result.returncode)[0] == "Failed"
    output = result.stdout + result.stderr
    assert (
        "neuron_parallel_compile ended with status 194 (the SSM agent would take it as a "
        "request to reboot the instance); reporting 1"
    ) in output
    assert errors(result) == [
        f"precompiling job j failed with status 1 (log: {node.root}/scratch/j/logs)"
    ]


def test_preflight_reports_an_odd_status_of_a_tool_as_1(node: FakeNode) -> None:
    """preflight.sh sources lib.sh and gets its EXIT trap: a tool that fails with 194 under
    set -e (here `ip`, read by find_node_rank) ends preflight with 1, not a reboot."""
    node.tool("ip", "#!/usr/bin/env bash\nexit 194\n")
    result = node.run("preflight.sh", "--hosts", ADDRESS, "--min-free-gb", "0")
    assert result.returncode == 1
    assert (
        "preflight.sh ended with status 194 (the SSM agent would take it as a request to "
        "reboot the instance); reporting 1"
    ) in result.stderr


def test_precompile_needs_the_neuron_sdk(node: FakeNode) -> None:
    result = node.run("precompile.sh", "--hosts", ADDRESS, "--job-id", "j")
    assert result.returncode == 1
    assert errors(result) == [
        "neuron_parallel_compile not found: precompiling needs the Neuron SDK "
        f"(NEURON_VENV={node.root / 'no-venv'} has none)"
    ]


# ---------------------------------------------------------------------- the job's code
def test_launch_runs_the_code_snapshot_unpacked_once_in_the_nodes_cache(node: FakeNode) -> None:
    """--code SHA256: launch.sh takes the snapshot from /fsx/data/code/ (where the file system
    shows the data bucket's objects), checks its sha256, unpacks it into the node's cache and
    runs the entry point from there; a second job with the same code unpacks nothing."""
    sha = node.snapshot()
    result = node.run("launch.sh", *ONE, "--nproc-per-node", "1", "--code", sha,
                      "--data", "/fsx/data", "--", "--lr", "1")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    cache = node.root / "code-cache" / sha
    assert f"code: snapshot {sha} unpacked to {cache}" in result.stdout
    assert (cache / "workload" / "train.py").read_text() == (node.workload / "train.py").read_text()
    env = node.torchrun_env()
    assert env["TRAINIUM_CODE_DIR"] == str(cache) and env["TRAINIUM_CODE_SNAPSHOT"] == sha
    assert env["PYTHONPATH"].split(":")[0] == str(cache)
    assert env["TRAINIUM_DATA_DIR"] == f"{node.fsx}/data"  # /fsx as this node mounts it
    assert node.torchrun_args()[10:] == ["-m", "workload.train", "--lr", "1"]
    assert not list((node.root / "code-cache").glob(f".{sha}.*[!k]"))  # no staging left
    again = node.run("launch.sh", *ONE, "--nproc-per-node", "1", "--code", sha)
    assert again.returncode == 0
    assert f"code: snapshot {sha}, unpacked on this node already" in again.stdout


def test_launch_refuses_code_it_cannot_find_or_verify_in_one_line(node: FakeNode) -> None:
    """A snapshot that does not appear (bounded wait), or whose bytes are not its name's
    sha256, ends the command before torchrun with the job's input status (job_code.sh)."""
    missing = "0" * 64
    result = node.run("launch.sh", *ONE, "--nproc-per-node", "1", "--code", missing,
                      TRAINIUM_CODE_WAIT="1")  # fmt: skip
    assert result.returncode != 0
    tarball = f"{node.fsx}/data/code/{missing}.tar.gz"
    assert errors(result) == [
        f"code snapshot {missing} is not at {tarball} after 1 s: upload it with `cluster.py "
        f"train --code DIR` (it puts s3://<data bucket>/code/{missing}.tar.gz)"
    ]
    assert "launch.sh ended with status 2" in result.stdout or result.returncode == 2
    named = "1" * 64
    (node.fsx / "data" / "code").mkdir(parents=True)
    (node.fsx / "data" / "code" / f"{named}.tar.gz").write_bytes(b"not the snapshot")
    result = node.run("launch.sh", *ONE, "--nproc-per-node", "1", "--code", named)
    (line,) = errors(result)
    assert line.startswith(f"code snapshot {node.fsx}/data/code/{named}.tar.gz has sha256 ")
    assert line.endswith(f", not {named}: upload it again with `cluster.py train --code DIR`")
    assert not (node.root / "torchrun.args").exists()
    assert not (node.root / "code-cache" / named).exists()


# ------------------------------------------- launch: the trainer's own status through torchrun
# A trainer whose argparse refuses an unknown flag: argparse exits 2 ("error: unrecognized
# arguments"), as workload/train.py does for a bad flag or missing data.
ARGPARSE_WORKER = """
import argparse, os, sys
parser = argparse.ArgumentParser(prog="train.py")
parser.add_argument("--steps", type=int, default=1)
parser.add_argument("--output")
parser.parse_args()
sys.exit(int(os.environ.get("WORKER_EXIT", "0")))
"""


def launch_argparse_worker(
    node: FakeNode, job: str, *train_args: str, nproc: int = 2, **extra: str
) -> subprocess.CompletedProcess[str]:
    """launch.sh as the RunTraining document starts it (through `sh`, its stdout and stderr
    apart, as the agent keeps them), with the real torchrun and ARGPARSE_WORKER as train.py.
    The timeout is an upper bound for torch's import on a loaded machine."""
    env = (
        real_torchrun(node)
        if (node.bin / "torchrun").exists()
        else {
            "PATH": f"{node.bin}:{Path(sys.executable).parent}:/usr/bin:/bin:/usr/sbin:/sbin",
            "WORKER_DIR": str(node.root),
            "FAKE_LOOPBACK": node.loopback,
        }
    )
    (node.workload / "train.py").write_text(ARGPARSE_WORKER)
    command = (
        f"bash {NODE / 'launch.sh'} --hosts {node.loopback} --job-id {job} "
        f"--nproc-per-node {nproc} --master-port {free_port()} --code-dir {node.code} "
        f"-- {' '.join(train_args)}"
    )
    return subprocess.run(
        ["sh", "-c", command], capture_output=True, text=True, env=node.env(**env, **extra),
        timeout=600, check=False,
    )  # fmt: skip


@pytest.mark.slow
def test_a_trainer_that_refuses_its_flags_is_reported_as_the_input_error_2(
    node: FakeNode,
) -> None:
    """torch 2.9's torchrun exits 1 whatever status its worker had (checked here: its report
    names the worker's exitcode 2); launch.sh reads the root cause's status from that report and
    exits 2, the contract's input error, with the trainer's own error line alone on the agent's
    stderr, which the API's Output keeps whole (plugin_output: the agent's truncateOutput).
    Before, the job's bad flag was reported as 1 and retried."""
    from scripts.rehearsal.ssm_agent.runscript import plugin_output

    job = unique_job_id("bad-flag")
    result = launch_argparse_worker(node, job, "--bogus", "3")
    assert result.returncode == 2, result.stdout + result.stderr
    log = (node.fsx / "jobs" / job / "logs" / f"node-0-{node.loopback}.log").read_text()
    assert "torchrun failed with status 1 on node rank 0" in result.stdout
    assert "exitcode  : 2 (pid:" in log  # torchrun's own report
    assert "exited with status 2 (torchrun's root cause); reporting 2" in result.stdout
    said = (
        f"job {job}: input error (status 2) on node rank 0: train.py: error: "
        "unrecognized arguments: --bogus 3"
    )
    # The agent's stderr ends with the one line (no newline after it); launch.sh's lines
    # before its output went to the job's log stay there.
    assert result.stderr.endswith(f"\n{said}") or result.stderr == said, result.stderr
    assert plugin_result(result.returncode)[0] == "Failed"
    output = plugin_output(result.stdout.encode() * 3, result.stderr.encode(), 2)
    assert len(output) <= 2500 and output.splitlines()[-1] == said


@pytest.mark.slow
def test_a_trainers_own_status_passes_and_a_signal_does_not(node: FakeNode) -> None:
    """A worker's status 5 (an operator may name it: `train --no-retry-on 5`) is passed on;
    statuses the agent reads itself stay 1 (194), as does a worker's 75 (launch.sh's leg end
    alone reports 75). Nothing goes to stderr but for the input error."""
    for worker, reported in ((5, 5), (75, 1), (194, 1)):
        result = launch_argparse_worker(node, unique_job_id(f"status-{worker}"), nproc=1,
                                        WORKER_EXIT=str(worker))  # fmt: skip
        assert result.returncode == reported, result.stdout
        assert "input error" not in result.stderr


# ------------------------------------------------------------- launch: a new job or a resume
def checkpoint(node: FakeNode, job: str, step: int, *, complete: bool = True) -> Path:
    """A checkpoint in the reference trainer's layout (workload/checkpoint.py: complete once it
    holds model.safetensors, trainer_state.pt and config.json)."""
    path = node.fsx / "jobs" / job / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    names = ["model.safetensors", "trainer_state.pt", "config.json"]
    for name in names if complete else names[:1]:
        (path / name).write_bytes(b"")
    return path


def test_a_new_job_whose_id_holds_a_checkpoint_is_refused_before_torchrun(node: FakeNode) -> None:
    """--resume new (the supervisor's first attempt of a new job) with the job's directory
    holding a checkpoint: exit 2, the input error (no retry), one line naming the step and how
    to resume, alone at the end of the agent's stderr; torchrun never starts. Before, the
    trainer resumed the old job silently under the new job's settings."""
    checkpoint(node, "bert-1", 200)
    newest = checkpoint(node, "bert-1", 1200)
    checkpoint(node, "bert-1", 1400, complete=False)  # a save that never finished
    values = {"Hosts": ADDRESS, "JobId": "bert-1", "NprocPerNode": "1", "Resume": "new"}
    result = node.run_document("RunTraining", values)
    assert result.returncode == 2, result.stdout + result.stderr
    said = (
        f"job bert-1 exists at step 1200 ({newest}): resume it with train --resume bert-1, or "
        "choose another --job-id"
    )
    assert result.stderr.endswith(f"job bert-1: input error (status 2) on node rank 0: {said}")
    assert not (node.root / "torchrun.args").exists()


@pytest.mark.parametrize(
    ("resume", "saved", "said", "flag"),
    [
        ("resume", False, "job j: resume asked, but {out} holds no checkpoint: it starts at step 0",
         "1"),
        ("resume", True, "job j: resuming from step 7 ({out}/checkpoints/step_00000007)", "1"),
        ("new", False, "job j: a new job: it starts at step 0", "0"),
    ],
)  # fmt: skip
def test_launch_says_what_the_job_starts_from(
    node: FakeNode, resume: str, saved: bool, said: str, flag: str
) -> None:
    if saved:
        checkpoint(node, "j", 7)
    result = node.run("launch.sh", "--hosts", ADDRESS, "--job-id", "j", "--nproc-per-node",
                      "1", "--resume", resume, "--dry-run")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert said.format(out=node.fsx / "jobs" / "j") in result.stderr
    assert f"TRAINIUM_RESUME={flag}" in result.stdout.splitlines()


def test_launch_refuses_an_unknown_resume_mode(node: FakeNode) -> None:
    result = node.run("launch.sh", "--hosts", ADDRESS, "--job-id", "j", "--resume", "fresh")
    assert result.returncode == 1
    assert errors(result) == [
        "--resume 'fresh' is not allowed: use new (a job ID not used before) or resume"
    ]
