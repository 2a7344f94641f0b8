"""What the CLI settles before its first AWS call: bad input (one line, exit status 2, no AWS
call), the region (--region, AWS_REGION, AWS_DEFAULT_REGION) and the clients' retry mode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import boto3
import pytest

from scripts import cluster as cli
from scripts.cluster_lib.clients import CLIENT_SERVICES, RETRIES, Clients, resolve_region

REPO_ROOT = Path(__file__).resolve().parent.parent
LONG = "--name=" + "a" * 2042


@pytest.fixture
def no_aws(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fails the test if the CLI gets as far as building its AWS clients."""
    reached: list[str] = []

    def refuse(*_: Any, **__: Any) -> Any:
        reached.append("make_cluster")
        raise AssertionError("the CLI reached AWS")

    monkeypatch.setattr(cli, "make_cluster", refuse)
    return reached


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--master-port", "70000"],
         "--master-port '70000' is not allowed: use a TCP port from 1 to 65534 (the next port "
         "is the Neuron root communicator's)"),
        (["train", "--master-port", "65535"], "--master-port '65535' is not allowed"),
        (["precompile", "--job-id", "x", "--master-port", "0"], "--master-port '0' is not allowed"),
        (["preflight", "--port", "http"], "--port 'http' is not allowed"),
        (["train", "--", "--model", "tiny", "--output", "/tmp/x"],
         "train argument --output is set by the node scripts: the job writes to "
         "/fsx/jobs/<job-id> (set --job-id)"),
        (["train", "--", "--output=/fsx/other"], "train argument --output is set by the node"),
        (["precompile", "--job-id", "x", "--", "--max-steps", "5"],
         "train argument --max-steps is set by the node scripts: precompile traces --steps "
         "steps (set --steps)"),
        (["precompile", "--job-id", "x", "--", "--output", "/x"], "train argument --output is set"),
        (["train", "--", "--help"], "train argument --help would only print train.py's help"),
        (["train", "--", "--data", "/fsx/data;reboot"],
         "train argument '/fsx/data;reboot' is not allowed: use letters, digits and"),
        (["train", "--", "--data", "$(reboot)"], "train argument '$(reboot)' is not allowed"),
        (["train", "--", LONG, "--lr", "1"],
         "the train arguments are 2056 characters long: at most 2048 fit the SSM parameter"),
        (["train", "--poll-interval", "0"], "--poll-interval 0 is not allowed: use more than 0"),
        (["status", "--poll-interval", "-5"], "--poll-interval -5 is not allowed"),
        (["status", "--poll-interval", "nan"], "--poll-interval nan is not allowed"),
        (["logs", "--job-id", "x", "--wait-timeout", "-1"], "--wait-timeout -1 is not allowed"),
        (["train", "--give-up-after", "inf"], "--give-up-after inf is not allowed"),
        (["precompile", "--job-id", "bad id"],
         "--job-id 'bad id' is not allowed: use 1-64 letters, digits, '.', '_' or '-', starting "
         "with a letter or digit"),
        (["precompile", "--job-id", "../etc"], "--job-id '../etc' is not allowed"),
        (["train", "--job-id", "a" * 65], f"--job-id '{'a' * 65}' is not allowed: use 1-64"),
        (["stop", "--job-id", "a;b"], "--job-id 'a;b' is not allowed"),
        (["logs", "--job-id", "x y"], "--job-id 'x y' is not allowed"),
        (["logs"], "logs needs exactly one of --job-id or --command-id"),
        (["logs", "--job-id", "x", "--command-id", "y"], "logs needs exactly one of"),
        (["logs", "--command-id", "abc"], "--command-id 'abc' is not an SSM command ID"),
        (["logs", "--job-id", "x", "--lines", "0"], "--lines 0 is not allowed: use 1 to 10000"),
        (["train", "--nproc-per-node", "0"], "--nproc-per-node '0' is not allowed"),
        (["precompile", "--job-id", "x", "--steps", "0"], "--steps '0' is not allowed"),
        (["train", "--max-retries", "-1"], "--max-retries -1 is not allowed: use 0 or more"),
        (["train", "--no-retry-on", "5,x"],
         "--no-retry-on '5,x' is not allowed: give exit statuses from 1 to 127, comma separated "
         "(launch.sh reports any higher status as 1)"),
        (["train", "--no-retry-on", "137"], "--no-retry-on '137' is not allowed"),
        (["train", "--retry-on", "0"], "--retry-on '0' is not allowed"),
        (["train", "--no-retry-on", "75"],
         "--no-retry-on names 75, the status launch.sh reports when a leg ends at its time limit"),
        (["train", "--no-retry-on", "5,6", "--retry-on", "6"],
         "--no-retry-on and --retry-on both name 6: name a status in one of them"),
        (["train", "--retry-delay", "-1"], "--retry-delay -1 is not allowed"),
        (["export", "--timeout", "0"], "--timeout 0 is not allowed"),
        (["--cluster-name", "Prod_1", "status"], "--cluster-name 'Prod_1' is not allowed"),
        (["status", "--", "--lr", "1"], "status takes no train.py arguments after --"),
        (["train", "--max-retries", "two"],
         "cluster.py train: argument --max-retries: invalid int value: 'two' (see --help)"),
        (["train", "--bogus"], "cluster.py: unrecognized arguments: --bogus (see --help)"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_in_one_line_before_any_aws_call(
    argv: list[str], message: str, no_aws: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"error: {message}")
    assert no_aws == []


def test_good_input_gets_as_far_as_aws(no_aws: list[str]) -> None:
    argv = [
        "train", "--job-id", "bert-1", "--master-port", "65534", "--poll-interval", "0.5",
        "--", "--data", "/fsx/data/imdb", "--max-steps", "100", "--output-format=x",
    ]  # fmt: skip
    with pytest.raises(AssertionError, match="the CLI reached AWS"):
        cli.main(argv)
    assert no_aws == ["make_cluster"]


# ---------------------------------------------------------------------------- region
@pytest.mark.parametrize(
    ("cli_region", "environ", "expected"),
    [
        (None, {"AWS_REGION": "us-west-2"}, "us-west-2"),
        (None, {"AWS_DEFAULT_REGION": "us-east-2"}, "us-east-2"),
        (None, {"AWS_REGION": "us-west-2", "AWS_DEFAULT_REGION": "us-east-2"}, "us-west-2"),
        ("eu-west-1", {"AWS_REGION": "us-west-2", "AWS_DEFAULT_REGION": "us-east-2"}, "eu-west-1"),
        (None, {"AWS_REGION": ""}, None),
        (None, {}, None),
    ],
)
def test_region_order(cli_region: str | None, environ: dict[str, str], expected: str) -> None:
    assert resolve_region(cli_region, environ) == expected


def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **values: str) -> None:
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    for key, value in values.items():
        monkeypatch.setenv(key, value)


