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

This file is the command line; the model, the readers of measured inputs and the rendering
are in ``scripts/cost_lib``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

if __package__ in (None, ""):  # run as a script: make ``scripts`` and ``stacks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.cost_lib import EstimateError
from scripts.cost_lib.checkpoints import plan
from scripts.cost_lib.inputs import (
    BenchThroughput,
    bench_cluster_throughput,
    read_bench,
    read_metrics,
)
from scripts.cost_lib.interruptions import LLAMA3_RATE_PER_NODE_HOUR, RATE_SOURCE
from scripts.cost_lib.model import (
    SAGEMAKER_PREFIX,
    UNITS,
    Candidate,
    Report,
    Work,
    break_even,
    compare,
    estimate,
    resolve_price,
    resolve_spec,
    train_seconds_for,
)
from scripts.cost_lib.render import render, to_json
from scripts.cost_lib.spares import (
    REPLACEMENT_SECONDS,
    SUPERVISOR_RETRY_SECONDS,
    SpareEstimate,
    estimate_spares,
    render_spares,
)
from stacks.instance_types import PRICE_REGION, PRICES_AS_OF

DEFAULT_COMPARE = ("p4d.24xlarge", "p5.48xlarge")


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
    p.add_argument(
        "--checkpoint-save-seconds",
        type=positive,
        metavar="S",
        help="how long one checkpoint save takes: shows the interval that loses the least "
        "work to interruptions (Young/Daly) for the main type's nodes",
    )
    p.add_argument(
        "--checkpoint-every-seconds",
        type=positive,
        metavar="S",
        help="the job's own interval (training seconds between saves): what an interruption "
        "costs at it",
    )
    p.add_argument(
        "--interruptions-per-node-hour",
        type=positive,
        metavar="RATE",
        help="interruptions (node deaths) per node-hour, for the checkpoint interval and the "
        f"spares (default {LLAMA3_RATE_PER_NODE_HOUR:.3g}: {RATE_SOURCE})",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_spare_options(p)
    return p


def add_spare_options(p: argparse.ArgumentParser) -> None:
    """Warm spares (the cluster's spare_nodes) against the time they save (cost_lib/spares.py)."""
    g = p.add_argument_group("warm spares")
    g.add_argument(
        "--spare-nodes",
        type=positive_int,
        help="spares beside --nodes: compare their cost with the waiting they save",
    )
    g.add_argument(
        "--replacement-seconds",
        type=positive,
        default=REPLACEMENT_SECONDS,
        help="a replacement's EC2 launch and bootstrap (default %(default)g: 26 s launch and "
        "the 45-minute bootstrap lifecycle timeout)",
    )
    g.add_argument(
        "--supervisor-retry-seconds",
        type=positive,
        default=SUPERVISOR_RETRY_SECONDS,
        help="the supervisor's 2P + G + R before a retry (default %(default)g: its defaults)",
    )


def spares_for(args: argparse.Namespace, report: Report) -> SpareEstimate | None:
    """The spares' estimate for the main candidate, or None without --spare-nodes."""
    if args.spare_nodes is None:
        return None
    main = report.estimates[0]
    rate = args.interruptions_per_node_hour
    return estimate_spares(
        nodes=main.nodes,
        spare_nodes=args.spare_nodes,
        usd_per_node_hour=main.usd_per_node_hour,
        train_seconds=main.total_seconds,
        rate_per_node_hour=rate if rate is not None else LLAMA3_RATE_PER_NODE_HOUR,
        rate_source="given" if rate is not None else RATE_SOURCE,
        replacement_seconds=args.replacement_seconds,
        supervisor_retry_seconds=args.supervisor_retry_seconds,
    )


def run(args: argparse.Namespace) -> Report:
    main_type: str = args.instance_type
    spec = resolve_spec(main_type)
    if args.checkpoint_save_seconds is None and args.checkpoint_every_seconds is not None:
        raise EstimateError(
            "--checkpoint-every-seconds needs --checkpoint-save-seconds (how long a save takes)"
        )
    if (
        args.interruptions_per_node_hour is not None
        and args.checkpoint_save_seconds is None
        and args.spare_nodes is None
    ):
        raise EstimateError(
            "--interruptions-per-node-hour needs --checkpoint-save-seconds (how long a save "
            "takes) or --spare-nodes (what spares save)"
        )
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

    checkpoint_plan = None
    if args.checkpoint_save_seconds is not None:
        checkpoint_plan = plan(
            nodes=main.nodes,
            save_seconds=args.checkpoint_save_seconds,
            run_seconds=main_est.total_seconds,
            interval_seconds=args.checkpoint_every_seconds,
            per_node_hour=args.interruptions_per_node_hour,
        )
    return Report(
        unit=unit,
        cache=args.cache,
        prices_as_of=PRICES_AS_OF,
        price_region=PRICE_REGION,
        work={"samples": work.samples, "tokens": work.tokens},
        estimates=estimates,
        comparisons=comparisons,
        notes=notes,
        checkpoints=checkpoint_plan,
    )


def positive_or_error(text: str, raw: str) -> float:
    try:
        return positive(text)
    except argparse.ArgumentTypeError:
        raise EstimateError(
            f"--compare {raw!r}: expected INSTANCE_TYPE=THROUGHPUT with a number > 0"
        ) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = run(args)
        spares = spares_for(args, report)
    except EstimateError as exc:
        print(f"estimate_cost.py: error: {exc}", file=sys.stderr)
        return 2
    if spares is None:
        print(to_json(report) if args.json else render(report))
    elif args.json:
        print(json.dumps({**json.loads(to_json(report)), "spares": asdict(spares)}, indent=2))
    else:
        print("\n".join([render(report), *render_spares(spares)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
