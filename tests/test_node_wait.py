"""launch.sh reads torchrun's exit status right however its signals come.

launch.sh traps USR1 (the leg's end: its leg timer, end_leg's recheck every 2 s) and TERM, INT
and HUP (a stop) while torchrun runs. When a trapped signal interrupts bash's `wait` builtin as
a child ends, bash can lose that child's status: a later `wait` for it returns -1, or 128 + the
signal's number (measured with bash 5.2.15; the DLAMI's Ubuntu 24.04 ships bash 5.2). A leg
that ended at its time limit was once reported as a failure that way, "torchrun ended with
status 138 (killed by SIGUSR1)", and the supervisor spent a retry on it. launch.sh now waits
without `wait` until bash has reaped torchrun (lib.sh's wait_until_reaped), then reads the
status bash kept with the signals ignored. And bash runs a trap in the middle of parsing a
command substitution's text, which breaks that parse: end_leg, the USR1 trap, ignores USR1
while it runs, and stop_leg, the TERM/INT/HUP trap, ignores all four from its start on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tests.node_support import NODE, NODE_ADDRESS, REPO_ROOT, FakeNode, unique_job_id

# Children that end at random moments with the statuses launch.sh tells apart, each read as
# launch.sh reads torchrun's while a background loop sends this shell a USR1 every 2 ms
# (trapped: counted). With launch.sh's earlier loop in place of wait_until_reaped
# (`while kill -0 "$child"; do wait "$child" || true; done`, then `wait "$child"`), 1 to 5 of
# the 60 statuses came back as 138 in each of six runs.
STORM_HARNESS = """set -Eeuo pipefail
source scripts/node/lib.sh
# One function, parsed whole before the storm starts: bash runs a trap as it reads more of a
# script, and a trap in the middle of parsing the script's next command can break that parse
# (bash 5.2.15: "trap: line 2: unexpected EOF while looking for matching `)'").
main() {
handled=0
count() { handled=$((handled + 1)); }
trap count USR1
exec {tick}<> <(:)
# At most 60 s of signals, and not on the harness's stdout: the test reads it to its end.
( for ((n = 0; n < 30000; n++)); do
    kill -USR1 $$ 2>/dev/null || break
    read -r -t 0.002 -u "$tick" _ || :
  done ) >/dev/null 2>&1 &
storm=$!
statuses=(0 1 3 75 2)
for i in $(seq 60); do
  want=${statuses[i % 5]}
  ( command sleep "0.0$((RANDOM % 9 + 1))"; exit "$want" ) &
  child=$!
  wait_until_reaped "$child" 0.01
  trap '' USR1
  status=0
  wait "$child" || status=$?
  trap count USR1
  echo "$want $status"
done
trap '' USR1
kill "$storm"
echo "handled $handled"
}
main
"""


def test_each_childs_own_status_is_read_under_a_storm_of_trapped_signals() -> None:
    result = subprocess.run(
        ["bash", "-c", STORM_HARNESS], cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    pairs = [line.split() for line in lines[:60]]
    wrong = [pair for pair in pairs if pair[0] != pair[1]]
    assert len(pairs) == 60 and not wrong, f"expected, read: {wrong}"
    # The storm did reach the waits (about 300 times in a run here; at least one per child
    # would be 60, and a loaded machine may coalesce more of them).
    handled = int(lines[60].split()[1])
    assert handled >= 30, lines[60]


# A torchrun that ends with status 0 once the test opens its gate: the trainers saved at the
# leg's end and exited (the part of a leg's end this test is not about).
GATED_TORCHRUN = """#!/usr/bin/env bash
while [[ ! -e "$FAKE_DIR/gate" ]]; do sleep 0.05; done
exit 0
"""


def _storm(pid: int, stop: threading.Event, sig: int = signal.SIGUSR1) -> None:
    """`sig` to `pid` every 2 ms until `stop` is set or the process is gone."""
    while not stop.wait(0.002):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


def _wait_for(what: str, condition: Callable[[], bool], launch: subprocess.Popen[str]) -> None:
    """Until `condition` holds (at most 120 s), while launch.sh runs."""
    deadline = time.monotonic() + 120
    while not condition():
        assert launch.poll() is None, f"launch.sh ended with {launch.returncode} before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _start_launch(
    node: FakeNode, output_path: Path, name: str, time_limit: int, stop_grace: int
) -> subprocess.Popen[str]:
    """launch.sh of a one-process job on `node` (its own torchrun), output to `output_path`."""
    with output_path.open("w") as output:
        return subprocess.Popen(
            ["bash", str(NODE / "launch.sh"), "--hosts", NODE_ADDRESS, "--job-id",
             unique_job_id(name), "--nproc-per-node", "1", "--time-limit", str(time_limit),
             "--stop-grace", str(stop_grace), "--code-dir", str(node.code)],
            env=node.env(), stdout=output, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip


def _end_storms(
    launch: subprocess.Popen[str], stop: threading.Event, senders: list[threading.Thread]
) -> None:
    """Stops the storms, and launch.sh's whole session if it still runs."""
    stop.set()
    if launch.poll() is None:
        os.killpg(launch.pid, signal.SIGKILL)
        launch.wait(timeout=10)
    for sender in senders:
        if sender.is_alive():
            sender.join(timeout=10)


