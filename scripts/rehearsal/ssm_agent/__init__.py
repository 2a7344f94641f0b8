"""What the SSM agent does with a Command document, for the checks and the local stand-in.

Every rule here is read from the agent's source (aws/amazon-ssm-agent) or the Run Command
documentation; the path is beside each constant so it can be checked again:

- parameter values: Go's `regexp.Compile(allowedPattern)` then `MatchString` (unanchored),
  and `minChars`/`maxChars` on the value's length
  (agent/framework/docparser/paramvalidator/{allowedregex,minmaxchar}paramvalidator/);
  paramcheck.go beside this file runs exactly those calls with the Go toolchain;
- `{{ Name }}` substitution, all tokens at once, `$$` read as `$`
  (agent/framework/docparser/parameters/parameters.go, ReplaceParameter);
- aws:runShellScript writes the commands to `_script.sh` and runs `sh _script.sh`
  (agent/plugins/runscript/runshellscript.go) in a process group of its own (Setpgid) and,
  on cancel or executionTimeout, SIGKILLs that group with exit code 137
  (agent/executers/executers_unix.go killProcess, executers.go,
  appconfig/constants_unix.go CommandStoppedPreemptivelyExitCode);
- the API returns the first 24,000 characters of stdout and 8,000 of stderr
  (agent/appconfig/constants.go MaxStdoutLength / MaxStderrLength);
- the command's environment is the agent's (a systemd service: systemd's default PATH, no
  login profile, root) plus AWS_SSM_INSTANCE_ID and AWS_SSM_REGION_NAME
  (agent/executers/executers.go).
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
MAX_STDOUT_LENGTH = 24000
MAX_STDERR_LENGTH = 8000
STOPPED_EXIT_CODE = 137
#: aws:runShellScript timeoutSeconds: at most 172800 (48 h), default 3600.
MAX_TIMEOUT_SECONDS = 172800
DEFAULT_TIMEOUT_SECONDS = 3600


def agent_environment(instance_id: str, region: str) -> dict[str, str]:
    """The environment a Run Command script starts with."""
    return {
        "PATH": AGENT_PATH,
        "LANG": "C.UTF-8",
        "HOME": "/root",
        "AWS_SSM_INSTANCE_ID": instance_id,
        "AWS_SSM_REGION_NAME": region,
    }


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
def paramcheck_binary() -> Path:
    """Builds paramcheck.go once per source version; ClusterError without Go."""
    go = shutil.which("go")
    if go is None:
        raise ClusterError(
            "Go is needed to check SSM parameters with the agent's own regexp package: "
            "run `make setup` (installs golang-go) or apt-get install golang-go"
        )
    source = PARAMCHECK_SOURCE.read_bytes()
    binary = _cache_dir() / f"paramcheck-{hashlib.sha256(source).hexdigest()[:16]}"
    if not binary.is_file():
        binary.parent.mkdir(parents=True, exist_ok=True)
        partial = binary.with_name(binary.name + f".{os.getpid()}.tmp")
        result = subprocess.run(
            [go, "build", "-o", str(partial), str(PARAMCHECK_SOURCE)],
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "GOFLAGS": "-mod=mod", "GO111MODULE": "off"},
        )
        if result.returncode != 0:
            raise ClusterError(f"cannot build {PARAMCHECK_SOURCE.name}: {result.stderr.strip()}")
        partial.replace(binary)
    return binary


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
