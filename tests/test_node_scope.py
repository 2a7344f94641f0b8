"""A node's job processes are its own, even where several nodes share one machine.

stop.sh and launch.sh's clean-up of leftovers find a job's processes by the tags launch.sh puts
in their environment (job_pids in scripts/node/lib.sh). On a cluster node one node is one
machine. In the tests, the loopback rehearsal and two test runs side by side, several simulated
nodes share one machine, one network namespace and the address 127.0.0.1, and the same job ID
may run on two of them at once: each node's state directory (TRAINIUM_STATE_DIR) tells its
processes from the others'.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.node_support import NODE, REPO_ROOT, FakeNode, unique_job_id

# A job process as launch.sh leaves it: tagged, in a session of its own, waiting to be stopped.
SLEEPER = "import time\nwhile True: time.sleep(1)\n"


@pytest.fixture
def nodes(tmp_path: Path) -> tuple[FakeNode, FakeNode]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    return FakeNode(tmp_path / "a"), FakeNode(tmp_path / "b")


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        process.kill()
        process.wait()


def job_process(node: FakeNode, job_id: str) -> subprocess.Popen[bytes]:
    env = node.env(
        TRAINIUM_JOB_ID=job_id, TRAINIUM_NODE_ADDRESS="127.0.0.1", TRAINIUM_LEG="1-1",
        TRAINIUM_STATE_DIR=str(node.state),
    )  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-c", SLEEPER], env=env, start_new_session=True,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def test_stop_on_one_node_leaves_the_same_job_on_another_node_of_the_machine(
    nodes: tuple[FakeNode, FakeNode], started: list[subprocess.Popen[bytes]]
) -> None:
    a, b = nodes
    on_a, on_b = job_process(a, "same-job"), job_process(b, "same-job")
    started += [on_a, on_b]

    stopped = b.run(
        "stop.sh", "--job-id", "same-job", "--grace", "5", "--node-address", "127.0.0.1"
    )

    assert stopped.returncode == 0, stopped.stderr
    assert "job same-job stopped on this node" in stopped.stderr
    assert on_b.wait(timeout=60) != 0
    assert on_a.poll() is None, "node b's stop ended node a's process of the same job"
    # And node a's own stop finds it.
    assert "stopped on this node" in a.run("stop.sh", "--job-id", "same-job", "--grace", "5").stderr
    assert on_a.wait(timeout=60) != 0


def test_every_script_that_tags_a_job_tags_its_node_too() -> None:
    """On a cluster node TRAINIUM_STATE_DIR is not in the SSM agent's environment: a script that
    tags processes with TRAINIUM_JOB_ID must set the node's tag itself, or job_pids finds none
    of them there (while the tests, which set TRAINIUM_STATE_DIR for every script, still
    would)."""
    tagging = []
    for script in sorted(NODE.glob("*.sh")):
        lines = script.read_text().splitlines()
        for number, line in enumerate(lines):
            if re.search(r"(export |^\s*)TRAINIUM_JOB_ID=\S", line):
                statement = " ".join(lines[number : number + 3])
                tagging.append(script.name)
                assert 'TRAINIUM_STATE_DIR="$STATE_DIR"' in statement, f"{script.name}:{number + 1}"
    assert sorted(set(tagging)) == ["launch.sh", "preflight.sh"]


# wait_until_ended (lib.sh), as stop_job runs it after its SIGTERM, on a process that ends
# while it waits (killed, and gone, at its third look): the pauses between its looks, recorded by
# an `untagged_sleep` (lib.sh's sleep beside a job) of the harness's own that then sleeps.
WAIT_HARNESS = """set -Eeuo pipefail
source scripts/node/lib.sh
python3 -c 'import time; time.sleep(300)' &
target=$! looks=0
untagged_sleep() {
  echo "$1"
  if ((++looks == 3)); then kill "$target" && wait "$target" || true; fi
  command sleep "$1"
}
wait_until_ended "$target" $((SECONDS + 60))
echo ended
"""


def test_a_stop_sees_a_process_end_within_a_tenth_of_a_second_then_looks_each_second() -> None:
    """stop_job waits two or three times in a stop (the workers, torchrun, what is left), most
    often for processes that end at once on the SIGTERM: each wait looks again after 0.05 s,
    then 0.1, 0.2 and 0.5 s, and once a second for a save that takes minutes (a stop of
    processes that end at once took a second per wait, looking once a second only)."""
    result = subprocess.run(
        ["bash", "-c", WAIT_HARNESS], cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0.05", "0.1", "0.2", "ended"]


def harness(script: str, folder: Path) -> str:
    """What a bash script that sources lib.sh prints, given `folder` as $1; it must exit 0."""
    result = subprocess.run(
        ["bash", "-c", script, "harness", str(folder)], cwd=REPO_ROOT,
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


# process_start_time and still_running (lib.sh) on a process whose name holds ") " and spaces,
# against Python's reading of the same field (field 22 of /proc/<pid>/stat, proc(5): the
# fields after the name's last ") " start at field 3); then once the process is gone.
START_HARNESS = """set -Eeuo pipefail
source scripts/node/lib.sh
ln -s "$(command -v sleep)" "$1/x) y (z"
"$1/x) y (z" 300 &
target=$!
while [[ $(cat "/proc/$target/comm") != "x) y (z" ]]; do command sleep 0.05; done
start=$(process_start_time "$target")
field22='import sys; print(open(sys.argv[1]).read().rsplit(") ", 1)[1].split()[19])'
echo "$start $(python3 -c "$field22" "/proc/$target/stat")"
still_running "$target" "$start" && echo running
still_running "$target" "$((start + 1))" || echo other
kill "$target"; wait "$target" || true
still_running "$target" "$start" || echo gone
echo "[$(process_start_time "$target")]"
"""


def test_the_watchdog_reads_a_process_start_time_as_proc_has_it(tmp_path: Path) -> None:
    out = harness(START_HARNESS, tmp_path)
    first, *rest = out.splitlines()
    ours, proc = first.split()
    assert ours == proc and ours.isdigit(), first
    assert rest == ["running", "other", "gone", "[]"], out


# The leg watchdog (start_leg_watchdog, lib.sh) of a launcher that then becomes a zombie: the
# harness starts the watchdog and the leg's one tagged process (in a session of its own, as
# torchrun's workers are), then execs `sleep` (the same PID and start time: what the watchdog
# watches) and waits for the test's SIGKILL, which the test does not reap.
WATCHDOG_HARNESS = """set -Eeuo pipefail
export TRAINIUM_STATE_DIR=$1
source scripts/node/lib.sh
WATCHDOG_LOG=$1/watchdog.log
start_leg_watchdog "$2" 127.0.0.1 1 5
env TRAINIUM_JOB_ID="$2" TRAINIUM_NODE_ADDRESS=127.0.0.1 TRAINIUM_LEG=1 setsid sleep 301 \\
  </dev/null >/dev/null 2>&1 &
