"""The processes on this machine that belong to a job: those whose environment carries the
tags launch.sh exports (TRAINIUM_JOB_ID, TRAINIUM_STATE_DIR, TRAINIUM_NODE_ADDRESS,
TRAINIUM_LEG). lib.sh job_pids runs it on the node (python3, standard library only); the
rehearsal (scripts/rehearsal/hosts.py) imports it.

    python3 job_processes.py --job <job-id|*> --state-dir <dir> [--node <address>]
        [--leg <n>] [--exclude <pid>]...

prints one PID per line: the tagged processes in this network namespace, zombies left out.

Why not grep, or sed: a process in the middle of an execve has no environment to read. From
the kernel's switch to the new memory map until it has laid out the new stack,
/proc/<pid>/environ reads empty (fs/proc/base.c environ_read: "if (!mm || !mm->env_end)
return 0"; fs/binfmt_elf.c create_elf_tables sets env_start and env_end), and a read in
several pieces (sed and awk read a /proc file 1 KiB at a time, its st_blksize) that an exec
overtakes gets nothing after the switch, so the environment ends early and the tags in the
rest are lost. A worker that torchrun is starting, or a wrapper exec'ing python, was missed
that way by the one scan a stop makes, and went on training on the NeuronCores. Here each
environment is read in one read(2), which holds the memory map for its whole length
(environ_read: mmget_not_zero ... mmput) and so sees the old environment or the new one,
whole; a process that reads empty is read again, by itself, until it has an environment,
is gone, or has none of its own.
"""

from __future__ import annotations

# os, not pathlib (ruff's PTH rules are waived below): pathlib imports re and fnmatch, 13 ms
# of a start-up that a stop on the node pays three or four times.
import os
import sys
import time
from collections.abc import Iterable

#: include/linux/sched.h: a kernel thread, and a task that is exiting (its memory map is gone).
PF_KTHREAD = 0x00200000
PF_EXITING = 0x00000004
#: The most one read(2) takes: Linux caps a process's argument and environment strings together
#: at a quarter of its stack limit and at most three quarters of _STK_LIM, 8 MiB (fs/exec.c,
#: bprm_stack_limits), so no environment is longer.
READ_SIZE = 6 << 20
#: How often, and how long apart, a process in the middle of an exec is read again. An exec
#: takes well under a millisecond; 50 rounds of 20 ms also outlast one slowed by a busy machine.
ROUNDS = 50
PAUSE_S = 0.02


def read_environ(pid: int, buffer: bytearray | None = None) -> bytes | None:
    """The process's environment, NUL-separated, read in one read(2) into `buffer` (of
    READ_SIZE bytes; one is made when none is given); None when it is gone or not ours to
    read."""
    try:
        fd = os.open(f"/proc/{pid}/environ", os.O_RDONLY)
    except OSError:
        return None
    if buffer is None:
        buffer = bytearray(READ_SIZE)
    try:
        size = os.readv(fd, [buffer])
    except OSError:
        return None
    finally:
        os.close(fd)
    return bytes(buffer[:size])


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3 on of /proc/<pid>/stat (proc(5)): after the command name, which ends at the
    last ")" and may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:  # noqa: PTH123
            text = stat.read().decode("ascii", "replace")
    except OSError:
        return None
    return text.rsplit(")", 1)[-1].split()


def look_again(pid: int) -> bool | None:
    """For a process whose environment read empty: True when it is in the middle of an exec
    or has an environment by now (read it again), False when it never will (gone, a zombie, a
    kernel thread, exiting), None when its environment is there and empty. The last is what
    create_elf_tables shows for a moment before it fills the environment in (env_start =
    env_end, fields 50 and 51), and what a process started with `env -i` shows for good."""
    # No memory map, no exe: a kernel thread, a zombie.
    if not os.path.exists(f"/proc/{pid}/exe"):  # noqa: PTH110
        return False
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 49 or fields[0] in ("Z", "X"):
        return False
    if int(fields[6]) & (PF_KTHREAD | PF_EXITING):
        return False
    env_start, env_end = int(fields[47]), int(fields[48])
    if env_end == 0 or env_start != env_end:
        return True
    return None


