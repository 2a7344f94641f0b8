"""The operator CLI's AWS clients, the region they use, and what it does with AWS's errors.

Every AWS call goes through the boto3 clients in `Clients`, built in one place
(`Clients.from_session`), so the tests can put botocore Stubbers or moto behind them and the
local rehearsal can serve the same calls. Only client methods and paginators are used:

- cloudformation: describe_stacks (outputs.py)
- ec2: describe_instances (paginated), describe_launch_template_versions (fleet.py)
- ssm: describe_instance_information (paginated, fleet.py), send_command,
  list_command_invocations (paginated), get_command_invocation, cancel_command
  (commands.py, node_operations.py), list_commands (paginated, command_history.py, fleet.py)
- logs: describe_log_streams (paginated), get_log_events, filter_log_events (logs.py)
- autoscaling: describe_auto_scaling_groups, describe_instance_refreshes,
  start_instance_refresh (fleet.py)
- fsx: create_data_repository_task, describe_data_repository_tasks (storage.py)
- stepfunctions: the job supervisor's executions (executions.py, jobs.py), the job queue's
  dispatcher (queue.py)
- dynamodb: the job queue (queue.py): query, get_item, put_item, delete_item
- s3: head_object, put_object (a job's code snapshot, code.py), list_objects_v2 (its data,
  job_inputs.py)

An AWS error becomes a one-line ClusterError that says what to do (`aws_errors`,
`cluster_error`). One that may pass if we wait (throttling, a 5xx, a time-out, an expired SSO
session) is ridden out by `Patience` while a command, a job or a task is followed. Time goes
through `Patience.sleep` and `Patience.clock`, so the tests can replace them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
    SSOError,
    TokenRetrievalError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from scripts.cluster_lib import ClusterError

T = TypeVar("T")

#: A boto3 Session, or anything with its `client(name, config=...)` (boto3 has no types here).
Session = Any

CREDENTIAL_ERRORS = {
    "ExpiredToken",
    "ExpiredTokenException",
    "InvalidClientTokenId",
    "UnrecognizedClientException",
    "AuthFailure",
    "SignatureDoesNotMatch",
    "InvalidSignatureException",
}
#: Error codes that mean "slow down" or "try again": botocore's own lists
#: (botocore/retries/standard.py, ThrottlingErrorDetector._THROTTLED_ERROR_CODES and
#: TransientRetryableChecker._TRANSIENT_ERROR_CODES). The adaptive retry mode already retries
#: them a few times per call; a multi-day follow must also outlast a longer spell of them.
TRANSIENT_ERROR_CODES = {
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottledException",
    "TooManyRequestsException",
    "ProvisionedThroughputExceededException",
    "TransactionInProgressException",
    "RequestLimitExceeded",
    "BandwidthLimitExceeded",
    "LimitExceededException",
    "RequestThrottled",
    "SlowDown",
    "PriorRequestNotComplete",
    "EC2ThrottledException",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "InternalServerError",
    "ServiceUnavailable",
}
#: Every client retries throttling, 5xx and connection errors itself, with client-side rate
#: limiting ("adaptive" mode, botocore's Config retries), and gives up on a hung connection.
RETRIES = {"mode": "adaptive", "max_attempts": 10}
TIMEOUTS = {"connect_timeout": 10, "read_timeout": 60}
#: Seconds of transient AWS errors a command's follower rides out before giving up.
DEFAULT_GIVE_UP_AFTER = 1800.0


def resolve_region(cli_region: str | None, environ: Mapping[str, str]) -> str | None:
    """--region, else AWS_REGION, else AWS_DEFAULT_REGION; None leaves it to the profile.

    boto3 1.44 reads only AWS_DEFAULT_REGION (botocore's config_chain `region`); the AWS CLI v2
    and the other SDKs read AWS_REGION first (AWS SDKs and Tools reference guide, "AWS
    Region"), so an operator may have set either.
    """
    for value in (cli_region, environ.get("AWS_REGION"), environ.get("AWS_DEFAULT_REGION")):
        if value:
            return str(value)
    return None


def transient_reason(error: BaseException) -> str | None:
    """Why an error may pass if we wait (None when it will not)."""
    if isinstance(error, (SSOError, TokenRetrievalError)):
        return "the AWS SSO session has expired: run `aws sso login` to renew it"
    if isinstance(error, (BotoConnectionError, HTTPClientError)):
        return f"cannot reach AWS ({error})"
    if isinstance(error, ClientError):
        code = error.response.get("Error", {}).get("Code", "")
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in TRANSIENT_ERROR_CODES or (isinstance(status, int) and status >= 500):
            return f"AWS is throttling or unavailable ({code or status})"
    return None


class TransientAwsError(ClusterError):
    """A ClusterError from an AWS error that may pass if we wait (see transient_reason)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def cluster_error(action: str, error: BaseException) -> ClusterError:  # noqa: PLR0911
    """The one-line ClusterError for a boto3 exception, saying what to do."""
    reason = transient_reason(error)
    if isinstance(error, (NoCredentialsError, PartialCredentialsError)):
        return ClusterError(
            "no AWS credentials found: run `aws configure`, pass --profile, or set "
            "AWS_PROFILE / AWS_ACCESS_KEY_ID"
        )
    if isinstance(error, NoRegionError):
        return ClusterError("no AWS region configured: pass --region or set AWS_REGION")
    if isinstance(error, (SSOError, TokenRetrievalError)):
        return TransientAwsError(
            f"the AWS SSO session has expired while {action}: run `aws sso login` and try again",
            reason or "",
        )
    if isinstance(error, (BotoConnectionError, HTTPClientError)):
        return TransientAwsError(f"cannot reach AWS while {action}: {error}", reason or "")
    if isinstance(error, ClientError):
        code = error.response.get("Error", {}).get("Code", "")
        message = error.response.get("Error", {}).get("Message", str(error))
        if code in CREDENTIAL_ERRORS:
            return ClusterError(f"AWS rejected the credentials ({code}: {message}): refresh them")
        if "AccessDenied" in code:
            return ClusterError(f"access denied while {action}: {message}")
        if reason:
            return TransientAwsError(f"{action} failed: {code}: {message}", reason)
        return ClusterError(f"{action} failed: {code}: {message}")
    return ClusterError(f"{action} failed: {error}")


@contextlib.contextmanager
def aws_errors(action: str) -> Iterator[None]:
    """Turns boto3 exceptions into one-line ClusterErrors that say what to do."""
    try:
        yield
    except (ClientError, BotoCoreError) as error:
        raise cluster_error(action, error) from None


def error_code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


CLIENT_SERVICES = (
    "cloudformation", "ec2", "ssm", "logs", "autoscaling", "fsx", "stepfunctions", "dynamodb",
    "s3",
)  # fmt: skip


@dataclass(frozen=True)
class Clients:
    """One boto3 client per service the CLI calls (typed Any: boto3 has no types here)."""

    cloudformation: Any
    ec2: Any
    ssm: Any
    logs: Any
    autoscaling: Any
    fsx: Any
    stepfunctions: Any
    dynamodb: Any
    s3: Any

    @classmethod
    def from_session(cls, session: Session) -> Clients:
        """The one place the CLI's clients are built, each with RETRIES and TIMEOUTS."""
        with aws_errors("creating AWS clients"):
            return cls(
                **{
                    # A Config each: botocore rewrites the retries dict of the one it gets.
                    name: session.client(name, config=Config(retries=dict(RETRIES), **TIMEOUTS))
                    for name in CLIENT_SERVICES
                }
            )


@dataclass
class Patience:
    """How the CLI waits on AWS: it says what happens through `out`, sleeps `poll_interval`
    seconds between polls, and rides out transient AWS errors for up to `give_up_after`
    seconds without a good answer (one count, shared by everything that follows AWS)."""

    out: Callable[[str], None] = print
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    poll_interval: float = 10.0
    give_up_after: float = DEFAULT_GIVE_UP_AFTER
    _trouble_since: float | None = field(default=None, init=False, repr=False)
    _trouble_reason: str = field(default="", init=False, repr=False)

    def pause(self) -> None:
        """Sleeps until the next poll."""
        self.sleep(self.poll_interval)

    def patiently(self, action: str, call: Callable[[], T], *, hint: str = "") -> T | None:
        """Runs call(); a transient error (throttling, a time-out, an expired SSO session)
        returns None so that the caller polls again, until such errors have lasted
        give_up_after seconds without a good answer in between. Anything else raises."""
        try:
            value = call()
        except (ClientError, BotoCoreError, TransientAwsError) as error:
            reason = (
                error.reason if isinstance(error, TransientAwsError) else transient_reason(error)
            )
            if reason is None:
                raise cluster_error(action, error) from None
            now = self.clock()
            if self._trouble_since is None:
                self._trouble_since = now
            waited = now - self._trouble_since
            if waited >= self.give_up_after:
                raise ClusterError(
                    f"gave up {action} after {waited:.0f} s of AWS errors (last: {reason})"
                    f"{'; ' + hint if hint else ''}"
                ) from None
            if reason != self._trouble_reason:
                self.out(
                    f"{reason} while {action}; trying again for up to {self.give_up_after:.0f} s"
                )
                self._trouble_reason = reason
            return None
        if self._trouble_since is not None:
            self.out("AWS answers again")
        self._trouble_since = None
        self._trouble_reason = ""
        return value

    def persist(self, action: str, call: Callable[[], T], *, hint: str = "") -> T:
        """Runs call() until it answers, riding out transient errors as `patiently` does."""
        while True:
            value = self.patiently(action, call, hint=hint)
            if value is not None:
                return value
            self.pause()
