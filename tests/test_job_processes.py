"""A job's processes are found even while they exec (scripts/node/job_processes.py, which
lib.sh job_pids runs and the rehearsal's hosts import).

The kernel's rule: from an execve's switch to the new memory map until the new stack is laid
out, /proc/<pid>/environ reads empty (fs/proc/base.c environ_read: "if (!mm || !mm->env_end)
return 0"; fs/binfmt_elf.c create_elf_tables), and a read in pieces that the exec overtakes
ends early. A scan that reads each environment once in pieces (grep -z over /proc/*/environ,
sed's 1 KiB reads) missed a process in an exec about one call in three here, with a process
that does nothing but exec; the test of lib.sh's job_pids below failed that way before
job_processes.py. These tests run real processes on the real /proc; nothing is simulated.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.node import job_processes
from scripts.rehearsal.hosts import LoopbackHosts
from tests.node_support import NODE, REPO_ROOT, loopback_address, unique_job_id

# A process that does nothing but exec itself, keeping its PID and its environment: most of
# its life is spent in an exec, where a scan that reads its environment once is likeliest to
# miss it. dash (Debian's /bin/sh) starts in well under a millisecond.
EXECER = 'exec /bin/sh -c "$0" "$0"'
# The tags after 8 KiB of other variables: a read in pieces (1 KiB for sed, 8 KiB for head)
# that an exec cuts short loses them.
PADDING = {f"PAD_{i:02}": "x" * 512 for i in range(16)}


def _tags(job: str, state: Path, address: str) -> dict[str, str]:
    return {
        "TRAINIUM_JOB_ID": job, "TRAINIUM_NODE_ADDRESS": address,
        "TRAINIUM_STATE_DIR": str(state),
    }  # fmt: skip


def _execer(tags: dict[str, str]) -> subprocess.Popen[bytes]:
    env = {"PATH": "/usr/bin:/bin", **PADDING, **tags}
    process = subprocess.Popen(["/bin/sh", "-c", EXECER, EXECER], env=env)
    # Ready once its environ has been read whole (it keeps that one from exec to exec).
    deadline = time.monotonic() + 60  # an upper bound only
    while b"PAD_15" not in (job_processes.read_environ(process.pid) or b""):
        assert time.monotonic() < deadline, "the exec'ing process never showed its environment"
    return process


@pytest.fixture
def execer(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, str]]]:
    tags = _tags(unique_job_id("execer"), tmp_path / "state", loopback_address())
    process = _execer(tags)
    yield process, tags
    process.kill()
    process.wait()


def test_a_process_in_the_middle_of_an_exec_is_found_every_time(
    execer: tuple[subprocess.Popen[bytes], dict[str, str]],
) -> None:
    process, tags = execer
    missed = [i for i in range(300) if job_processes.tagged_pids(tags) != [process.pid]]
    assert not missed, f"missed in {len(missed)} of 300 scans"


# job_pids as stop.sh and launch.sh call it, against the same process, 40 times.
JOB_PIDS_HARNESS = """set -Eeuo pipefail
source scripts/node/lib.sh
STATE_DIR=$1
for _ in $(seq 40); do echo "$(job_pids "$2" "$3" | paste -sd' ')"; done
"""


def test_job_pids_finds_a_process_in_the_middle_of_an_exec(
    execer: tuple[subprocess.Popen[bytes], dict[str, str]],
) -> None:
    process, tags = execer
    result = subprocess.run(
        ["bash", "-c", JOB_PIDS_HARNESS, "harness", tags["TRAINIUM_STATE_DIR"],
         tags["TRAINIUM_JOB_ID"], tags["TRAINIUM_NODE_ADDRESS"]],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 40
    missed = [line for line in lines if line != str(process.pid)]
    assert not missed, f"job_pids missed process {process.pid} in {len(missed)} of 40 calls"


def test_a_loopback_node_that_dies_takes_a_process_in_the_middle_of_an_exec_with_it(
    tmp_path: Path,
) -> None:
    """LoopbackHosts.kill returns at the first scan that finds nothing, so a process in an exec
    when its node "died" lived on: 3 of 40 times with the scan before job_processes.py (at a
    random moment after the process is up; right after, its exec is seldom under way)."""
    hosts = LoopbackHosts(1)
    for attempt in range(20):
        tags = _tags(f"dies-{attempt}", tmp_path, hosts.addresses[0])
        process = _execer(tags)
        try:
            time.sleep(random.uniform(0, 0.01))
            hosts.kill(0)
            assert process.wait(timeout=30) == -signal.SIGKILL, f"attempt {attempt}"
        finally:
            process.kill()
            process.wait()


def test_what_cannot_have_an_environment_is_not_waited_for() -> None:
    """A process started with an empty environment, a zombie and a gone process: read once
    more at most, never until the scan's rounds run out."""
    empty = subprocess.Popen(["/usr/bin/env", "-i", "/bin/sleep", "60"])
    zombie = subprocess.Popen(["/bin/true"])
    try:
        deadline = time.monotonic() + 60  # an upper bound only
        while job_processes.read_environ(empty.pid) != b"":  # until env has exec'd sleep
            assert time.monotonic() < deadline
        assert job_processes.look_again(empty.pid) is None
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
        assert job_processes.look_again(zombie.pid) is False
        assert not job_processes.read_environ(zombie.pid)  # empty, or refused (None)
    finally:
        empty.kill()
        empty.wait()
        zombie.wait()
    assert job_processes.look_again(zombie.pid) is False
    assert job_processes.read_environ(zombie.pid) is None


@pytest.mark.parametrize(
    "argv",
    [["--job", "j"], ["--state-dir", "/s"], ["--job", "j", "--state-dir", "/s", "--exclude", "x"],
     ["--job", "j", "--job", "k", "--state-dir", "/s"], ["--pid", "1"], ["--job"]],
)  # fmt: skip
def test_bad_arguments_get_one_line_and_exit_2(argv: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-I", "-S", str(NODE / "job_processes.py"), *argv],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("job_processes.py: ")
