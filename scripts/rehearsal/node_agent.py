"""The local Run Command stand-in's node agent: one per rehearsal node.

Runs inside the node's network namespace and a mount namespace of its own (started by
instances.py), where it first lays out the node's file system like the
Neuron DLAMI's (overlays on /etc, /opt, /var and /usr/local, so that the fake Neuron and EFA
tools sit at /opt/aws/neuron/bin and /opt/amazon/efa/bin, the venv at
/opt/aws_neuronx_venv_pytorch_2_9 and the node scripts at /opt/trainium-cluster), then runs
the commands the host drops into its spool folder the way the SSM agent runs an
aws:runShellScript step (see ssm_agent/__init__.py beside this file for the sources):

- the step is started by ssm_agent.runscript.start_script: `sh -c <dir>/_script.sh` in
  /usr/bin/, in the agent's environment only (nothing of this process's environment leaks
  in), in a process group of its own, with RLIMIT_NOFILE soft 1024 and its stdout and
  stderr copied through pipes one byte per write (pipecopy.go);
- on cancel and on executionTimeout the process group gets SIGKILL and the exit code is 137;
- the status file says InProgress, then what runscript.plugin_result makes of the end:
  Success, Failed, Cancelled or TimedOut (a script's own 137 too). A 194 asks for a reboot:
  the agent reports InProgress, reboots and runs the step again; this agent writes the
  request to reboots.jsonl in its spool and runs the step again at once (it cannot reboot
  its node: instances.py owns that).

Spool protocol (all files written atomically): commands/<id>.json {id, script, env, timeout,
dir, copier}; cancel/<id> asks for a cancel; <dir>/status.json is the agent's answer;
<dir>/stdout and <dir>/stderr grow while the script runs (at the agent's pace).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as a script inside the node's namespaces: the repository root holds the scripts package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.rehearsal.ssm_agent.runscript import (
    REBOOT_EXIT_CODE,
    AgentScript,
    plugin_result,
    start_script,
)

POLL_SECONDS = 0.1


def note(*words: object) -> None:
    """One line of the agent's log (agent.log beside the spool), with the time: what a failed
    rehearsal's investigation reads to see when each step started and ended."""
    print(f"{time.time():.3f}", *words, flush=True)


def write_json(path: Path, value: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(value))
    partial.replace(path)


def mount(spec: dict[str, str]) -> None:
    target = spec["target"]
    if spec["type"] == "overlay":
        options = f"lowerdir={target},upperdir={spec['upper']},workdir={spec['work']}"
        command = ["mount", "-t", "overlay", "overlay", "-o", options, target]
    elif spec["type"] == "bind":
        Path(target).mkdir(parents=True, exist_ok=True)
        command = ["mount", "--bind", spec["source"], target]
    else:
        raise SystemExit(f"local agent: unknown mount type {spec['type']!r}")
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"local agent: {' '.join(command)} failed: {result.stderr.strip()}")


@dataclass
class Running:
    spec: dict[str, Any]
    script: AgentScript
    started: float
    ending: str = ""

    @property
    def folder(self) -> Path:
        return Path(self.spec["dir"])

    def kill(self, why: str) -> None:
        """SIGKILL to the script's process group, as the agent's killProcess does."""
        if not self.ending:
            self.ending = why
            self.script.kill()


def start(spec: dict[str, Any]) -> Running:
    folder = Path(spec["dir"])
    folder.mkdir(parents=True, exist_ok=True)
    now = time.time()
    write_json(folder / "status.json", {"status": "InProgress", "started": now})
    note("start", spec["id"])
    copier = Path(spec["copier"]) if spec.get("copier") else None
    script = start_script(spec["script"], folder, spec["env"], copier=copier)
    return Running(spec, script, now)


def finish(running: Running, code: int) -> None:
    status, details, code = plugin_result(code, running.ending)
    note("end", running.spec["id"], status, code)
    write_json(
        running.folder / "status.json",
        {
            "status": status,
            "details": details,
            "code": code,
            "started": running.started,
            "ended": time.time(),
        },
    )


def reboot_requested(spool: Path, running: Running) -> Running:
    """The script ended with 194: note the reboot asked for and run the step again."""
    with (spool / "reboots.jsonl").open("a") as log:
        log.write(json.dumps({"id": running.spec["id"], "at": time.time()}) + "\n")
    return start(running.spec)  # the agent's timer starts again with the step


def serve(spool: Path) -> None:
    commands, cancels = spool / "commands", spool / "cancel"
    commands.mkdir(parents=True, exist_ok=True)
    cancels.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    running: dict[str, Running] = {}
    write_json(spool / "agent.json", {"pid": os.getpid(), "started": time.time()})
    note("agent", os.getpid(), "serves", spool)
    while True:
        for path in sorted(commands.glob("*.json")):
            if path.stem in seen:
                continue
            seen.add(path.stem)
            spec = json.loads(path.read_text())
            if (cancels / path.stem).exists():
                folder = Path(spec["dir"])
                folder.mkdir(parents=True, exist_ok=True)
                write_json(folder / "status.json", {"status": "Cancelled", "code": -1})
                note("cancelled before its start", path.stem)
                continue
            running[path.stem] = start(spec)
        for key, item in list(running.items()):
            if (cancels / key).exists():
                item.kill("cancel")
            elif time.time() - item.started > float(item.spec["timeout"]):
                item.kill("timeout")
            code = item.script.poll()
            if code is None:
                continue
            if code == REBOOT_EXIT_CODE and not item.ending:
                running[key] = reboot_requested(spool, item)
                continue
            finish(item, code)
            del running[key]
        time.sleep(POLL_SECONDS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spool", type=Path, required=True)
    parser.add_argument("--mounts", type=Path, required=True, help="JSON list of mount specs")
    args = parser.parse_args()
    for spec in json.loads(args.mounts.read_text()):
        mount(spec)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    serve(args.spool)
    return 0


if __name__ == "__main__":
    sys.exit(main())