def test_aws_region_alone_reaches_every_client(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """boto3 1.44 itself ignores AWS_REGION (botocore's config chain reads AWS_DEFAULT_REGION)."""
    isolated_env(monkeypatch, tmp_path, AWS_REGION="us-west-2")
    assert boto3.Session().region_name is None
    args = cli.build_parser().parse_args(["status"])
    cluster = cli.make_cluster(args)
    assert {c.meta.region_name for c in vars(cluster.clients).values()} == {"us-west-2"}
    args = cli.build_parser().parse_args(["status", "--region", "eu-west-1"])
    assert cli.make_cluster(args).clients.ssm.meta.region_name == "eu-west-1"


def test_the_profile_region_still_applies_without_the_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    isolated_env(monkeypatch, tmp_path)
    (tmp_path / "config").write_text("[profile ops]\nregion = ap-northeast-1\n")
    args = cli.build_parser().parse_args(["--profile", "ops", "status"])
    assert cli.make_cluster(args).clients.ssm.meta.region_name == "ap-northeast-1"


def test_cli_with_only_aws_region_set_gets_past_the_region(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_REGION="us-east-1", AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_EC2_METADATA_DISABLED="true",
    )  # fmt: skip
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "cluster.py"), "status"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    # Past the region, the next thing missing is the credentials.
    assert (result.returncode, result.stderr) == (
        1,
        "error: no AWS credentials found: run `aws configure`, pass --profile, or set "
        "AWS_PROFILE / AWS_ACCESS_KEY_ID\n",
    )


# ------------------------------------------------------------------- client config
def test_every_client_uses_adaptive_retries_and_time_outs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    isolated_env(monkeypatch, tmp_path, AWS_DEFAULT_REGION="us-east-1")
    clients = Clients.from_session(boto3.Session())
    for name, client in vars(clients).items():
        config = client.meta.config
        assert config.retries["mode"] == "adaptive", name
        assert config.retries["total_max_attempts"] == 11, name  # max_attempts 10 retries
        assert (config.connect_timeout, config.read_timeout) == (10, 60), name
    assert RETRIES == {"mode": "adaptive", "max_attempts": 10}
    assert (
        set(CLIENT_SERVICES)
        == set(vars(clients))
        == {
            "cloudformation",
            "ec2",
            "ssm",
            "logs",
            "autoscaling",
            "fsx",
            "stepfunctions",
            "dynamodb",
            "s3",
        }
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], [2]), (["--no-retry-on", "5,6"], [2, 5, 6]), (["--retry-on", "2"], []),
     (["--no-retry-on", "9", "--retry-on", "2"], [9])],
)  # fmt: skip
def test_train_names_the_statuses_the_supervisor_does_not_retry(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], expected: list[int]
) -> None:
    """The job's NoRetryStatuses in the execution input (stacks/supervisor_states.py
    JOB_DEFAULTS): 2, the input error, unless `--retry-on 2`; plus `--no-retry-on`."""
    from scripts.cluster_lib import jobs

    started: dict[str, Any] = {}
    monkeypatch.setattr(cli, "make_cluster", lambda *_: object())

    class NoExecutions:
        def of_job(self, job_id: str) -> None:
            return None

    def init(self: Any, cluster: Any) -> None:
        self.executions = NoExecutions()

    monkeypatch.setattr(jobs.Jobs, "__init__", init)
    monkeypatch.setattr(jobs.Jobs, "poll_seconds", lambda self, requested: 300)
    monkeypatch.setattr(jobs.Jobs, "start", lambda self, *a, **k: started.update(k) or "arn")
    monkeypatch.setattr(jobs.Jobs, "run", lambda self, *a, **k: None)
    monkeypatch.setattr(cli, "job_inputs", lambda cluster, args: None)  # the code: not here
    assert cli.main(["train", "--job-id", "j", *argv]) == 0
    assert started["options"]["NoRetryStatuses"] == expected