def test_a_leg_end_under_a_storm_of_usr1_reports_75_and_no_error(tmp_path: Path) -> None:
    """launch.sh whose leg timer ends the leg 1 s in, and torchrun ending with 0 while USR1s
    come every 2 ms from the leg's end on: end_leg runs again and again, torchrun ends in the
    middle of it, and the leg is still reported as ended at its time limit (75), with no error
    line (end_leg's pgrep of torchrun's children finds none once torchrun has ended: that is
    no error). Three times."""
    node = FakeNode(tmp_path, address=NODE_ADDRESS)
    node.tool("torchrun", GATED_TORCHRUN)
    output_path = tmp_path / "launch.out"
    for attempt in range(3):
        (tmp_path / "gate").unlink(missing_ok=True)
        launch = _start_launch(node, output_path, "storm", time_limit=30, stop_grace=29)
        stop = threading.Event()
        sender = threading.Thread(target=_storm, args=(launch.pid, stop), daemon=True)
        try:
            # The leg timer fires 1 s in (30 - 29); the storm starts once end_leg has run.
            _wait_for("the leg's end", lambda: "leg time limit reached" in output_path.read_text(),
                      launch)  # fmt: skip
            sender.start()
            (tmp_path / "gate").touch()
            status = launch.wait(timeout=120)
        finally:
            _end_storms(launch, stop, [sender])
        text = output_path.read_text()
        assert status == 75, f"attempt {attempt}: {text}"
        assert "leg ended at its time limit" in text, text
        assert "error:" not in text, text


# A torchrun with one trainer that, on its SIGTERM, saves until the test opens its gate, then
# exits 0; torchrun exits 0 once its trainer has (as torch's elastic agent ends when all its
# workers ended 0).
SAVING_TORCHRUN = """#!/usr/bin/env bash
bash -c 'trap "until [[ -e \\$FAKE_DIR/saved-gate ]]; do sleep 0.05; done; exit 0" TERM
         while :; do sleep 0.1; done' &
worker=$!
wait "$worker"
exit 0
"""


def test_a_stop_under_a_storm_of_usr1_and_term_stops_cleanly(tmp_path: Path) -> None:
    """launch.sh asked to stop (SIGTERM) in a leg with a leg timer set, then USR1s and TERMs
    every 2 ms while its stop runs (stop_job, which reads /proc through many command
    substitutions, while its trainer saves: until the storms have run for a second): the stop
    goes on whole and launch.sh exits 0 with no error line. A USR1 there would run end_leg,
    and a TERM stop_leg, in the middle of those substitutions (the module's docstring says
    what that breaks); the leg's end has nothing to add to a stop, nor a second stop request.
    Three times."""
    node = FakeNode(tmp_path, address=NODE_ADDRESS)
    node.tool("torchrun", SAVING_TORCHRUN)
    output_path = tmp_path / "launch.out"
    for attempt in range(3):
        (tmp_path / "saved-gate").unlink(missing_ok=True)
        launch = _start_launch(node, output_path, "stormstop", time_limit=3600, stop_grace=60)
        stop = threading.Event()
        senders = [
            threading.Thread(target=_storm, args=(launch.pid, stop, sig), daemon=True)
            for sig in (signal.SIGUSR1, signal.SIGTERM)
        ]
        try:
            _wait_for("the leg timer", lambda: "leg timer set" in output_path.read_text(), launch)
            launch.send_signal(signal.SIGTERM)
            _wait_for("the stop", lambda: "asked to stop" in output_path.read_text(), launch)
            for sender in senders:
                sender.start()
            stop.wait(1)
            (tmp_path / "saved-gate").touch()
            status = launch.wait(timeout=120)
        finally:
            _end_storms(launch, stop, senders)
        text = output_path.read_text()
        assert status == 0, f"attempt {attempt}: {text}"
        assert "leg time limit reached" not in text, text
        assert "error:" not in text, text


