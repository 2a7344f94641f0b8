#!/usr/bin/env python3
"""What a training run costs on Trainium, side by side with GPU instances.

The run is described by its throughput and the amount of work (steps, samples, tokens, or
dataset size x epochs), by a measured wall-clock time, or by the metrics.jsonl of a real run.
Prices come from the one table of instance facts (stacks/instance_types.py, EC2 on-demand,
with the date they were taken) and can be overridden per instance type; SageMaker ``ml.*``
types share the hardware facts of their EC2 type but need their price given.

Trainium compiles the training graph before the first step. The estimate bills that compile
time on every node when the compile cache is cold and shows what a warm cache saves.

Throughput measured by ``workload/bench.py`` on one device of an instance type scales to
its nodes with ``--bench [TYPE=]bench.json`` (the trainer's samples/s per device x devices
per node x nodes: linear scaling, an upper bound that leaves out the gradient all-reduce)::

    python scripts/estimate_cost.py --instance-type trn1.32xlarge --throughput 3800 \
        --dataset-size 10000000 --tokens-per-sample 128 \
        --compare p5.48xlarge --bench p5.48xlarge=build/bench/bench.json --bench-model bert-base

Reproduce the SageMaker benchmark (BERT-base classification, one node each)::

    python scripts/estimate_cost.py --instance-type ml.trn1.32xlarge --price 24.725 \\
        --throughput 6.64 --seconds 6033 \\
        --compare ml.p4d.24xlarge=5.44 --price ml.p4d.24xlarge=37.69 \\
        --seconds ml.p4d.24xlarge=6553
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stacks.instance_types import (
    INSTANCE_TYPES,
    PRICE_REGION,
    PRICES_AS_OF,
    InstanceTypeSpec,
)

UNITS = ("it/s", "samples/s", "tokens/s")
#: The unit of work that one unit of throughput moves.
_WORK_OF_UNIT = {"it/s": "steps", "samples/s": "samples", "tokens/s": "tokens"}
SAGEMAKER_PREFIX = "ml."
DEFAULT_COMPARE = ("p4d.24xlarge", "p5.48xlarge")


class EstimateError(ValueError):
    """Input that cannot be turned into an estimate; the message is one line for the user."""


@dataclass(frozen=True)
class Work:
    """How much a run trains, in whichever unit the user knows it."""

    amount: float | None  # None: unknown (only a measured time is given)
    unit: str  # "steps", "samples" or "tokens"
    batch_size: int | None  # global samples per step
    tokens_per_sample: float | None

    def convert(self, amount: float, src: str, dst: str) -> float | None:
        """Convert between steps, samples and tokens; None where a factor is missing."""
        if src == dst:
            return amount
        samples = amount
        if src == "steps":
            if self.batch_size is None:
                return None
            samples = amount * self.batch_size
        elif src == "tokens":
            if not self.tokens_per_sample:
                return None
            samples = amount / self.tokens_per_sample
        if dst == "samples":
            return samples
        if dst == "steps":
            return None if self.batch_size is None else samples / self.batch_size
        return None if not self.tokens_per_sample else samples * self.tokens_per_sample

    @property
    def samples(self) -> float | None:
        return None if self.amount is None else self.convert(self.amount, self.unit, "samples")

    @property
    def tokens(self) -> float | None:
        return None if self.amount is None else self.convert(self.amount, self.unit, "tokens")


@dataclass(frozen=True)
class Candidate:
    """One instance type running the work: what it costs per hour and how fast it goes."""

    instance_type: str
    spec: InstanceTypeSpec
    nodes: int
    usd_per_node_hour: float
    price_overridden: bool
    throughput: float | None  # in the run's throughput unit
    seconds: float | None  # measured training time, overrides work / throughput
    compile_seconds: float  # graph compilation with a cold cache, billed on every node


@dataclass(frozen=True)
class Estimate:
    """Time and money for one candidate (JSON field names are part of the interface)."""

    instance_type: str
    accelerator: str
    nodes: int
    usd_per_node_hour: float
    price_source: str
    throughput: float | None
    throughput_unit: str
    train_seconds: float
    compile_seconds: float
    cache: str
    total_seconds: float
    instance_hours: float
    cost_usd: float
    cost_warm_cache_usd: float
    cost_cold_cache_usd: float
    warm_cache_saving_usd: float
    cost_per_million_samples_usd: float | None
    cost_per_million_tokens_usd: float | None


@dataclass(frozen=True)
class Comparison:
    """The main candidate against another instance type."""

    instance_type: str
    speedup: float | None  # throughput ratio main / other (>1: main is faster)
    time_ratio: float  # main time / other time (<1: main finishes sooner)
    cost_ratio: float  # main cost / other cost (<1: main is cheaper)
    saving_usd: float  # other cost - main cost
    break_even_throughput: float | None  # other's throughput at which both cost the same


def resolve_spec(name: str) -> InstanceTypeSpec:
    base = name.removeprefix(SAGEMAKER_PREFIX)
    if base not in INSTANCE_TYPES:
        known = ", ".join(INSTANCE_TYPES)
        raise EstimateError(
            f"unknown instance type {name!r}; known: {known} (optionally prefixed 'ml.')"
        )
    return INSTANCE_TYPES[base]


def resolve_price(name: str, overrides: dict[str, float]) -> tuple[float, bool]:
    if name in overrides:
        return overrides[name], True
    if name.startswith(SAGEMAKER_PREFIX):
        raise EstimateError(
            f"no price for {name}: the table holds EC2 on-demand prices only; "
            f"give the SageMaker price with --price {name}=USD_PER_HOUR"
        )
    price = resolve_spec(name).on_demand_usd_per_hour
    if price is None:
        raise EstimateError(
            f"no on-demand price for {name} in the table; give one with --price {name}=USD_PER_HOUR"
        )
    return price, False


def estimate(
    cand: Candidate, work: Work, unit: str, *, cache: str, train_seconds: float
) -> Estimate:
    node_hour_usd = cand.usd_per_node_hour * cand.nodes
    warm_cost = node_hour_usd * train_seconds / 3600
    cold_cost = node_hour_usd * (train_seconds + cand.compile_seconds) / 3600
    compile_billed = cand.compile_seconds if cache == "cold" else 0.0
    total = train_seconds + compile_billed
    cost = cold_cost if cache == "cold" else warm_cost
    samples, tokens = work.samples, work.tokens
    source = "override" if cand.price_overridden else f"on-demand {PRICE_REGION} {PRICES_AS_OF}"
    return Estimate(
        instance_type=cand.instance_type,
        accelerator=cand.spec.accelerator,
        nodes=cand.nodes,
        usd_per_node_hour=cand.usd_per_node_hour,
        price_source=source,
        throughput=cand.throughput,
        throughput_unit=unit,
        train_seconds=train_seconds,
        compile_seconds=compile_billed,
        cache=cache,
        total_seconds=total,
        instance_hours=cand.nodes * total / 3600,
        cost_usd=cost,
        cost_warm_cache_usd=warm_cost,
        cost_cold_cache_usd=cold_cost,
        warm_cache_saving_usd=cold_cost - warm_cost,
        cost_per_million_samples_usd=cost / samples * 1e6 if samples else None,
        cost_per_million_tokens_usd=cost / tokens * 1e6 if tokens else None,
    )


def train_seconds_for(
    cand: Candidate, work: Work, unit: str, main: tuple[Candidate, float] | None
) -> float | None:
    """Training time (compile excluded): measured; scaled from the main run's measured time
    by the throughput ratio (its overheads scale alike); or work / throughput."""
    if cand.seconds is not None:
        return cand.seconds
    if cand.throughput is None:
        return None
    if main is not None and main[0].seconds is not None and main[0].throughput:
        return main[1] * main[0].throughput / cand.throughput
    if work.amount is None:
        return None
    amount = work.convert(work.amount, work.unit, _WORK_OF_UNIT[unit])
    if amount is None:
        raise EstimateError(
            f"cannot turn {work.unit} into {_WORK_OF_UNIT[unit]} for a throughput in {unit}: "
            "give --batch-size (samples per step) and/or --tokens-per-sample"
        )
    return amount / cand.throughput


def compare(main: Estimate, main_cand: Candidate, other: Estimate, ocand: Candidate) -> Comparison:
    speedup = None
    if main_cand.throughput and ocand.throughput:
        speedup = main_cand.throughput / ocand.throughput
    return Comparison(
        instance_type=other.instance_type,
        speedup=speedup,
        time_ratio=main.total_seconds / other.total_seconds,
        cost_ratio=main.cost_usd / other.cost_usd,
        saving_usd=other.cost_usd - main.cost_usd,
        break_even_throughput=break_even(main, main_cand, ocand),
    )


def break_even(main: Estimate, main_cand: Candidate, ocand: Candidate) -> float | None:
    """The other type's throughput at which it would cost as much as the main run."""
    if not main_cand.throughput:
        return None
    other_node_hour = ocand.usd_per_node_hour * ocand.nodes
    compile_billed = ocand.compile_seconds if main.cache == "cold" else 0.0
    seconds = main.cost_usd * 3600 / other_node_hour - compile_billed
    if seconds <= 0:
        return None  # its compile time alone costs more than the main run
    return main_cand.throughput * main.train_seconds / seconds


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


