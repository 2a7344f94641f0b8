"""What was measured elsewhere, read for the cost model: the throughput, time and samples
of a training run (its metrics.jsonl, written by workload/train.py) and the trainer's
per-device throughput from a benchmark (its bench.json, written by workload/bench.py),
scaled to the devices and nodes of an instance type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.cost_lib import EstimateError
from stacks.instance_types import InstanceTypeSpec

# --------------------------------------------------------------------------- metrics.jsonl


@dataclass(frozen=True)
class RunMetrics:
    """What workload/train.py's metrics.jsonl says about a job."""

    samples_per_second: float  # whole job, after warm-up
    tokens_per_sample: float | None
    seconds: float | None  # wall time of the run: start-up, compilation, evaluation included
    samples: float | None  # samples trained (all processes)
    processes: int | None  # world size
    resumed: bool


def _number(record: dict[str, Any], key: str) -> float | None:
    value = record.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return float(value)
    return None


def _positive_numbers(*values: Any) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in values)


def read_metrics(path: Path) -> RunMetrics:
    """Throughput, time and samples from the "summary" line (or, for a job still running,
    the "train" lines) of the trainer's metrics."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise EstimateError(f"cannot read metrics file {path}: {exc.strerror}") from None
    train: list[dict[str, Any]] = []
    summary: dict[str, Any] | None = None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise EstimateError(f"{path}:{number}: not a JSON line") from None
        if not isinstance(record, dict):
            raise EstimateError(f"{path}:{number}: expected a JSON object")
        if record.get("event") == "train":
            train.append(record)
        elif record.get("event") == "summary":
            summary = record
    if summary is not None and _number(summary, "mean_samples_per_second"):
        steps, batch = _number(summary, "step"), _number(summary, "batch_size")
        world = _number(summary, "world_size")
        samples = steps * batch * world if steps and batch and world else None
        return RunMetrics(
            samples_per_second=_number(summary, "mean_samples_per_second") or 0.0,
            tokens_per_sample=_number(summary, "max_length"),
            seconds=_number(summary, "total_time_s"),
            samples=samples,
            processes=int(world) if world else None,
            resumed=bool(summary.get("resumed_from")),
        )
    # A job still running: the mean of its logged rates, leaving out the first interval,
    # which holds the warm-up (and, on XLA, the graph compilations).
    rates = [r for r in (_number(t, "samples_per_second") for t in train) if r]
    if not rates:
        raise EstimateError(
            f"{path}: no 'summary' or 'train' line with a throughput; "
            "give a metrics.jsonl written by workload/train.py"
        )
    rates = rates[1:] or rates
    per_sample = [
        t["tokens_per_second"] / t["samples_per_second"]
        for t in train
        if _positive_numbers(t.get("samples_per_second"), t.get("tokens_per_second"))
    ]
    return RunMetrics(
        samples_per_second=sum(rates) / len(rates),
        tokens_per_sample=round(per_sample[-1]) if per_sample else None,
        seconds=None,
        samples=None,
        processes=None,
        resumed=False,
    )


# --------------------------------------------------------------------------- bench.json


#: bench.json's device key (workload/engine.py PEAK_TFLOPS_BF16) -> InstanceTypeSpec.accelerator.
_BENCH_ACCELERATOR = {
    "trn1": "trainium",
    "trn2": "trainium2",
    "a100": "a100",
    "h100": "h100",
    "h200": "h200",
}


@dataclass(frozen=True)
class BenchThroughput:
    """The trainer's measured throughput on one device, from a bench.json."""

    path: Path
    model: str
    device: str
    samples_per_second: float
    tokens_per_second: float
    batch_size: int
    seq_len: int


def read_bench(path: Path, model: str | None) -> BenchThroughput:
    """The ``trainer`` row of ``model`` in a bench.json written by workload/bench.py."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        rows = [r for r in report["results"] if r["path"] == "trainer" and r["status"] == "ok"]
        machine = report["machine"]
    except OSError as exc:
        raise EstimateError(f"--bench {path}: cannot read it ({exc.strerror})") from None
    except (ValueError, KeyError, TypeError):
        raise EstimateError(
            f"--bench {path}: not a bench.json written by workload/bench.py"
        ) from None
    models = sorted({r["model"] for r in rows})
    if model is None and len(models) == 1:
        model = models[0]
    chosen = [r for r in rows if r["model"] == model]
    if not chosen or not chosen[0].get("samples_per_second"):
        raise EstimateError(
            f"--bench {path}: "
            + (f"no trainer result for --bench-model {model}" if model else "several models")
            + f"; choose --bench-model from: {', '.join(models) or '(none)'}"
        )
    row = chosen[0]
    return BenchThroughput(
        path=path,
        model=str(model),
        device=str(machine.get("peak_source") or machine.get("device_kind") or "unknown"),
        samples_per_second=float(row["samples_per_second"]),
        tokens_per_second=float(row["tokens_per_second"]),
        batch_size=int(report["batch_size"]),
        seq_len=int(report["seq_len"]),
    )


def bench_cluster_throughput(
    bench: BenchThroughput, spec: InstanceTypeSpec, nodes: int, unit: str
) -> float:
    """Per-device throughput x devices per node x nodes, in ``unit``."""
    wanted = _BENCH_ACCELERATOR.get(bench.device)
    if wanted != spec.accelerator:
        raise EstimateError(
            f"--bench {bench.path} was measured on {bench.device}, but {spec.name} has "
            f"{spec.accelerator} devices"
        )
    if unit == "samples/s":
        per_device = bench.samples_per_second
    elif unit == "tokens/s":
        per_device = bench.tokens_per_second
    else:
        raise EstimateError(
            f"--bench gives samples/s or tokens/s, not {unit}: use --unit samples/s or tokens/s"
        )
    return per_device * spec.devices * nodes
