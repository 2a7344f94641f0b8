"""Checkpoint saves off the training's critical path: copied at the step, written beside it.

A save used to hold every rank for the whole write (seconds for BERT-base on FSx, more for
larger models). ``CheckpointWriter.submit`` now copies what the checkpoint keeps to host
memory at the step it is taken (the model's weights and config through ``ModelSnapshot``;
the trainer state arrives as CPU copies) and writes it in a background thread with
``save_checkpoint``, unchanged: a temporary directory, every file fsynced, the rename as the
commit, then the latest K kept. So a save is complete or absent, and a crash in the middle
of a write leaves the previous checkpoint as the latest one.

- At most one save is in flight: a save waits for the one before it.
- A stop and the end of a leg wait for the save in flight (``wait``) before the job exits.
- A write that fails is reported at the next step (``check``): the job then fails with one
  line naming the checkpoint and the error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from workload import checkpoint
from workload.checkpoint import CheckpointError, ModelSnapshot, checkpoint_dir

log = logging.getLogger(__name__)


def _copy_containers(value: Any) -> Any:
    """``value`` with its dicts, lists and tuples copied (the leaves shared): what the
    trainer keeps changing in place (a scheduler's lists) stays as it was at the step."""
    if isinstance(value, Mapping):
        return {k: _copy_containers(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy_containers(v) for v in value)
    return value


class CheckpointWriter:
    """One rank's checkpoint saves, each written in a thread while training goes on."""

    def __init__(self, output: Path, tokenizer: Any, *, keep: int) -> None:
        self.output = output
        self.tokenizer = tokenizer
        self.keep = keep
        self._thread: threading.Thread | None = None
        self._error: CheckpointError | None = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, step: int, model: nn.Module, trainer_state: Mapping[str, Any]) -> None:
        """Save checkpoint ``step``: copied to host memory now, written in the background.

        ``model`` is the bare model; ``trainer_state`` holds CPU tensors that are copies
        (``to_cpu``) and plain values. Waits for the save before it first.
        """
        self.wait()
        snapshot = ModelSnapshot.of(model)
        state = _copy_containers(trainer_state)
        self._thread = threading.Thread(
            target=self._write,
            args=(step, snapshot, state),
            name=f"checkpoint step {step}",
            daemon=True,  # a job that fails does not wait for it: the previous one stays
        )
        self._thread.start()

    def _write(self, step: int, snapshot: ModelSnapshot, state: dict[str, Any]) -> None:
        try:
            # Looked up at the call: a rehearsal may wrap save_checkpoint (tests/).
            path = checkpoint.save_checkpoint(
                self.output, step, snapshot, self.tokenizer, state, keep=self.keep
            )
        except BaseException as exc:  # reported to the training loop
            reason = " ".join(str(exc).split()) or type(exc).__name__
            self._error = CheckpointError(
                f"checkpoint {checkpoint_dir(self.output, step)} could not be written "
                f"({type(exc).__name__}: {reason}); the previous checkpoint is the latest"
            )
            return
        log.info("saved %s", path)

    def check(self) -> None:
        """Raise ``CheckpointError`` if a save has failed (called at every step)."""
        if self._error is not None:
            raise self._error

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()

    def close(self) -> None:
        """On the way out of a job that failed: wait for a write in flight to end, as a
        stop would, without raising over the error already on its way."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
