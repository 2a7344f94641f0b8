"""How the SSM agent starts an aws:runShellScript step and reports how it ended.

Each rule is read from aws/amazon-ssm-agent (paths below); `start_script` applies them all,
so that the rehearsal's node agent and the tests start a node script the way the agent does:

- the commands go into `_script.sh` in the step's orchestration folder, joined by newlines
  with one at the end (agent/plugins/pluginutil/pluginutil.go CreateScriptFile), and run as
  `sh -c <absolute path of _script.sh>` (agent/plugins/runscript/runshellscript.go
  shellCommand "sh", shellArgs ["-c"]; runscript.go runCommands: `append(p.ShellArguments,
  scriptPath)` with scriptPath = filepath.Join(orchestrationDir, ScriptName)), so the
  script's `$0` is that path;
- in the agent's working directory: Run Command gives the document parser no
  DefaultWorkingDir (agent/runcommand/utils.go, agent/messageservice/utils/messageutil.go),
  runscript.go falls back to it when the step names no workingDirectory, and os/exec runs a
  command with an empty Dir in its parent's directory (executers.go ExecuteCommand
  `command.Dir = workingDir`): the unit's WorkingDirectory=/usr/bin/
  (packaging/linux/amazon-ssm-agent.service);
- in the environment given (see `agent_environment`) and nothing of the caller's;
- in a process group of its own (agent/executers/executers_unix.go prepareProcess,
  Setpgid), which cancel and executionTimeout SIGKILL (killProcess: kill(-pid, SIGKILL));
- with RLIMIT_NOFILE soft 1024: systemd starts services with DefaultLimitNOFILE=1024:524288
  (systemd-system.conf(5)), the agent's unit does not raise it, and Go >= 1.21, which
  builds the agent, raises its own soft limit but restores the original one in the
  processes it starts (Go CL 476097, syscall.origRlimitNofile);
- with stdout and stderr as pipes that the agent copies one byte per write into files
  (executers.go sets command.Stdout/Stderr to writers, so os/exec makes pipes;
  iomodule/fileS3.go and commandoutput.go Read with bufio.ScanBytes): pipecopy.go does that
  copy here, into `stdout` + `stdoutConsole` and `stderr` + `stderrConsole`. A script that
  writes faster than that waits on a full pipe, as it does on a node.

How the agent reports the end (`plugin_result`, `plugin_output`, `standard_output`,
`standard_error`) follows agent/plugins/pluginutil/pluginutil_unix.go GetStatus,
agent/executers/executers.go ExecuteCommand, agent/framework/runpluginutil/runpluginutil.go
and agent/framework/processor/executer/iohandler/iohandler.go.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from scripts.rehearsal.ssm_agent import (
    AGENT_WORKING_DIRECTORY,
    MAX_STDERR_LENGTH,
    MAX_STDOUT_LENGTH,
    STOPPED_EXIT_CODE,
    go_binary,
)

PIPECOPY_SOURCE = Path(__file__).with_name("pipecopy.go")
SCRIPT_NAME = "_script.sh"  # runshellscript.go shellScriptName
#: systemd's DefaultLimitNOFILE=1024:524288 (systemd-system.conf(5), systemd >= 240).
NOFILE_SOFT = 1024
NOFILE_HARD = 524288
#: appconfig/constants_unix.go RebootExitCode: the script succeeded and asks for a reboot.
REBOOT_EXIT_CODE = 194
#: contracts/model.go ExitWithSuccess / ExitWithFailure: succeed or fail, skip later steps.
EXIT_WITH_SUCCESS = 168
EXIT_WITH_FAILURE = 169
#: iohandler.go: MaximumPluginOutputSize, errTitle, truncateOut, truncateError.
MAXIMUM_PLUGIN_OUTPUT_SIZE = 2500
ERROR_TITLE = "\n----------ERROR-------\n"
TRUNCATE_OUT = "\n---Output truncated---"
TRUNCATE_ERROR = "\n---Error truncated----"
#: iohandler.go DefaultOutputConfig().OutputTruncatedSuffix.
OUTPUT_TRUNCATED_SUFFIX = "--output truncated--"
#: runpluginutil.go: what the agent appends to StandardOutput (and StandardError) for 168/169.
STEP_168_NOTE = (
    "\nStep exited with code 168. Therefore, marking step as succeeded. "
    "Further document steps will be skipped."
)
STEP_169_NOTE = (
    "\nStep exited with code 169. Therefore, marking step as Failed. "
    "Further document steps will be skipped."
)


def pipecopy_binary() -> Path:
    """pipecopy.go, built and cached like paramcheck.go (ClusterError without Go)."""
    return go_binary(PIPECOPY_SOURCE)


def _agent_limits() -> None:
    """In the child only: the open-file limits a script of the agent starts with."""
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE_SOFT, NOFILE_HARD))
    except (ValueError, OSError):
        # Not allowed to raise the hard limit (not root): keep it, lower the soft one.
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(NOFILE_SOFT, hard), hard))


@dataclass
class AgentScript:
    """A script started as the agent starts it: `process` is `sh -c <folder>/_script.sh`
    (its pid leads the script's process group); `copiers` read its stdout and stderr."""

    process: subprocess.Popen[bytes]
    copiers: tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]
    folder: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def stdout_path(self) -> Path:
        return self.folder / "stdout"

    @property
    def stderr_path(self) -> Path:
        return self.folder / "stderr"

    def poll(self) -> int | None:
        """The exit code once the agent would see the end, else None.

        os/exec's Wait returns only when the process has exited and both output pipes have
        reached their end, i.e. when every process holding them has closed them (a script's
        background child that keeps its stdout keeps the command running)."""
        code = self.process.poll()
        if code is None or any(c.poll() is None for c in self.copiers):
            return None
        return exit_code(code)

    def wait(self, timeout: float | None = None) -> int:
        """Waits as `poll` does (subprocess.TimeoutExpired after `timeout` seconds)."""
        code = self.process.wait(timeout)
        for copier in self.copiers:
            copier.wait(timeout)
        return exit_code(code)

    def kill(self) -> None:
        """What the agent does on cancel and executionTimeout: SIGKILL to the script's
        process group (executers_unix.go killProcess); it stops recording output too
        (executers.go cancellableWriter), so the copiers stop."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for copier in self.copiers:
            with contextlib.suppress(ProcessLookupError):
                copier.kill()


def start_script(
    commands: str,
    folder: Path,
    env: Mapping[str, str],
    *,
    cwd: str | Path = AGENT_WORKING_DIRECTORY,
    copier: Path | None = None,
) -> AgentScript:
    """Starts `commands` the way the SSM agent runs an aws:runShellScript step.

    Writes `commands` (the step's lines joined by "\n") and a newline to
    `<folder>/_script.sh` (mode 0700) and runs
    `sh -c <absolute path of it>` in `cwd` (the agent's: /usr/bin/), with exactly `env`
    (use `agent_environment(...)`), in a new process group, with RLIMIT_NOFILE soft 1024
    (hard 524288, or the caller's hard limit where it may not raise it), stdin from
    /dev/null, and stdout and stderr through pipes that pipecopy copies one byte per write
    into `<folder>/stdout` + `stdoutConsole` and `<folder>/stderr` + `stderrConsole`
    (appended to, as the agent does). `copier` is a built pipecopy (default: built and cached
    now). Returns an `AgentScript`: `.wait()` / `.poll()` give the exit code as the agent
    reads it (-1 for a script killed by a signal), `.kill()` does what cancel does.
    """
    folder = Path(folder).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / SCRIPT_NAME
    # pluginutil.go CreateScriptFile: the lines joined by "\n", one "\n" more, mode 0700
    # (appconfig ReadWriteExecuteAccess); `sh -c <path>` executes the file itself.
    script.write_text(commands + "\n")
    script.chmod(0o700)
    binary = str(copier or pipecopy_binary())
    pipes = [os.pipe(), os.pipe()]
    copiers: list[subprocess.Popen[bytes]] = []
    try:
        for (read_end, _), name in zip(pipes, ("stdout", "stderr"), strict=True):
            copiers.append(
                subprocess.Popen(
                    [binary, str(folder / name), str(folder / f"{name}Console")],
                    stdin=read_end,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        process = subprocess.Popen(
            ["sh", "-c", str(script)],
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=pipes[0][1],
            stderr=pipes[1][1],
            process_group=0,
            # Only getrlimit/setrlimit run between fork and exec: no lock another thread
            # could hold, so this is safe in a threaded caller too.
            preexec_fn=_agent_limits,  # noqa: PLW1509
        )
    except BaseException:
        for started in copiers:
            started.kill()
        raise
    finally:
        for read_end, write_end in pipes:
            os.close(read_end)
            os.close(write_end)
    return AgentScript(process, (copiers[0], copiers[1]), folder)


def exit_code(returncode: int) -> int:
    """The exit code the agent reads: Go's WaitStatus.ExitStatus() is -1 for a process ended
    by a signal (executers.go ExecuteCommand), where Python gives minus the signal."""
    return -1 if returncode < 0 else returncode


def plugin_result(code: int, ending: str = "") -> tuple[str, str, int]:
    """(Status, StatusDetails, ResponseCode) for a step that ended with `code`.

    `ending` is "cancel" or "timeout" when the agent killed the script itself (then the code
    is 137, executers.go). Otherwise pluginutil_unix.go GetStatus: 0 Success, 194
    SuccessAndReboot (the service shows the invocation InProgress while the node reboots,
    and the agent runs the step again after it: runpluginutil.go resets SuccessAndReboot to
    InProgress), 137 TimedOut even when the agent did not kill it, anything else Failed; 168
    is turned into Success by runpluginutil.go.
    """
    if ending == "cancel":
        return "Cancelled", "Cancelled", STOPPED_EXIT_CODE
    if ending == "timeout":
        return "TimedOut", "ExecutionTimedOut", STOPPED_EXIT_CODE
    if code in (0, EXIT_WITH_SUCCESS):
        return "Success", "Success", code
    if code == REBOOT_EXIT_CODE:
        return "InProgress", "InProgress", code
    if code == STOPPED_EXIT_CODE:
        return "TimedOut", "ExecutionTimedOut", code
    return "Failed", "Failed", code


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def plugin_output(stdout: bytes, stderr: bytes, code: int) -> str:
    """The `Output` of ListCommandInvocations' CommandPlugins: iohandler.go String() and
    TruncateOutput(stdout, stderr, 2500), on bytes as Go's len() counts them; exit 168
    drops stderr."""
    if code == EXIT_WITH_SUCCESS:
        stderr = b""
    title = ERROR_TITLE.encode() if stderr else b""
    out_mark, err_mark = TRUNCATE_OUT.encode(), TRUNCATE_ERROR.encode()
    available = MAXIMUM_PLUGIN_OUTPUT_SIZE - len(title)
    if len(stdout) + len(stderr) < available:
        return _text(stdout + title + stderr)
    if len(stdout) > available // 2 and len(stderr) > available // 2:
        size = (available - len(err_mark) - len(out_mark)) // 2
        return _text(stdout[:size] + out_mark + title + stderr[:size] + err_mark)
    if len(stdout) <= available // 2:
        size = available - len(err_mark)
        return _text(stdout + title + stderr[: size - len(stdout)] + err_mark)
    size = available - len(out_mark)
    return _text(stdout[: size - len(stderr)] + out_mark + title + stderr)


def _string_prefix(data: bytes, limit: int) -> bytes:
    """pluginutil.go StringPrefix: kept whole below `limit` bytes, else cut with the suffix."""
    if len(data) < limit:
        return data
    suffix = OUTPUT_TRUNCATED_SUFFIX.encode()
    return data[: limit - len(suffix)] + suffix


def standard_output(stdout: bytes, code: int) -> str:
    """GetCommandInvocation's StandardOutputContent: runpluginutil.go adds the 168/169 note,
    then cuts at MaxStdoutLength (24,000) with "--output truncated--"."""
    if code == EXIT_WITH_SUCCESS:
        stdout += STEP_168_NOTE.encode()
    elif code == EXIT_WITH_FAILURE:
        stdout += STEP_169_NOTE.encode()
    return _text(_string_prefix(stdout, MAX_STDOUT_LENGTH))


def standard_error(stderr: bytes, code: int) -> str:
    """GetCommandInvocation's StandardErrorContent: empty for 168, the 169 note added
    (runpluginutil.go), cut by the agent at 24,000 with its suffix (it uses MaxStdoutLength
    for stderr too) and by the API to the first 8,000 characters (API reference)."""
    if code == EXIT_WITH_SUCCESS:
        return ""
    if code == EXIT_WITH_FAILURE:
        stderr += STEP_169_NOTE.encode()
    return _text(_string_prefix(stderr, MAX_STDOUT_LENGTH))[:MAX_STDERR_LENGTH]
