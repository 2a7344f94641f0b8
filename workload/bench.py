#!/usr/bin/env python3
"""Throughput benchmark: the trainer's own training step against plain baselines.

Times ``engine.TrainStep`` (exactly the step ``train.py`` runs) on synthetic fixed-shape
batches, and in the same process, on the same device, with the same model and batch:

- ``plain``: the textbook PyTorch loop (forward, ``loss.backward()``, ``optimizer.step()``,
  linear schedule, ``zero_grad()``; fp32, ``torch.optim.AdamW`` defaults), and
- ``hf-trainer``: the Hugging Face ``Trainer`` (needs ``accelerate``; skipped, with the
  reason, where it is missing, and on XLA, where Trainium uses optimum-neuron's trainer).

Paths run in interleaved rounds (A B C, B C A, ...) so that drift on a shared machine hits
them alike. Warm-up steps (and the graph compilations they trigger: XLA graphs,
``torch.compile`` graphs) are timed separately and left out of the throughput. Each round
is one block of ``--steps`` steps timed from a finished device to a finished device: the
host never waits for the device inside a block, so the throughput is the asynchronous one
the trainer gets (the host queues the next step while the device runs this one).
Models are built from configs, never downloaded::

    python workload/bench.py --model tiny --model bert-base --output build/bench

Writes ``bench.json`` and ``bench.png`` (throughput per configuration) into ``--output``
and prints a table, plus the same table in Markdown for the README.

The command line is this file; the rest is split by concern:

- ``bench_paths``: the paths (``Runner`` and the three above) and ``PATHS``, their registry;
- ``bench_rounds``: one model's run: config, synthetic batches, warm-up, interleaved rounds;
- ``bench_device``: what the device reports per segment (memory, compilations, graphs);
- ``bench_stats``: ``PathResult``, the statistics over timed blocks, the kernel profile;
- ``bench_report``: the text and Markdown tables and the plot.

To add a path: in ``workload/bench_paths.py``, write a function that builds its ``Runner``
from ``PathInputs`` and a fresh model (a ``StepRunner`` around a step function, as
``plain_runner`` does, or a ``Runner`` subclass whose ``run`` times a block of the
framework's own loop, as ``HfTrainerRunner`` does) and add it to ``PATHS`` with the reason
it cannot run where that applies. ``--paths``, the rounds, the statistics, the tables,
bench.json and the plot take it from there (its bar is grey unless ``bench_report.plot``
gives it a colour). The trainer's ratio against it needs a ``ratio_vs_...`` field in
``bench_stats.PathResult`` and an entry in the ratios at the end of
``bench_rounds.bench_model``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, NoReturn

if __package__ in (None, ""):  # run as a script: make the ``workload`` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from workload.backend import DEVICE_CHOICES, PRECISION_CHOICES, BackendError, setup_backend
from workload.bench_device import machine_info, process_peak_memory
from workload.bench_paths import PATHS
from workload.bench_report import plot, render_markdown, render_text
from workload.bench_rounds import MODEL_SIZES, BenchError, BenchOptions, bench_model
from workload.bench_stats import PathResult
from workload.config import COMPILE


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _paths(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PATHS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a comma-separated list of {', '.join(PATHS)}"
        )
    return list(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="bench.py",
        description="Time the trainer's training step against a plain PyTorch loop and the "
        "Hugging Face Trainer on synthetic batches.",
    )
    p.add_argument(
        "--model",
        action="append",
        choices=tuple(MODEL_SIZES),
        default=None,
        help="model size (repeat for several; default: tiny)",
    )
    p.add_argument(
        "--task",
        choices=("classification", "causal-lm"),
        default=None,
        help="tiny only: BERT classification (default) or GPT-2 causal-lm",
    )
    p.add_argument("--batch-size", type=_positive_int, default=8, help="default: %(default)s")
    p.add_argument("--seq-len", type=_positive_int, default=128, help="default: %(default)s")
    p.add_argument("--steps", type=_positive_int, default=5, help="timed steps per round")
    p.add_argument("--warmup", type=_non_negative_int, default=3, help="untimed steps first")
    p.add_argument("--rounds", type=_positive_int, default=6, help="interleaved rounds")
    p.add_argument(
        "--paths",
        type=_paths,
        default=list(PATHS),
        help=f"what to time (default: {','.join(PATHS)})",
    )
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    p.add_argument(
        "--precision",
        choices=PRECISION_CHOICES,
        default="auto",
        help="trainer and HF Trainer (auto: bf16 on GPU/Neuron, fp32 on CPU)",
    )
    p.add_argument(
        "--compile",
        choices=COMPILE,
        default="auto",
        help="torch.compile the trainer's forward (auto: the trainer's choice)",
    )
    p.add_argument(
        "--peak-tflops", type=float, default=0.0, help="per-device peak for MFU (0: built-in table)"
    )
    p.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch CPU threads (default: torch's choice)",
    )
    p.add_argument(
        "--fill",
        type=_fraction,
        default=1.0,
        help="shortest example as a fraction of --seq-len; the rest pads (default: 1, no padding)",
    )
    p.add_argument(
        "--profile-steps",
        type=_non_negative_int,
        default=0,
        help="after timing, profile this many steps of each path (default: 0, off)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=Path("build/bench"), help="default: %(default)s")
    return p


def bench_options(args: argparse.Namespace) -> BenchOptions:
    """The parsed command line as the benchmark's typed options (same names as the flags)."""
    values = {f.name: getattr(args, f.name) for f in fields(BenchOptions)}
    return BenchOptions(**values | {"paths": tuple(args.paths)})


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = args.model or ["tiny"]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.task and sizes != ["tiny"]:
        raise BenchError("--task applies to --model tiny only")
    try:
        backend = setup_backend(args.device, args.precision)
    except BackendError as exc:
        raise BenchError(str(exc)) from None
    # setup_backend keeps torch-xla out of a cpu or cuda run (USE_TORCH_XLA=0), so the
    # Trainer baseline stays on the device the benchmark runs on.
    try:
        if backend.world_size > 1:
            raise BenchError("run the benchmark as one process (not under torchrun)")
        if args.compile == "on" and backend.kind == "xla":
            raise BenchError("--compile on: XLA compiles the whole graph already; use auto/off")
        args.output.mkdir(parents=True, exist_ok=True)
        results: list[PathResult] = []
        options = bench_options(args)
        with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
            for size in sizes:
                results.extend(bench_model(size, options, backend, Path(tmp)))
        memory, memory_kind = process_peak_memory(backend)
        report: dict[str, Any] = {
            "machine": machine_info(backend),
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "fill": args.fill,
            "timing": "one device wait before and after each block of --steps steps",
            "steps": args.steps,
            "warmup": args.warmup,
            "rounds": args.rounds,
            "compile": args.compile,
            "process_peak_memory_bytes": memory if backend.kind != "cuda" else None,
            "process_peak_memory_kind": memory_kind,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "results": [asdict(r) for r in results],
        }
        plot_error = plot(results, backend.description, args.output / "bench.png")
        report["plot"] = None if plot_error else "bench.png"
        if plot_error:
            report["plot_skipped"] = plot_error
        (args.output / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
        print(render_text(report, results))
        print("\nMarkdown:\n" + render_markdown(results))
        print(f"\nwrote {args.output / 'bench.json'}" + ("" if plot_error else " and bench.png"))
        return report
    finally:
        backend.close()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except BenchError as exc:
        print(f"bench.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
