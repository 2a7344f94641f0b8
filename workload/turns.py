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

T = TypeVar("T")


class SharedError(RuntimeError):
    """A user error that one rank found and every rank raises (printed once, by rank 0)."""


#: Processes of a node that read a checkpoint's trainer state at the same time on resume.
#: Every rank needs the whole optimizer state; 32 ranks reading it at once from the shared
#: file system multiply the read and the host memory it takes by 32.
READERS_PER_NODE = 4


def read_in_turns(backend: Backend, read: Callable[[], T]) -> T:
    """``read()`` on every rank, ``READERS_PER_NODE`` local ranks at a time.

    Every rank passes the same barriers (nodes have the same number of processes); a user
    error on one rank is raised on every rank after the last turn, so none waits forever.
    """
    turns = -(-backend.local_world_size // READERS_PER_NODE)
    result: T | None = None
    error: str | None = None
    for turn in range(turns):
        if backend.local_rank // READERS_PER_NODE == turn:
            try:
                result = read()
            except USER_ERRORS as exc:
                error = str(exc)
        backend.barrier()
    errors = [message for message in backend.all_gather_object(error) if message is not None]
    if errors:
        raise SharedError(errors[0])
    return result  # type: ignore[return-value]


def leader_first(
    backend: Backend, leader: Callable[[], T], follower: Callable[[], T], *, per_node: bool
) -> T:
    """Run ``leader`` on rank 0 (or each node's local rank 0), then ``follower`` elsewhere.

    A user error on a leader is raised on every rank, so the whole job stops before
    training instead of waiting at a barrier; it is printed once, by rank 0.
    """
    is_leader = backend.is_local_main if per_node else backend.is_main
    result: T | None = None
    error: str | None = None
    if is_leader:
        try:
            result = leader()
        except USER_ERRORS as exc:
            error = str(exc)
    errors = [message for message in backend.all_gather_object(error) if message is not None]
    if errors:
        raise SharedError(errors[0])
    if not is_leader:
        result = follower()
    return result  # type: ignore[return-value]
