"""Metrics output: JSON lines, TensorBoard, and a progress bar or periodic log lines.

``OUTPUT/metrics.jsonl`` gets one JSON object per line, each with an ``event`` key:
``train`` (step, loss, lr, samples_per_second, tokens_per_second, ...), ``eval`` (step,
eval_loss, eval_accuracy), ``resume`` (step, checkpoint) and a final ``summary``. The
same numbers go to TensorBoard under ``OUTPUT/tensorboard``. Only rank 0 writes.

Under the cluster, ``train`` and ``eval`` events also go to the file ``TRAINIUM_METRICS_FILE``
names (launch.sh sets it on every node; rank 0 writes), in the progress schema every entry
point shares (docs/job-contract.md; checked by scripts/cluster_lib/progress.py): ``step``,
``total_steps``, ``time``, ``phase`` (training, evaluating) and ``metrics`` (name -> finite
number). ``cluster.py jobs`` shows the step, the step rate, the time left and those metrics
from it. ``phase`` writes a line there alone when a phase begins (compiling, saving,
evaluating): the training log group's metric filter makes each line a datapoint of the
cluster's JobStep metric (stacks/progress_metric.py), so a long compile or save is seen as
what it is rather than as silence.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
#: The job's progress file under the cluster (launch.sh), and the phase of each event in it.
PROGRESS_VARIABLE = "TRAINIUM_METRICS_FILE"
PROGRESS_PHASES = {"train": "training", "eval": "evaluating"}


def _clean(value: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


class MetricsLogger:
    """Write metrics on the main rank; a no-op elsewhere."""

    def __init__(
        self, output: Path, *, enabled: bool, total_steps: int, initial_step: int = 0
    ) -> None:
        self.enabled = enabled
        self._file = None
        self._tensorboard: Any = None
        self._bar: Any = None
        self._progress_file: Any = None
        self.total_steps = total_steps
        if not enabled:
            return
        output.mkdir(parents=True, exist_ok=True)
        self._file = (output / METRICS_FILE).open("a", encoding="utf-8")
        progress = os.environ.get(PROGRESS_VARIABLE, "")
        if progress:
            try:
                Path(progress).parent.mkdir(parents=True, exist_ok=True)
                # Open for the logger's life, as its own file: close() closes it.
                self._progress_file = Path(progress).open("a", encoding="utf-8")  # noqa: SIM115
            except OSError as error:
                log.warning("no progress for `cluster.py jobs`: %s: %s", progress, error)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(log_dir=str(output / "tensorboard"))
        except ImportError:
            log.warning("tensorboard is not installed: no TensorBoard event files")
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True
            )

    def write(self, event: str, **fields: Any) -> None:
        """One JSON line (and TensorBoard scalars for the numeric fields)."""
        if not self.enabled or self._file is None:
            return
        record = _clean({"event": event, "time": round(time.time(), 3), **fields})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._progress_file is not None and event in PROGRESS_PHASES:
            self._write_progress(event, record)
        step = fields.get("step")
        if self._tensorboard is not None and isinstance(step, int):
            for key, value in fields.items():
                numeric = isinstance(value, int | float) and not isinstance(value, bool)
                if key != "step" and numeric and math.isfinite(value):
                    self._tensorboard.add_scalar(f"{event}/{key}", value, step)

    def phase(self, step: int, phase: str) -> None:
        """One progress line alone, without metrics: `phase` begins at `step` (compiling before
        the first steps of a run and its first evaluation, whose graphs compile on XLA; saving
        before a checkpoint; evaluating before a later evaluation)."""
        if self._progress_file is None:
            return
        line = {
            "step": step,
            "total_steps": self.total_steps,
            "time": round(time.time(), 3),
            "phase": phase,
        }
        self._progress_file.write(json.dumps(line, allow_nan=False) + "\n")
        self._progress_file.flush()

    def _write_progress(self, event: str, record: dict[str, Any]) -> None:
        """One line of the progress schema (docs/job-contract.md) from a train or eval
        record: its numeric fields (none that is null or not finite) as the metrics."""
        assert self._progress_file is not None
        metrics = {
            key: value
            for key, value in record.items()
            if key not in ("event", "time", "step")
            and isinstance(value, int | float)
            and not isinstance(value, bool)
        }
        line = {
            "step": record["step"],
            "total_steps": self.total_steps,
            "time": record["time"],
            "phase": PROGRESS_PHASES[event],
            "metrics": metrics,
        }
        self._progress_file.write(json.dumps(line, allow_nan=False) + "\n")
        self._progress_file.flush()

    def progress(self, step: int, text: str, *, keep: bool = False) -> None:
        """Advance the bar to ``step`` showing ``text`` (printed above the bar when
        ``keep``); without a terminal, log ``text``."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            if keep:
                self._bar.write(text)
            else:
                self._bar.set_postfix_str(text, refresh=False)
        else:
            log.info("%s", text)

    def advance(self, step: int) -> None:
        """Move the bar to ``step`` (every step; nothing without a terminal)."""
        if self._bar is not None:
            self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._progress_file is not None:
            self._progress_file.close()
            self._progress_file = None
