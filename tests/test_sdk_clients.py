"""moto's SDK tasks get their clients one at a time (scripts/rehearsal/sdk_clients.py): a boto3
Session is not thread safe, and moto runs each execution and Map iteration in a thread."""

from __future__ import annotations

import threading
from typing import Any

from scripts.rehearsal.sdk_clients import one_at_a_time


def test_clients_asked_for_from_many_threads_are_made_one_at_a_time() -> None:
    inside = 0
    most = 0
    guard = threading.Lock()
    entered = threading.Event()

    def make(region: str, service: str, state_credentials: Any) -> tuple[str, str]:
        nonlocal inside, most
        with guard:
            inside += 1
            most = max(most, inside)
        entered.set()
        # Long enough for every other thread to reach the lock while this one makes its client.
        threading.Event().wait(0.02)
        with guard:
            inside -= 1
        return region, service

    client_for = one_at_a_time(make)
    results: list[tuple[str, str]] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(client_for("us-east-1", f"s{i}")))
        for i in range(16)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert entered.is_set()
    assert most == 1
    assert sorted(results) == sorted(("us-east-1", f"s{i}") for i in range(16))