def test_a_stop_at_the_legs_end_under_a_storm_reports_the_legs_end(tmp_path: Path) -> None:
    """The leg timer fires 1 s in, then USR1s every 2 ms (end_leg again and again) and, 0.5 s
    later, TERMs every 2 ms: the stop comes in the middle of end_leg and runs whole; the trainer,
    asked at the leg's end, saves (until the stop has begun) and exits 0, and launch.sh reports
    the leg's end (75), with no error line. Three times."""
    node = FakeNode(tmp_path, address=NODE_ADDRESS)
    node.tool("torchrun", SAVING_TORCHRUN)
    output_path = tmp_path / "launch.out"
    for attempt in range(3):
        (tmp_path / "saved-gate").unlink(missing_ok=True)
        launch = _start_launch(node, output_path, "stormend", time_limit=30, stop_grace=29)
        stop = threading.Event()
        senders = [
            threading.Thread(target=_storm, args=(launch.pid, stop, sig), daemon=True)
            for sig in (signal.SIGUSR1, signal.SIGTERM)
        ]
        try:
            _wait_for("the leg's end", lambda: "leg time limit reached" in output_path.read_text(),
                      launch)  # fmt: skip
            senders[0].start()
            stop.wait(0.5)
            senders[1].start()
            _wait_for("the stop", lambda: "asked to stop" in output_path.read_text(), launch)
            (tmp_path / "saved-gate").touch()
            status = launch.wait(timeout=120)
        finally:
            _end_storms(launch, stop, senders)
        text = output_path.read_text()
        assert status == 75, f"attempt {attempt}: {text}"
        assert "asked to stop" in text, text
        assert "error:" not in text, text


def session_processes(sid: int) -> list[str]:
    """`pid command` of each process still running in session `sid` (not a zombie)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(f"{stat.parent.name} {command}")
    return found


def test_launch_sh_ending_early_leaves_no_timer_behind(tmp_path: Path) -> None:
    """launch.sh that ends while its leg runs, its EXIT trap run (here a SIGUSR2, which it does
    not trap; a `die`, an error or another fatal signal end it the same way): the leg timer and
    end_leg's recheck end with it. Left behind, the timer held the agent's output pipe open
    for the rest of the leg (the agent reports a command once its output closes; this test's
    communicate() timed out), then sent its USR1 to a PID another process may have by then."""
    node = FakeNode(tmp_path, address=NODE_ADDRESS)
    # A torchrun that ends once its worker has: the leg watchdog stops the worker a second
    # after launch.sh is gone, and the job's log (its tee) closes then.
    node.tool("torchrun", "#!/usr/bin/env bash\nsleep 3600\nexit 0\n")
    launch = subprocess.Popen(
        ["bash", str(NODE / "launch.sh"), "--hosts", NODE_ADDRESS, "--job-id",
         unique_job_id("early"), "--nproc-per-node", "1", "--time-limit", "3600",
         "--stop-grace", "60", "--code-dir", str(node.code)],
        env=node.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert launch.stdout is not None
        for line in launch.stdout:
            if "leg timer set" in line:
                break
        launch.send_signal(signal.SIGUSR2)
        # Reaped at once, as the agent does (the leg watchdog waits while its launcher is there,
        # a zombie included), then read to the end of its output.
        launch.wait(timeout=60)
        launch.communicate(timeout=60)
        # Closed their output, maybe not yet ended: waited for, as any event.
        deadline = time.monotonic() + 30
        while session_processes(launch.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not session_processes(launch.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launch.pid, signal.SIGKILL)
        if launch.poll() is None:
            launch.wait(timeout=10)
