"""What the SSM agent does with a Command document, for the checks and the local stand-in.

Every rule here is read from the agent's source (aws/amazon-ssm-agent) or the Run Command
documentation; the path is beside each constant so it can be checked again:

- parameter values: Go's `regexp.Compile(allowedPattern)` then `MatchString` (unanchored),
  and `minChars`/`maxChars` on the value's length
  (agent/framework/docparser/paramvalidator/{allowedregex,minmaxchar}paramvalidator/);
  paramcheck.go beside this file runs exactly those calls with the Go toolchain;
- `{{ Name }}` substitution, all tokens at once, `$$` read as `$`
  (agent/framework/docparser/parameters/parameters.go, ReplaceParameter);
- how aws:runShellScript starts a step (`sh -c <absolute path of _script.sh>`, the agent's
  working directory and environment, the open-file limit, the output pipes copied one byte
  per write by pipecopy.go) and how it reports the exit: runscript.py beside this file;
- `timeoutSeconds` outside 5..172800 (or not a number) becomes 3600, silently
  (agent/plugins/pluginutil/pluginutil.go ValidateExecutionTimeout);
- the command's environment is the agent's own (a systemd service: PATH and LANG only, no
  HOME, no login profile, root) plus SSM_COMMAND_ID (agent/plugins/runscript/runscript.go
  setCommandIdEnvironment) and AWS_SSM_INSTANCE_ID, AWS_SSM_REGION_NAME,
  AWS_SSM_PLATFORM_NAME, AWS_SSM_PLATFORM_VERSION (agent/executers/executers.go
  prepareEnvironment).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

from scripts.cluster_lib import ClusterError

PARAMCHECK_SOURCE = Path(__file__).with_name("paramcheck.go")
#: systemd's default PATH, which the agent's service (and so every command) gets.
AGENT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The agent's service runs with WorkingDirectory=/usr/bin/ (packaging/linux and
#: packaging/ubuntu amazon-ssm-agent.service), and so does every script it starts: see
#: runscript.py.
AGENT_WORKING_DIRECTORY = "/usr/bin/"
#: What the agent reads from /etc/os-release (NAME, VERSION_ID) on the Neuron DLAMI
#: (agent/platform/platform_unix.go getPlatformDetails).
PLATFORM_NAME = "Ubuntu"
PLATFORM_VERSION = "24.04"
#: GetCommandInvocation: StandardOutputContent is the first 24,000 characters, with the
#: agent's suffix when cut (agent/framework/runpluginutil/runpluginutil.go, StringPrefix with
#: iohandler.DefaultOutputConfig().MaxStdoutLength); StandardErrorContent the first 8,000
#: (SSM API reference, GetCommandInvocation).
MAX_STDOUT_LENGTH = 24000
MAX_STDERR_LENGTH = 8000
STOPPED_EXIT_CODE = 137
#: aws:runShellScript timeoutSeconds: 5..172800 (48 h), else 3600
#: (agent/plugins/pluginutil/pluginutil.go min/max/defaultExecutionTimeoutInSeconds).
MIN_TIMEOUT_SECONDS = 5
MAX_TIMEOUT_SECONDS = 172800
DEFAULT_TIMEOUT_SECONDS = 3600


def agent_environment(instance_id: str, region: str, *, command_id: str) -> dict[str, str]:
    """The environment a Run Command script starts with.

    The agent passes its own environment (`os.Environ()`, agent/executers/executers.go
    prepareEnvironment): a system service's under systemd, where only PATH and LANG are set
    and HOME, USER and SHELL are not (systemd.exec(5): they are set only for units with
    User=, which the agent's unit has not). To it the plugin adds SSM_COMMAND_ID
    (agent/plugins/runscript/runscript.go setCommandIdEnvironment) and the executer the
    AWS_SSM_* variables (executers.go envVarInstanceID, envVarRegionName,
    envVarPlatformName, envVarPlatformVersion).
    """
    return {
        "PATH": AGENT_PATH,
        "LANG": "C.UTF-8",
        "SSM_COMMAND_ID": command_id,
        "AWS_SSM_INSTANCE_ID": instance_id,
        "AWS_SSM_REGION_NAME": region,
        "AWS_SSM_PLATFORM_NAME": PLATFORM_NAME,
        "AWS_SSM_PLATFORM_VERSION": PLATFORM_VERSION,
    }


def execution_timeout(text: str) -> int:
    """timeoutSeconds as the agent reads it (pluginutil.go ValidateExecutionTimeout and
    extractIntFromString): an integer, else a float cut to an integer, else 3600; outside
    5..172800 it becomes 3600, without a word to the caller."""
    try:
        seconds = int(text)
    except ValueError:
        try:
            seconds = int(float(text))
        except (ValueError, OverflowError):
            seconds = DEFAULT_TIMEOUT_SECONDS
    if seconds < MIN_TIMEOUT_SECONDS or seconds > MAX_TIMEOUT_SECONDS:
        return DEFAULT_TIMEOUT_SECONDS
    return seconds


def substitute(text: str, values: dict[str, str]) -> str:
    """Replaces every `{{ Name }}` at once, as the agent's ReplaceParameter does."""
    tokens: list[tuple[int, int, str]] = []
    for name, value in values.items():
        for match in re.finditer(r"\{\{\s*" + re.escape(name) + r"\s*\}\}", text):
            tokens.append((match.start(), match.end(), value.replace("$$", "$")))
    out, start = [], 0
    for begin, end, value in sorted(tokens):
        out.append(text[start:begin])
        out.append(value)
        start = end
    out.append(text[start:])
    return "".join(out)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trainium-cluster"


@cache
def go_binary(source_path: Path) -> Path:
    """Builds a Go program beside this file once per source version; ClusterError without Go."""
    go = shutil.which("go")
    if go is None:
        raise ClusterError(
            f"Go is needed to build {source_path.name}, which does what the SSM agent does with "
            "Go's own packages: run `make setup` (installs golang-go) or apt-get install golang-go"
        )
    source = source_path.read_bytes()
    binary = _cache_dir() / f"{source_path.stem}-{hashlib.sha256(source).hexdigest()[:16]}"
    if not binary.is_file():
        binary.parent.mkdir(parents=True, exist_ok=True)
        partial = binary.with_name(binary.name + f".{os.getpid()}.tmp")
        result = subprocess.run(
            [go, "build", "-o", str(partial), str(source_path)],
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "GOFLAGS": "-mod=mod", "GO111MODULE": "off"},
        )
        if result.returncode != 0:
            raise ClusterError(f"cannot build {source_path.name}: {result.stderr.strip()}")
        partial.replace(binary)
    return binary


def paramcheck_binary() -> Path:
    """paramcheck.go, built and cached."""
    return go_binary(PARAMCHECK_SOURCE)


def go_check(checks: list[dict[str, Any]]) -> list[str | None]:
    """Runs checks ({pattern, minChars, maxChars, value}) through Go; one error or None each."""
    result = subprocess.run(
        [str(paramcheck_binary())],
        input=json.dumps(checks),
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise ClusterError(f"paramcheck failed: {result.stderr.strip()}")
    return [item["error"] for item in json.loads(result.stdout)]
