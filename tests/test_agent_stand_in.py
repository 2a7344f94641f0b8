"""The Run Command stand-in starts scripts and reports them as the SSM agent does.

Each test sends a command through the stand-in's SSM (scripts/rehearsal/ssm_stand_in.py) to a
real node agent (scripts/rehearsal/node_agent.py, run here without namespaces) and checks one
rule of aws/amazon-ssm-agent, whose source path is named beside it. Every wait is for an
event (the invocation's end); the only limits are generous upper bounds.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from scripts.cluster_lib.documents import Document, Parameter
from scripts.rehearsal.instances import Instance
from scripts.rehearsal.ssm_stand_in import SsmStandIn

REPO_ROOT = Path(__file__).resolve().parent.parent
NODE_AGENT = REPO_ROOT / "scripts" / "rehearsal" / "node_agent.py"
INSTANCE_ID = "i-0000000000000000a"
ENDED = {"Success", "Failed", "Cancelled", "TimedOut"}
#: Generous: every command here ends in seconds on a loaded 2-core machine.
PATIENCE_SECONDS = 240
#: iohandler.go errTitle, truncateOut, truncateError; DefaultOutputConfig's suffix.
ERROR_TITLE = "\n----------ERROR-------\n"
TRUNCATE_OUT = "\n---Output truncated---"
TRUNCATE_ERROR = "\n---Error truncated----"
OUTPUT_SUFFIX = "--output truncated--"


def probe(commands: str) -> Document:
    """A one-step aws:runShellScript document running `commands` (no parameter in them, so
    that the agent's `$$` -> `$` substitution leaves them alone)."""
    return Document(
        name="Probe",
        path=Path("Probe.yaml"),
        content={
            "mainSteps": [
                {
                    "action": "aws:runShellScript",
                    "name": "probe",
                    "inputs": {
                        "runCommand": commands.split("\n"),
                        "timeoutSeconds": "{{ Timeout }}",
                    },
                }
            ]
        },
        parameters={"Timeout": Parameter("Timeout", "seconds", "^[0-9]{1,6}$", "600")},
    )


@dataclass
class OneNode:
    """What SsmStandIn needs of the stand-in's Instances, for one node."""

    node: Instance

    @property
    def instances(self) -> list[Instance]:
        return [self.node]

    def instance(self, instance_id: str) -> Instance | None:
        return self.node if instance_id == self.node.instance_id else None


def _raised_soft_limit() -> None:
    # The agent itself runs with its soft limit raised to the hard one (Go >= 1.19 does
    # that at start); only the scripts it starts get 1024 back.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@pytest.fixture(scope="module")
def ssm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SsmStandIn]:
    root = tmp_path_factory.mktemp("node")
    node = Instance(0, INSTANCE_ID, "127.0.0.1", root)
    node.spool.mkdir(parents=True)
    (root / "mounts.json").write_text("[]")
    with (root / "agent.log").open("ab") as log:
        node.agent = subprocess.Popen(
            [sys.executable, str(NODE_AGENT), "--spool", str(node.spool), "--mounts",
             str(root / "mounts.json")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=_raised_soft_limit,  # noqa: PLW1509 (no thread runs yet)
        )  # fmt: skip
    deadline = time.monotonic() + PATIENCE_SECONDS
    while not (node.spool / "agent.json").is_file():
        assert node.agent.poll() is None, (root / "agent.log").read_text()
        assert time.monotonic() < deadline, "the node agent did not start"
        time.sleep(0.1)
    yield SsmStandIn(OneNode(node), {}, itertools.count(1))  # type: ignore[arg-type]
    node.agent.terminate()
    node.agent.wait(PATIENCE_SECONDS)


def run(ssm: SsmStandIn, commands: str, timeout: str = "600") -> dict[str, Any]:
    """Sends `commands`, waits for the invocation's end; GetCommandInvocation's answer with
    the CommandPlugins entry of ListCommandInvocations (Details) as `Plugin`."""
    ssm.documents["Probe"] = probe(commands)
    sent = ssm._ssm_SendCommand(
        {
            "DocumentName": "Probe",
            "InstanceIds": [INSTANCE_ID],
            "Parameters": {"Timeout": [timeout]},
        }
    )
    command_id = sent["Command"]["CommandId"]
    query = {"CommandId": command_id, "InstanceId": INSTANCE_ID}
    deadline = time.monotonic() + PATIENCE_SECONDS
    while (answer := ssm._ssm_GetCommandInvocation(query))["Status"] not in ENDED:
        assert time.monotonic() < deadline, f"the command did not end: {answer}"
        time.sleep(0.1)
    listed = ssm._ssm_ListCommandInvocations({"CommandId": command_id, "Details": True})
    answer["Plugin"] = listed["CommandInvocations"][0]["CommandPlugins"][0]
    answer["Folder"] = ssm.commands[command_id].invocations[INSTANCE_ID].folder
    return answer


def test_the_step_runs_as_sh_c_with_the_absolute_path_of_its_script(ssm: SsmStandIn) -> None:
    # agent/plugins/runscript/runshellscript.go: shellCommand "sh", shellArgs ["-c"];
    # runscript.go runCommands: append(p.ShellArguments, scriptPath), an absolute path;
    # pluginutil.go CreateScriptFile: mode 0700. `sh -c <path>` executes the file, and a file
    # without "#!" is then run by /bin/sh with its path as argument (execve's ENOEXEC).
    answer = run(ssm, 'echo "$0"\nxargs -0 echo < /proc/$$/cmdline\nstat -c %a "$0"')
    script = answer["Folder"] / "_script.sh"
    assert answer["StandardOutputContent"] == f"{script}\n/bin/sh {script}\n700\n"


def test_the_step_runs_in_the_agents_working_directory(ssm: SsmStandIn) -> None:
    # Run Command gives no DefaultWorkingDir (agent/runcommand/utils.go), so Cmd.Dir is ""
    # (agent/executers/executers.go) and the script runs in the agent's own directory,
    # WorkingDirectory=/usr/bin/ (packaging/linux/amazon-ssm-agent.service).
    answer = run(ssm, "pwd -P; readlink /proc/$$/cwd")
    assert answer["StandardOutputContent"] == "/usr/bin\n/usr/bin\n"


def test_the_step_has_the_agents_environment_without_home(ssm: SsmStandIn) -> None:
    # executers.go prepareEnvironment: os.Environ() of the agent (systemd gives a service
    # without User= only PATH and LANG: no HOME) plus AWS_SSM_*; runscript.go adds
    # SSM_COMMAND_ID.
    answer = run(ssm, "env")
    env = dict(line.split("=", 1) for line in answer["StandardOutputContent"].splitlines())
    assert "HOME" not in env
    assert env.pop("PWD") == "/usr/bin"  # sh's own
    assert env == {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
        "SSM_COMMAND_ID": answer["CommandId"],
        "AWS_SSM_INSTANCE_ID": INSTANCE_ID,
        "AWS_SSM_REGION_NAME": "us-east-1",
        "AWS_SSM_PLATFORM_NAME": "Ubuntu",
        "AWS_SSM_PLATFORM_VERSION": "24.04",
    }


def test_the_step_and_its_children_start_with_1024_open_files(ssm: SsmStandIn) -> None:
    # systemd's DefaultLimitNOFILE=1024:524288; Go >= 1.21 restores the soft limit in the
    # processes the agent starts (Go CL 476097). The agent here runs with soft = hard.
    answer = run(ssm, "ulimit -n\nsh -c 'ulimit -n'\nulimit -Hn")
    soft, child, hard = answer["StandardOutputContent"].split()
    assert (soft, child) == ("1024", "1024")
    assert int(hard) >= 1024


def test_output_goes_through_pipes_at_the_agents_pace(ssm: SsmStandIn) -> None:
    # executers.go: command.Stdout/Stderr are writers, so os/exec gives the script pipes;
    # iomodule/fileS3.go and commandoutput.go copy them one byte per write into `stdout` and
    # `stdoutConsole`. Writing 2 MB into a file takes milliseconds; through the agent's
    # copy it takes seconds. Only a generous upper bound on the pace is asserted.
    size = 2_000_000
    answer = run(
        ssm,
        "stat -L -c %F /proc/$$/fd/1 /proc/$$/fd/2 >&2\n"
        "start=$(date +%s%N)\n"
        f"head -c {size} /dev/zero\n"
        "end=$(date +%s%N)\n"
        'echo "$start $end" >&2',
    )
    assert answer["Status"] == "Success", answer
    lines = answer["StandardErrorContent"].splitlines()
    assert lines[:2] == ["fifo", "fifo"]
    start, end = (int(word) for word in lines[2].split())
    rate = size / ((end - start) / 1e9)
    print(f"script's stdout went through the agent's copy at {rate / 1e6:.2f} MB/s")
    assert rate < 20e6
    folder = answer["Folder"]
    assert (folder / "stdout").stat().st_size == size
    assert (folder / "stdoutConsole").read_bytes() == (folder / "stdout").read_bytes()


def test_the_step_ends_when_every_holder_of_its_output_closes_it(ssm: SsmStandIn) -> None:
    # os/exec's Wait (executers.go ExecuteCommand's `done`) returns only once the output
    # pipes reach their end: a background child that keeps stdout keeps the step running.
    answer = run(ssm, "(sleep 2; echo late) &\necho early")
    assert answer["Status"] == "Success"
    assert answer["StandardOutputContent"] == "early\nlate\n"


def test_a_scripts_own_exit_137_is_reported_as_timed_out(ssm: SsmStandIn) -> None:
    # agent/plugins/pluginutil/pluginutil_unix.go GetStatus: 137 without cancel is TimedOut,
    # and so is a script killed by SIGKILL from outside the agent (the OOM killer).
    answer = run(ssm, "exit 137")
    assert (answer["Status"], answer["ResponseCode"]) == ("TimedOut", 137)
    killed = run(ssm, "kill -9 $$")
    assert (killed["Status"], killed["ResponseCode"]) == ("TimedOut", 137)


def test_a_script_killed_by_a_signal_fails_with_code_minus_1(ssm: SsmStandIn) -> None:
    # executers.go: WaitStatus.ExitStatus() is -1 for a signalled process; GetStatus: Failed.
    # $PPID is `sh -c`; the script itself runs in a child of it (see the first test), whose
    # death by a signal `sh -c` reports as 128 + signal: 137 for SIGKILL, read as TimedOut.
    answer = run(ssm, "kill -9 $PPID")
    assert (answer["Status"], answer["ResponseCode"]) == ("Failed", -1)


def test_exit_194_asks_for_a_reboot_and_the_step_runs_again(
    ssm: SsmStandIn, tmp_path: Path
) -> None:
    # appconfig RebootExitCode 194 -> SuccessAndReboot (pluginutil_unix.go); after the
    # reboot runpluginutil.go resets the step to InProgress and runs it again.
    marker = tmp_path / "rebooted-once"
    answer = run(ssm, f"if [ -f {marker} ]; then echo second; exit 0; fi\n"
                      f"touch {marker}; echo first; exit 194")  # fmt: skip
    assert (answer["Status"], answer["ResponseCode"]) == ("Success", 0)
    assert answer["StandardOutputContent"] == "first\nsecond\n"
    spool = answer["Folder"].parents[2] / "spool"
    requests = (spool / "reboots.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in requests].count(
        f"{answer['CommandId']}-{INSTANCE_ID}"
    ) == 1


def test_exit_168_succeeds_and_169_fails_with_the_agents_notes(ssm: SsmStandIn) -> None:
    # contracts/model.go ExitWithSuccess 168, ExitWithFailure 169; runpluginutil.go.
    good = run(ssm, "echo out; echo err >&2; exit 168")
    assert (good["Status"], good["ResponseCode"]) == ("Success", 168)
    assert good["StandardOutputContent"] == (
        "out\n\nStep exited with code 168. Therefore, marking step as succeeded. "
        "Further document steps will be skipped."
    )
    assert good["StandardErrorContent"] == ""
    assert good["Plugin"]["Output"] == "out\n"
    bad = run(ssm, "echo out; exit 169")
    assert (bad["Status"], bad["ResponseCode"]) == ("Failed", 169)
    assert bad["StandardOutputContent"] == (
        "out\n\nStep exited with code 169. Therefore, marking step as Failed. "
        "Further document steps will be skipped."
    )


def test_output_joins_stdout_and_stderr_with_the_agents_separator(ssm: SsmStandIn) -> None:
    # iohandler.go String() -> TruncateOutput(stdout, stderr, 2500).
    answer = run(ssm, "echo out; echo err >&2; exit 1")
    assert answer["Plugin"]["Output"] == "out\n" + ERROR_TITLE + "err\n"
    assert answer["Plugin"]["ResponseCode"] == 1


def test_output_is_cut_at_2500_characters_with_the_agents_marks(ssm: SsmStandIn) -> None:
    # iohandler.go TruncateOutput, both streams over half: each keeps
    # (2500 - 24 - 23 - 23) // 2 = 1215 bytes, then its mark.
    both = run(ssm, "head -c 3000 /dev/zero | tr '\\0' a; head -c 3000 /dev/zero | tr '\\0' b >&2")
    keep = (2500 - len(ERROR_TITLE) - len(TRUNCATE_OUT) - len(TRUNCATE_ERROR)) // 2
    assert keep == 1215
    expected = "a" * keep + TRUNCATE_OUT + ERROR_TITLE + "b" * keep + TRUNCATE_ERROR
    assert both["Plugin"]["Output"] == expected
    # Only stdout long: it is cut to leave room for the whole stderr.
    long_out = run(ssm, "head -c 5000 /dev/zero | tr '\\0' a; echo e >&2")
    room = 2500 - len(ERROR_TITLE) - len(TRUNCATE_OUT) - 2
    assert long_out["Plugin"]["Output"] == "a" * room + TRUNCATE_OUT + ERROR_TITLE + "e\n"
    assert len(long_out["Plugin"]["Output"]) == 2500


def test_standard_output_is_cut_at_24000_with_the_agents_suffix(ssm: SsmStandIn) -> None:
    # runpluginutil.go: StringPrefix(StandardOutput, MaxStdoutLength 24000,
    # "--output truncated--"), which cuts a value of exactly 24,000 too.
    answer = run(ssm, "head -c 24000 /dev/zero | tr '\\0' a")
    assert answer["StandardOutputContent"] == "a" * (24000 - len(OUTPUT_SUFFIX)) + OUTPUT_SUFFIX


def test_a_timeout_below_5_seconds_becomes_3600(ssm: SsmStandIn) -> None:
    # pluginutil.go ValidateExecutionTimeout: outside 5..172800 -> 3600, silently; so a
    # step given 1 second is not stopped after 1 second.
    answer = run(ssm, "sleep 3; echo done", timeout="1")
    assert (answer["Status"], answer["StandardOutputContent"]) == ("Success", "done\n")


def test_start_script_is_usable_on_its_own(tmp_path: Path) -> None:
    """The helper other tests use to start a node script as the agent does."""
    from scripts.rehearsal.ssm_agent import agent_environment
    from scripts.rehearsal.ssm_agent.runscript import start_script

    env = agent_environment(INSTANCE_ID, "us-east-1", command_id="c-1")
    script = start_script(
        "python3 -c 'import resource; print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])'\n"
        'echo "$0" >&2\nexit 3',
        tmp_path / "step",
        env,
    )
    assert script.wait(PATIENCE_SECONDS) == 3
    assert script.stdout_path.read_text() == "1024\n"
    assert script.stderr_path.read_text() == f"{tmp_path / 'step' / '_script.sh'}\n"
    assert os.getpgid(os.getpid()) != script.pid
