"""How a running job is asked to stop, or to wait: SIGTERM and the hold of rehearsals.

``StopRequest`` records SIGTERM; the training loop stops at a step every rank agrees on,
saves and exits 0 (``workload/train.py``). ``StopAgreement`` is that agreement: a host-side
any-rank vote started at one log step and read at the next, so no step waits for it.

``TRAINIUM_HOLD_AFTER_STEP=N`` is for rehearsals and tests of faults: after step N (its
checkpoint saved, if N is a checkpoint step) the trainers wait, doing nothing but asking each
other every ``HOLD_POLL_SECONDS`` whether a stop was requested. They go on when one was (on
any rank: the stop then runs as it always does, at the next agreed step, with its
checkpoint) and otherwise wait until they are killed. Rank 0 writes a ``hold`` line to
``metrics.jsonl`` when the wait begins. A test can then cancel a node, stop the job or end
its leg at a step it knows, instead of racing the training against its own timing. A run
that resumes at step N does not hold again (it holds only after training step N itself).
Unset (the default), nothing waits.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Mapping
from typing import Any

from workload.config import ConfigError

HOLD_VARIABLE = "TRAINIUM_HOLD_AFTER_STEP"

#: How often held ranks ask each other whether a stop was requested (one ``any_rank`` each).
HOLD_POLL_SECONDS = 0.2


class StopRequest:
    """Records SIGTERM while it is in force; the training loop acts on it.

    SIGTERM comes from the launcher ending a leg before its time limit, from the instance
    shutting down (systemd sends it to every process) and from the end of a Capacity
    Block. The handler only sets a flag: the loop then stops at the next step that all
    ranks agree on (see ``Run._stop_agreed``), saves a resumable checkpoint and returns
    its summary with ``stopped_by_signal``, so the process exits 0.
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: Any = None

    def __enter__(self) -> StopRequest:
        # Signal handlers can only be set from the main thread (a test may train elsewhere).
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: object) -> None:
        self.signal = signum

    @property
    def requested(self) -> bool:
        return self.signal is not None


class StopAgreement:
    """Whether every rank stops after this log step: a vote that does not hold up the steps.

    A vote over all ranks is a host-side all-reduce over gloo: at 1,024 nodes a ring over
    the nodes' leaders, about 2,000 hops, with the device idle while it runs. So each log
    step reads the answer of the vote started at the previous log step (it has had
    ``--log-every`` steps of device time to finish) and starts the next one with this
    rank's flag. Every rank starts and reads vote k at the same log steps and every rank
    gets the same answer, so all stop after the same step; a SIGTERM is acted on within two
    log intervals instead of one.

    ``start`` begins a vote with this rank's flag and returns the function that waits for
    its answer (``Backend.start_any_rank``).
    """

    def __init__(self, start: Callable[[bool], Callable[[], bool]]) -> None:
        self._start = start
        self._answer: Callable[[], bool] | None = None
        self._agreed = False

    def at_log_step(self, requested: bool) -> bool:
        """True when the ranks have agreed to stop after this step (the same on every rank)."""
        answered = self.finish()
        agreed = self._agreed or answered
        if not agreed:
            self._answer = self._start(requested)
        return agreed

    def agreed_elsewhere(self) -> None:
        """Every rank already knows of a stop (a synchronous vote, the hold's): the next
        log step stops without waiting another vote."""
        self._agreed = True

    def finish(self) -> bool:
        """Wait for the vote in flight, if any; its answer (False when there was none)."""
        answer, self._answer = self._answer, None
        return answer() if answer is not None else False


def hold_after_step(environ: Mapping[str, str]) -> int | None:
    """The step after which the trainers hold (``TRAINIUM_HOLD_AFTER_STEP``), or None."""
    value = environ.get(HOLD_VARIABLE, "").strip()
    if not value:
        return None
    if not value.isascii() or not value.isdigit() or int(value) < 1:
        raise ConfigError(
            f"{HOLD_VARIABLE} {value!r} is not a step: use a whole number of at least 1, "
            "or leave it unset (it holds the trainers after that step for rehearsals of faults)"
        )
    return int(value)
