"""A job's progress from its metrics file: the schema, its validator and what `jobs` shows.

Any entry point reports progress the same way (docs/job-contract.md): global rank 0 appends
one JSON object per line to the file named by TRAINIUM_METRICS_FILE (launch.sh sets it to
the node-local `/var/log/trainium-cluster/metrics/<job-id>.jsonl`), and the CloudWatch agent
ships that folder to the stream `<instance-id>/metrics` of the training log group (bootstrap.sh
phase_monitoring). A line holds:

- `step` (required): an integer >= 0, the optimizer steps done;
- `total_steps`: an integer >= 0, or null when the job does not know it;
- `time`: unix seconds (a number) when the line was written;
- `phase`: one of compiling, training, saving, evaluating;
- `metrics`: an object of name -> finite number (loss, accuracy, anything the job likes).

No other key. `jobs` reads rank 0's last lines and shows the step of the total, the step rate,
the time left at that rate and the latest value of each metric; a line that breaks the schema
is named in one line and skipped. `python -m scripts.cluster_lib.progress FILE...` checks
files the same way (exit 1 when a line is bad), so a job's author can test their writer.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

PHASES = ("compiling", "training", "saving", "evaluating")
KEYS = ("step", "total_steps", "time", "phase", "metrics")
#: The metrics `jobs` shows on a row, the rest summed up as "+N more".
SHOWN_METRICS = 6


class SchemaError(ValueError):
    """A line that is not a progress record; the message says what is allowed."""


@dataclass(frozen=True)
class Record:
    """One valid line of a metrics file."""

    step: int
    total_steps: int | None = None
    time: float | None = None
    phase: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def parse(line: str) -> Record:
    """The record a line holds; SchemaError names what is wrong with it."""
    try:
        # json.loads takes NaN and Infinity, which are not JSON (RFC 8259): refuse them.
        data = json.loads(line, parse_constant=_refuse_constant)
    except SchemaError:
        raise
    except ValueError as error:
        raise SchemaError(f"not JSON ({error.args[0].split(':')[0]})") from None
    if not isinstance(data, dict):
        raise SchemaError(f"a {type(data).__name__}, not a JSON object")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise SchemaError(f"unknown key {unknown[0]!r}: allowed {', '.join(KEYS)}")
    if "step" not in data:
        raise SchemaError("no 'step': every line needs the step as an integer >= 0")
    step = data["step"]
    if not _is_int(step) or step < 0:
        raise SchemaError(f"'step' is {step!r}: use an integer >= 0")
    total = data.get("total_steps")
    if total is not None and (not _is_int(total) or total < 0):
        raise SchemaError(f"'total_steps' is {total!r}: use an integer >= 0 or null")
    when = data.get("time")
    if when is not None and not _is_number(when):
        raise SchemaError(f"'time' is {when!r}: use unix seconds (a number)")
    phase = data.get("phase")
    if phase is not None and phase not in PHASES:
        raise SchemaError(f"'phase' is {phase!r}: use one of {', '.join(PHASES)}")
    metrics = data.get("metrics", {})
    if not isinstance(metrics, dict):
        raise SchemaError(f"'metrics' is {metrics!r}: use an object of name -> number")
    for name, value in metrics.items():
        if not _is_number(value):
            raise SchemaError(f"metric {name!r} is {value!r}: use a finite number")
    return Record(step, total, None if when is None else float(when), phase, dict(metrics))


def _refuse_constant(name: str) -> float:
    raise SchemaError(f"{name} is not JSON: use a finite number or leave the metric out")


def read(lines: Iterable[str], where: str = "line") -> tuple[list[Record], list[str]]:
    """The valid records among `lines`, and one line for each bad one (`<where> N: why`);
    empty lines are skipped."""
    records: list[Record] = []
    errors: list[str] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(parse(line))
        except SchemaError as error:
            errors.append(f"{where} {number}: {error}; skipped")
    return records, errors


@dataclass(frozen=True)
class Progress:
    """What `jobs` shows of a job's progress; "-" where the records cannot tell."""

    step: str = "-"
    rate: str = "-"
    eta: str = "-"
    metrics: str = "-"


def duration(seconds: float) -> str:
    """Seconds as `jobs` shows them: 3m07s, 2h05m, 1d04h."""
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{seconds:02d}s"


def summarize(records: list[Record]) -> Progress:
    """The latest step of the total, the step rate over the records' last run of rising steps
    (a retry resumes from an earlier checkpoint: steps before it do not count; compiling lines
    neither), the time left
    at that rate, and the newest value of each metric."""
    if not records:
        return Progress()
    last = records[-1]
    total = next((r.total_steps for r in reversed(records) if r.total_steps is not None), None)
    step = f"{last.step}/{total}" if total is not None else str(last.step)
    run = [last]
    for record in reversed(records[:-1]):
        if record.step > run[-1].step:
            break
        run.append(record)
    # A compiling line starts a run (the trainer writes one before its first steps): the time
    # spent compiling is not the step rate.
    timed = [r for r in run if r.time is not None and r.phase != "compiling"]
    rate = eta = "-"
    if len(timed) >= 2:
        steps = timed[0].step - timed[-1].step
        seconds = (timed[0].time or 0.0) - (timed[-1].time or 0.0)
        if steps > 0 and seconds > 0:
            per_second = steps / seconds
            rate = f"{per_second:.3g}/s"
            if total is not None:
                eta = duration((total - last.step) / per_second) if total > last.step else "done"
    if total is not None and last.step >= total:
        eta = "done"
    latest: dict[str, float] = {}
    for record in records:
        latest.update(record.metrics)
    names = sorted(latest)
    shown = [f"{name}={latest[name]:.4g}" for name in names[:SHOWN_METRICS]]
    if len(names) > SHOWN_METRICS:
        shown.append(f"+{len(names) - SHOWN_METRICS} more")
    return Progress(step, rate, eta, " ".join(shown) or "-")


def main(argv: list[str] | None = None) -> int:
    """Checks metrics files: each bad line in one line on stderr; 1 when any is bad."""
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m scripts.cluster_lib.progress METRICS.jsonl...", file=sys.stderr)
        return 2
    bad = 0
    for name in paths:
        path = Path(name)
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as error:
            print(f"{name}: cannot read it ({error.strerror})", file=sys.stderr)
            return 2
        records, errors = read(text.splitlines(), f"{name}: line")
        for problem in errors:
            print(problem, file=sys.stderr)
        bad += len(errors)
        print(f"{name}: {len(records)} valid lines, {len(errors)} bad")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
