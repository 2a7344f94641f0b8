"""The boto3 clients moto's Step Functions interpreter uses for AWS SDK tasks, made one at a time.

moto runs each execution, and each iteration of a Map, in a thread of its own, and asks for a
client for every SDK task (boto_client_for in moto/stepfunctions/parser/asl/utils/
boto_client.py). A boto3 client is safe to share between threads, but making clients from one
Session in several threads at once is not (boto3 guide, "Multithreading or multiprocessing with
clients", and "Session": sessions are not thread safe). Racing threads failed here, on a loaded
machine, with "'dict' object has no attribute 'region'", which the interpreter reports as the
task's States.Runtime and which the job queue's tests then read as a refused claim. The
rehearsals' supervisor, job queue and drain run many executions at once, so their clients are
made under one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()


def one_at_a_time(make: Callable[[str, str, Any], Any]) -> Callable[..., Any]:
    """`make(region, service, state_credentials)` as moto's boto_client_for, under the lock."""

    def client_for(region: str, service: str, state_credentials: Any = None) -> Any:
        with _lock:
            return make(region, service, state_credentials)

    return client_for