def _matches(records: set[bytes], required: set[bytes], any_job: bool) -> bool:
    if not required <= records:
        return False
    if any_job:
        return any(r.startswith(b"TRAINIUM_JOB_ID=") and len(r) > 16 for r in records)
    return True


def tagged_pids(
    tags: dict[str, str],
    any_job: bool = False,
    exclude: Iterable[int] = (),
    same_network_namespace: bool = False,
) -> list[int]:
    """PIDs whose environment holds every NAME=value of `tags` (and, with `any_job`, a
    TRAINIUM_JOB_ID of any value), reading again those in the middle of an exec."""
    required = {f"{name}={value}".encode() for name, value in tags.items()}
    skip = {os.getpid(), *exclude}
    listed = os.listdir("/proc")  # noqa: PTH208
    pending = [int(e) for e in listed if e.isdigit() and int(e) not in skip]
    found: list[int] = []
    empty_once: set[int] = set()
    buffer = bytearray(READ_SIZE)  # one per call: callers may scan from several threads
    for round_ in range(ROUNDS):
        again = []
        for pid in pending:
            environ = read_environ(pid, buffer)
            if environ:
                if _matches(set(environ.split(b"\0")), required, any_job):
                    found.append(pid)
                continue
            if environ is None:
                continue
            verdict = look_again(pid)
            if verdict is None:  # there and empty: believed the second time
                if pid in empty_once:
                    continue
                empty_once.add(pid)
                verdict = True
            if verdict:
                again.append(pid)
        if not again:
            break
        pending = again
        if round_ + 1 < ROUNDS:
            time.sleep(PAUSE_S)
    if same_network_namespace:
        found = [pid for pid in found if _same_network_namespace(pid)]
    return sorted(pid for pid in found if _running(pid))


def _same_network_namespace(pid: int) -> bool:
    try:
        theirs = os.stat(f"/proc/{pid}/ns/net")  # noqa: PTH116
        ours = os.stat("/proc/self/ns/net")  # noqa: PTH116
    except OSError:
        return False
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def _running(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and bool(fields) and fields[0] not in ("Z", "X")


OPTIONS = ("--job", "--state-dir", "--node", "--leg", "--exclude")
USAGE = (
    "usage: job_processes.py --job <job-id|*> --state-dir <dir> [--node <address>] "
    "[--leg <n>] [--exclude <pid>]..."
)


def main(argv: list[str]) -> int:
    # Not argparse: its imports (re, gettext, shutil) take 20 ms and more, and a stop on the
    # node runs this three or four times.
    if len(argv) % 2 or any(argv[i] not in OPTIONS for i in range(0, len(argv), 2)):
        print(f"job_processes.py: {' '.join(argv)!r} is not allowed; {USAGE}", file=sys.stderr)
        return 2
    given: dict[str, list[str]] = {}
    for i in range(0, len(argv), 2):
        given.setdefault(argv[i], []).append(argv[i + 1])
    singles = [name for name, values in given.items() if len(values) > 1 and name != "--exclude"]
    exclude = given.get("--exclude", [])
    if "--job" not in given or "--state-dir" not in given or singles:
        print(f"job_processes.py: needs one --job and one --state-dir; {USAGE}", file=sys.stderr)
        return 2
    if not all(pid.isdigit() for pid in exclude):
        print(f"job_processes.py: --exclude takes a PID, not {exclude!r}", file=sys.stderr)
        return 2
    job = given["--job"][0]
    tags = {"TRAINIUM_STATE_DIR": given["--state-dir"][0]}
    if job != "*":
        tags["TRAINIUM_JOB_ID"] = job
    for option, name in (("--node", "TRAINIUM_NODE_ADDRESS"), ("--leg", "TRAINIUM_LEG")):
        if given.get(option, [""])[0]:
            tags[name] = given[option][0]
    found = tagged_pids(tags, job == "*", map(int, exclude), same_network_namespace=True)
    print("".join(f"{pid}\n" for pid in found), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