echo "$!" > "$1/worker.pid.tmp"
mv "$1/worker.pid.tmp" "$1/worker.pid"
exec sleep 300
"""


def _state(pid: int) -> str:
    """The process's state (proc(5), field 3), or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _until(what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60  # an upper bound: the watchdog looks every second
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_the_watchdog_takes_a_killed_launcher_its_parent_has_not_reaped_for_gone(
    tmp_path: Path,
) -> None:
    """A launcher SIGKILLed (the agent's cancel) whose parent has not reaped it is a zombie
    that /proc still lists with its start time; its leg's processes go on without it. The
    watchdog stops them all the same (as still_running alone, it waited for the reaping)."""
    job = unique_job_id("zombie")
    launcher = subprocess.Popen(
        ["bash", "-c", WATCHDOG_HARNESS, "harness", str(tmp_path), job], cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    worker = 0
    try:
        pid_file = tmp_path / "worker.pid"
        _until("the leg's process", pid_file.is_file)
        worker = int(pid_file.read_text())
        _until("the harness to exec sleep", lambda: _state(launcher.pid) == "S" and Path(
            f"/proc/{launcher.pid}/comm").read_text().strip() == "sleep")  # fmt: skip
        launcher.kill()
        _until("the launcher to be a zombie", lambda: _state(launcher.pid) == "Z")
        _until("the watchdog to stop the leg's process", lambda: _state(worker) in ("", "Z"))
        log = tmp_path / "watchdog.log"
        said = f"launcher of job {job} (leg 1) is gone: stopped the processes it left"
        _until(f"the watchdog to say so: {said}", lambda: said in log.read_text())
        assert _state(launcher.pid) == "Z"  # never reaped meanwhile
    finally:
        if worker and _state(worker) not in ("", "Z"):
            os.kill(worker, signal.SIGKILL)
        launcher.kill()
        launcher.wait(timeout=10)


# job_pids (lib.sh) on two processes of one job and node: one here whose name holds ") Z ("
# (field 3 of a plain split of its /proc/<pid>/stat reads "Z", as a zombie's state would), one
# in another network namespace (another rehearsal node). Only they carry the job's tags.
PIDS_HARNESS = """set -Eeuo pipefail
source scripts/node/lib.sh
STATE_DIR=$1
tags=(TRAINIUM_JOB_ID=pids-scope TRAINIUM_NODE_ADDRESS=127.0.0.1 "TRAINIUM_STATE_DIR=$1")
ln -s "$(command -v sleep)" "$1/x) Z (y"
env "${tags[@]}" "$1/x) Z (y" 300 &
here=$!
unshare --net env "${tags[@]}" sleep 301 &
there=$!
while [[ $(cat "/proc/$here/comm") != "x) Z (y" || $(cat "/proc/$there/comm") != sleep ]]; do
  command sleep 0.05
done
echo "$here" $(job_pids pids-scope 127.0.0.1)
kill "$here" "$there"
"""


@pytest.mark.netns
def test_job_pids_finds_the_nodes_processes_whatever_their_name(tmp_path: Path) -> None:
    """job_pids names a job process of this node even where its name reads like a zombie's
    state, and not the same job's process on another node (another network namespace)."""
    out = harness(PIDS_HARNESS, tmp_path)
    here, *found = out.split()
    assert found == [here], out
