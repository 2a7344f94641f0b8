"""The AWS CLI itself decides whether a node script's `aws` call is one it would send.

The node tests put a fake `aws` on PATH (tests/test_bootstrap.py FAKE_AWS) that records each
call and answers as the test needs. Before it answers, it runs `check_command()`'s command:
the real AWS CLI (awscli 1.45.61 with its own botocore, the Lambda layer that aws-cdk-lib's
dependency aws-cdk.asset-awscli-v1 ships, unpacked once per test session) parses the call
with its driver: the command and subcommand must name an operation (or one of the CLI's own
commands, such as `aws s3 cp`), every option must be a global option or one of the
operation's (the input shape's members in kebab-case, plus the CLI's customizations such as
put-metric-data's --metric-name), each value must convert to the member's type and pass
botocore's parameter validation, and `--query` must compile with jmespath. A call that gets
that far is stopped at botocore's `before-call` event, before anything is signed or sent.

A call the CLI refuses fails the fake with the CLI's own message and exit status 252, as AWS
CLI v2 (the Neuron DLAMI's) reports "Command syntax was invalid, an unknown parameter was
provided, or a parameter value was incorrect" (AWS CLI user guide, "Return codes"); AWS CLI v1
itself exits 255 there. Options that only AWS CLI v2 knows (`--cli-binary-format`,
`--no-cli-pager`) are refused here: the node scripts do not use them.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import io
import os
import shutil
import sys
import tarfile
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

USAGE_ERROR = 252
ASSET = "aws-cdk.asset-awscli-v1"


@functools.cache
def awscli_path() -> Path:
    """The folder that holds the layer's `awscli`, `botocore` and `jmespath` packages."""
    dist = metadata.distribution(ASSET)
    bundle = next(
        Path(str(dist.locate_file(f)))
        for f in dist.files or []
        if f.name.startswith("asset-awscli-v1@") and f.name.endswith(".jsii.tgz")
    )
    target = Path(tempfile.mkdtemp(prefix="awscli-layer-"))
    atexit.register(shutil.rmtree, target, True)
    with tarfile.open(bundle) as tar:
        layer = tar.extractfile("package/lib/layer.zip")
        assert layer is not None, f"{bundle} holds no package/lib/layer.zip"
        with zipfile.ZipFile(io.BytesIO(layer.read())) as archive:
            archive.extractall(target)
    return target / "awscli"


#: Runs the check; a call the CLI accepted once (the same words) is accepted again without
#: starting it: the verdict depends on nothing else.
CHECK_SCRIPT = """#!/usr/bin/env bash
key=$(printf '%q ' "$@" | sha256sum | cut -d ' ' -f 1)
[[ ! -f "{accepted}/$key" ]] || exit 0
"{python}" "{checker}" "{awscli}" "$@" || exit
touch "{accepted}/$key"
"""


@functools.cache
def check_command() -> str:
    """A command that checks the arguments it is given (for a fake `aws`'s script)."""
    awscli = awscli_path()
    accepted = awscli.parent / "accepted"
    accepted.mkdir()
    script = awscli.parent / "aws-check"
    script.write_text(
        CHECK_SCRIPT.replace("{accepted}", str(accepted))
        .replace("{python}", sys.executable)
        .replace("{checker}", str(Path(__file__).resolve()))
        .replace("{awscli}", str(awscli))
    )
    script.chmod(0o755)
    return f'"{script}"'


class _Sent:
    """What botocore's before-call handler returns in place of an HTTP response."""

    status_code = 200
    headers: dict[str, str] = {}  # noqa: RUF012


def check(root: str, argv: list[str]) -> int:
    """0 when the AWS CLI would send this call (or run it: a command with no API call),
    USAGE_ERROR with the CLI's message on stderr when it refuses it."""
    sys.path.insert(0, root)
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_CA_BUNDLE", "AWS_ENDPOINT_URL"):
        os.environ.pop(name, None)
    os.environ.update(
        AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_ACCESS_KEY_ID="AKIDNOTSENT", AWS_SECRET_ACCESS_KEY="not-sent",
        AWS_EC2_METADATA_DISABLED="true",
    )  # fmt: skip
    from awscli.clidriver import create_clidriver

    driver = create_clidriver()
    operations: list[str] = []

    def stop(model: Any, **_: Any) -> tuple[_Sent, dict[str, Any]]:
        operations.append(f"{model.service_model.service_name}.{model.name}")
        return _Sent(), {}

    driver.session.register("before-call", stop)
    sys.argv[0] = "aws"  # argparse names the program in its messages
    errors = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(errors):
        try:
            status = driver.main(argv)
        except SystemExit as exit_:  # argparse: a missing argument, an invalid choice
            status = exit_.code
    if operations or status == 0:
        return 0
    print(f"aws: the AWS CLI refuses `aws {' '.join(argv)}`: {reason(errors.getvalue())}",
          file=sys.stderr)  # fmt: skip
    return USAGE_ERROR


def reason(stderr: str) -> str:
    """The CLI's message in one line, without its usage banner and its lists of choices."""
    banner = "aws <command> <subcommand> help"
    lines = [
        line.strip() for line in stderr.rsplit(banner, maxsplit=1)[-1].splitlines() if line.strip()
    ]
    if not lines:
        return "refused with no message"
    first = lines[0]
    if first.endswith("valid choices are:"):
        hint = [line for line in lines if line.startswith(("Invalid choice:", "* "))]
        return " ".join([first.removesuffix("Invalid choice, valid choices are:").strip(), *hint])
    return " ".join(lines) if first.startswith("Bad value for --query") else first


if __name__ == "__main__":
    sys.exit(check(sys.argv[1], sys.argv[2:]))