# --------------------------------------------------------------------------- command line


def _keyed(values: list[str], flag: str, main: str, kind: type = float) -> dict[str, Any]:
    """Parse repeated ``[TYPE=]VALUE`` options; a bare VALUE belongs to the main type."""
    parsed: dict[str, Any] = {}
    for raw in values:
        name, sep, text = raw.rpartition("=")
        name = name if sep else main
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < 0 or (kind is int and value < 1):
            want = "a whole number >= 1" if kind is int else "a number >= 0"
            raise EstimateError(f"{flag} {raw!r}: expected [INSTANCE_TYPE=]VALUE with {want}")
        resolve_spec(name)
        parsed[name] = value
    return parsed


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


def positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="estimate_cost.py",
        description="Estimate the time and cost of a training run on Trainium and compare "
        "it with GPU instances.",
        epilog="Per-type options take [INSTANCE_TYPE=]VALUE and repeat; a bare VALUE applies "
        "to --instance-type. Prices default to the on-demand table in stacks/instance_types.py.",
    )
    p.add_argument("--instance-type", default="trn1.32xlarge", help="default: %(default)s")
    p.add_argument(
        "--nodes",
        action="append",
        default=[],
        metavar="[TYPE=]N",
        help="instances (default 1; compared types get the same unless given)",
    )
    p.add_argument("--throughput", type=positive, help="measured or expected, whole cluster")
    p.add_argument("--unit", choices=UNITS, default="samples/s", help="default: %(default)s")
    work = p.add_mutually_exclusive_group()
    work.add_argument("--steps", type=positive, help="optimizer steps to train")
    work.add_argument("--samples", type=positive, help="samples to train (all epochs)")
    work.add_argument("--tokens", type=positive, help="tokens to train (all epochs)")
    work.add_argument("--dataset-size", type=positive, help="samples per epoch")
    p.add_argument("--epochs", type=positive, default=None, help="with --dataset-size (1)")
    p.add_argument("--batch-size", type=positive_int, help="global samples per step")
    p.add_argument("--tokens-per-sample", type=positive, help="e.g. the sequence length")
    p.add_argument("--metrics", type=Path, help="metrics.jsonl of a run on --instance-type")
    p.add_argument(
        "--seconds",
        action="append",
        default=[],
        metavar="[TYPE=]S",
        help="measured training (billable) time; overrides work / throughput",
    )
    p.add_argument(
        "--compile-seconds",
        action="append",
        default=[],
        metavar="[TYPE=]S",
        help="graph compile time with a cold cache (Trainium; default 0)",
    )
    p.add_argument(
        "--cache",
        choices=("cold", "warm"),
        default="cold",
        help="compile cache state for the headline cost (default: %(default)s)",
    )
    p.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="[TYPE=]USD",
        help="price per node-hour; required for SageMaker ml.* types",
    )
    p.add_argument(
        "--compare",
        action="append",
        default=None,
        metavar="TYPE[=THROUGHPUT]",
        help="instance type to compare with, at the given throughput in --unit "
        f"(repeat; default: {', '.join(DEFAULT_COMPARE)}, break-even only)",
    )
    p.add_argument(
        "--bench",
        action="append",
        default=[],
        metavar="[TYPE=]FILE",
        help="bench.json from workload/bench.py on one device of TYPE: its trainer "
        "throughput x devices x nodes is TYPE's throughput",
    )
    p.add_argument(
        "--bench-model",
        default=None,
        help="which model of the bench.json (needed when it holds several)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


@dataclass(frozen=True)
class Report:
    unit: str
    cache: str
    prices_as_of: str
    price_region: str
    work: dict[str, float | None]
    estimates: list[Estimate]
    comparisons: list[Comparison]
    notes: list[str]


def run(args: argparse.Namespace) -> Report:
    main_type: str = args.instance_type
    spec = resolve_spec(main_type)
    prices = _keyed(args.price, "--price", main_type)
    nodes = _keyed(args.nodes, "--nodes", main_type, int)
    seconds = _keyed(args.seconds, "--seconds", main_type)
    compile_s = _keyed(args.compile_seconds, "--compile-seconds", main_type)
    notes: list[str] = []
    benches: dict[str, BenchThroughput] = {}
    for raw in args.bench:
        name, sep, text = raw.rpartition("=")
        name = name if sep else main_type
        resolve_spec(name)
        benches[name] = read_bench(Path(text), args.bench_model)

    def bench_throughput(name: str) -> float:
        bench = benches[name]
        cspec = resolve_spec(name)
        count = nodes.get(name, nodes.get(main_type, 1))
        value = bench_cluster_throughput(bench, cspec, count, unit)
        notes.append(
            f"{name}: {value:.4g} {unit} = {bench.model} trainer throughput per device from "
            f"{bench.path} (batch {bench.batch_size} x {bench.seq_len}) x {cspec.devices} "
            f"devices x {count} node(s), assuming linear scaling (no all-reduce cost)"
        )
        return value

    throughput: float | None = args.throughput
    unit: str = args.unit
    tokens_per_sample: float | None = args.tokens_per_sample
    given_work = next(
        (
            (amount, kind)
            for amount, kind in (
                (args.steps, "steps"),
                (args.samples, "samples"),
                (args.tokens, "tokens"),
                (args.dataset_size, "samples"),
            )
            if amount is not None
        ),
        None,
    )
    if args.metrics is not None:
        metrics = read_metrics(args.metrics)
        if throughput is None:
            throughput, unit = metrics.samples_per_second, "samples/s"
        if tokens_per_sample is None:
            tokens_per_sample = metrics.tokens_per_sample
        if main_type not in nodes and metrics.processes:
            per_node = spec.devices
            if metrics.processes >= per_node and metrics.processes % per_node == 0:
                nodes[main_type] = metrics.processes // per_node
        if given_work is None:
            # Without other work, the estimate is for the measured run itself.
            if main_type not in seconds and metrics.seconds:
                seconds[main_type] = metrics.seconds
                notes.append(
                    "time to train is the run's wall time from the metrics (start-up, "
                    "compilation, evaluation and checkpoints included)"
                )
                if metrics.resumed:
                    notes.append("the run resumed from a checkpoint: its time covers the last part")
            if metrics.samples and not metrics.resumed:
                given_work = (metrics.samples, "samples")
        notes.append(f"throughput {throughput:.4g} {unit} read from {args.metrics}")

    if main_type in benches:
        if throughput is not None:
            raise EstimateError(f"--bench {main_type}: give --throughput or --bench, not both")
        throughput = bench_throughput(main_type)

    if args.epochs is not None and args.dataset_size is None:
        raise EstimateError("--epochs needs --dataset-size (samples per epoch)")
    if args.dataset_size is not None:
        given_work = (args.dataset_size * (args.epochs or 1), "samples")
    amount, kind = given_work if given_work is not None else (None, "samples")
    work = Work(amount, kind, args.batch_size, tokens_per_sample)

    if throughput is None and main_type not in seconds:
        raise EstimateError(
            "give --throughput (with --steps, --samples, --tokens or --dataset-size), "
            "--seconds, or --metrics"
        )
    if work.amount is None and main_type not in seconds:
        raise EstimateError(
            "give the amount of work (--steps, --samples, --tokens or --dataset-size/--epochs) "
            "or a measured --seconds"
        )

    def candidate(name: str, thr: float | None) -> Candidate:
        cspec = resolve_spec(name)
        price, overridden = resolve_price(name, prices)
        return Candidate(
            instance_type=name,
            spec=cspec,
            nodes=nodes.get(name, nodes.get(main_type, 1)),
            usd_per_node_hour=price,
            price_overridden=overridden,
            throughput=thr,
            seconds=seconds.get(name),
            compile_seconds=compile_s.get(name, 0.0),
        )

    main = candidate(main_type, throughput)
    if spec.is_trainium and main_type not in compile_s and main_type not in seconds:
        notes.append(
            "no --compile-seconds given: unless a measured --seconds already includes it, "
            "a cold Neuron compile cache adds compile time (minutes to hours) left out here"
        )
    main_train = train_seconds_for(main, work, unit, None)
    assert main_train is not None  # guaranteed by the checks above
    main_est = estimate(main, work, unit, cache=args.cache, train_seconds=main_train)

    estimates, comparisons = [main_est], []
    for raw in args.compare if args.compare is not None else list(DEFAULT_COMPARE):
        name, sep, text = raw.partition("=")
        other_thr = positive_or_error(text, raw) if sep else None
        if name in benches:
            if other_thr is not None:
                raise EstimateError(f"--compare {raw!r}: a throughput and --bench {name}; give one")
            other_thr = bench_throughput(name)
        if name == main_type:
            raise EstimateError(f"--compare {raw!r}: compare with a different instance type")
        other = candidate(name, other_thr)
        if name.startswith(SAGEMAKER_PREFIX) != main_type.startswith(SAGEMAKER_PREFIX):
            notes.append(f"{main_type} and {name}: one is a SageMaker price, the other EC2")
        other_train = train_seconds_for(other, work, unit, (main, main_train))
        if other_train is None:
            be = break_even(main_est, main, other)
            if be is not None:
                notes.append(
                    f"{name} breaks even at {be:.4g} {unit} on {other.nodes} node(s); "
                    f"give --compare {name}=THROUGHPUT for a full comparison"
                )
            else:
                notes.append(f"{name}: give --compare {name}=THROUGHPUT or --seconds {name}=S")
            continue
        other_est = estimate(other, work, unit, cache=args.cache, train_seconds=other_train)
        estimates.append(other_est)
        comparisons.append(compare(main_est, main, other_est, other))

    return Report(
        unit=unit,
        cache=args.cache,
        prices_as_of=PRICES_AS_OF,
        price_region=PRICE_REGION,
        work={"samples": work.samples, "tokens": work.tokens},
        estimates=estimates,
        comparisons=comparisons,
        notes=notes,
    )


def positive_or_error(text: str, raw: str) -> float:
    try:
        return positive(text)
    except argparse.ArgumentTypeError:
        raise EstimateError(
            f"--compare {raw!r}: expected INSTANCE_TYPE=THROUGHPUT with a number > 0"
        ) from None


# --------------------------------------------------------------------------- output


def fmt_duration(seconds: float) -> str:
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min {secs:02d} s"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{seconds:.1f} s"


def fmt_usd(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"${value:,.2f}" if value >= 1 or value == 0 else f"${value:.3g}"


def render(report: Report) -> str:
    est = report.estimates
    rows: list[tuple[str, list[str]]] = [
        ("accelerator", [e.accelerator for e in est]),
        ("nodes", [str(e.nodes) for e in est]),
        ("price per node-hour", [f"${e.usd_per_node_hour:.3f}" for e in est]),
        ("price source", ["override" if "override" in e.price_source else "table" for e in est]),
        (
            f"throughput ({report.unit})",
            [f"{e.throughput:.4g}" if e.throughput else "n/a" for e in est],
        ),
        ("training time", [fmt_duration(e.train_seconds) for e in est]),
        (f"compile time ({report.cache} cache)", [fmt_duration(e.compile_seconds) for e in est]),
        ("time to train", [fmt_duration(e.total_seconds) for e in est]),
        ("instance-hours", [f"{e.instance_hours:.3f}" for e in est]),
        ("cost", [fmt_usd(e.cost_usd) for e in est]),
        ("cost per 1M samples", [fmt_usd(e.cost_per_million_samples_usd) for e in est]),
        ("cost per 1M tokens", [fmt_usd(e.cost_per_million_tokens_usd) for e in est]),
        ("cost, warm compile cache", [fmt_usd(e.cost_warm_cache_usd) for e in est]),
        ("warm-cache saving", [fmt_usd(e.warm_cache_saving_usd) for e in est]),
    ]
    label_w = max(len(label) for label, _ in rows)
    col_w = [
        max(len(e.instance_type), *(len(values[i]) for _, values in rows))
        for i, e in enumerate(est)
    ]
    out = [
        f"Prices: on-demand {report.price_region} as of {report.prices_as_of} unless overridden",
        "",
        " " * label_w
        + "  "
        + "  ".join(e.instance_type.rjust(w) for e, w in zip(est, col_w, strict=True)),
    ]
    for label, values in rows:
        out.append(
            label.ljust(label_w)
            + "  "
            + "  ".join(v.rjust(w) for v, w in zip(values, col_w, strict=True))
        )
    main = est[0]
    for cmp, other in zip(report.comparisons, est[1:], strict=True):
        parts = []
        if cmp.speedup is not None:
            parts.append(
                f"{_percent(cmp.speedup - 1, 'faster', 'slower')} "
                f"({main.throughput:.4g} vs {other.throughput:.4g} {report.unit})"
            )
        parts.append(f"time to train {_percent(1 - cmp.time_ratio, 'shorter', 'longer')}")
        parts.append(
            f"{_percent(1 - cmp.cost_ratio, 'cheaper', 'more expensive')} "
            f"({fmt_usd(main.cost_usd)} vs {fmt_usd(other.cost_usd)})"
        )
        out.append("")
        out.append(f"{main.instance_type} vs {other.instance_type}: " + ", ".join(parts))
        if cmp.break_even_throughput is not None:
            out.append(
                f"  {other.instance_type} would need {cmp.break_even_throughput:.4g} "
                f"{report.unit} to cost the same"
            )
    if report.notes:
        out.append("")
        out.extend(f"note: {n}" for n in report.notes)
    return "\n".join(out)


def _percent(fraction: float, up: str, down: str) -> str:
    return f"{abs(fraction) * 100:.0f}% {up if fraction >= 0 else down}"


def to_json(report: Report) -> str:
    data = asdict(report)
    return json.dumps(data, indent=2, allow_nan=False, default=str)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = run(args)
    except EstimateError as exc:
        print(f"estimate_cost.py: error: {exc}", file=sys.stderr)
        return 2
    print(to_json(report) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
