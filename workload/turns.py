"""Work every rank of a job does together: the leader first, or a few ranks of a node at a time.

A user error (bad data, a bad model, a bad checkpoint) found on one rank is raised on every
rank as ``SharedError``, after the same barriers, so no rank waits forever for one that
stopped; rank 0 prints it once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from workload.backend import Backend, BackendError
from workload.checkpoint import CheckpointError
from workload.config import ConfigError
from workload.data import DataError
from workload.model import ModelError

#: Errors that are the user's to fix: one line, no traceback.
USER_ERRORS = (ConfigError, DataError, ModelError, CheckpointError, BackendError)
#: Of those, the job's own input (its flags, its data): exit status 2, which the cluster's
#: supervisor does not retry (docs/jobs.md, exit statuses); the others exit 1.
INPUT_ERRORS = (ConfigError, DataError)
INPUT_ERROR_STATUS = 2


def exit_status(exc: BaseException) -> int:
    """The trainer's exit status for a user error: 2 for the job's own input, else 1."""
    if isinstance(exc, SharedError):
        return exc.status
    return INPUT_ERROR_STATUS if isinstance(exc, INPUT_ERRORS) else 1


T = TypeVar("T")


class SharedError(RuntimeError):
    """A user error that one rank found and every rank raises (printed once, by rank 0), with
    the exit status of the original error (exit_status)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def read_once(backend: Backend, read: Callable[[], T]) -> T:
    """``read()`` on rank 0 alone, its result on every rank (a tree of gloo broadcasts).

    What every rank needs whole (a checkpoint's optimizer state on resume) is read from the
    shared file system once instead of once per node or per rank: stacks/start_limits.py
    counts the difference at 1,024 nodes. A user error on rank 0 is raised on every rank.
    """
    result = leader_first(backend, read, lambda: None, per_node=False)
    return backend.broadcast_object(result if backend.is_main else None)


def main_then_nodes(
    backend: Backend,
    make: Callable[[], T],
    reuse: Callable[[T], T | None],
    follower: Callable[[T], T],
) -> T:
    """``make()`` on rank 0 first; then each other node's local rank 0 takes rank 0's result
    through ``reuse`` (None when its node cannot see what rank 0 made, a node-local
    directory say: it then runs ``make()`` itself); the other ranks take their node
    leader's through ``follower``.

    On the cluster the job's files are on the shared file system, so one rank does the work
    (downloading a data set, filling the token cache) instead of one per node at the same
    time, and the nodes' leaders only check that it is there. User errors are shared as in
    ``leader_first``.
    """
    first = leader_first(backend, make, lambda: None, per_node=False)
    first = backend.broadcast_object(first if backend.is_main else None)

    def node_leader() -> T:
        if backend.is_main:
            return first
        reused = reuse(first)
        return make() if reused is None else reused

    mine = leader_first(backend, node_leader, lambda: None, per_node=True)
    leaders = backend.from_node_leader(mine if backend.is_local_main else None)
    return mine if backend.is_local_main else follower(leaders)  # type: ignore[return-value]


def leader_first(
    backend: Backend, leader: Callable[[], T], follower: Callable[[], T], *, per_node: bool
) -> T:
    """Run ``leader`` on rank 0 (or each node's local rank 0), then ``follower`` elsewhere.

    A user error on a leader is raised on every rank, so the whole job stops before
    training instead of waiting at a barrier; it is printed once, by rank 0.
    """
    is_leader = backend.is_local_main if per_node else backend.is_main
    result: T | None = None
    error: tuple[str, int] | None = None
    if is_leader:
        try:
            result = leader()
        except USER_ERRORS as exc:
            error = (str(exc), exit_status(exc))
    errors = [found for found in backend.all_gather_object(error) if found is not None]
    if errors:
        raise SharedError(*errors[0])
    if not is_leader:
        result = follower()
    return result  # type: ignore[return-value]
