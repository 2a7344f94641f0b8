"""One or two graphs per XLA training step: measure both, interleaved, on this device.

``PJRT_DEVICE=CPU python workload/step_graphs.py [--hidden 128] [--layers 2] [--seq 64]
[--batch 16] [--rounds 20] [--block 10]`` (or under ``torchrun`` on a Trainium node, where
the gradient all-reduce is real). It builds a BERT classifier from a config, one
``engine.TrainStep`` per variant sharing the model and optimizer, compiles every graph, then
times blocks of ``--block`` steps, alternating the variants (ABAB, then BABA) so that a
machine whose load drifts penalises neither. Prints one JSON line: graphs launched and host
transfers per step, compilations after warm-up, and the median and p10/p90 step time of each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from workload.backend import setup_backend
from workload.engine import GRAPHS_PER_STEP, TrainStep, build_optimizer, build_scheduler


def _metric_count(name: str) -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    return int(data[0]) if data else 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    from transformers import BertConfig, BertForSequenceClassification

    backend = setup_backend("xla", args.precision)
    torch.manual_seed(0)
    # A keyword dict: BertConfig takes attn_implementation through **kwargs.
    settings: dict[str, Any] = {
        "vocab_size": 2000,
        "hidden_size": args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 4,
        "intermediate_size": 4 * args.hidden,
        "max_position_embeddings": max(512, args.seq),
        "num_labels": 2,
        "attn_implementation": "eager",
    }
    model: Any = BertForSequenceClassification(BertConfig(**settings))
    model = model.to(backend.device)
    optimizer = build_optimizer(model, 1e-4, 0.01)
    scheduler = build_scheduler(optimizer, 10, 1_000_000)
    steps = {
        g: TrainStep(model, optimizer, scheduler, backend, graphs_per_step=g)
        for g in GRAPHS_PER_STEP
    }
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        mask = torch.ones(args.batch, args.seq, dtype=torch.long)
        mask[: args.batch // 2, args.seq // 2 :] = 0  # half the rows padded
        batch = {
            "input_ids": torch.randint(5, 2000, (args.batch, args.seq), generator=generator),
            "attention_mask": mask,
            "token_type_ids": torch.zeros(args.batch, args.seq, dtype=torch.long),
            "labels": torch.randint(0, 2, (args.batch,), generator=generator),
        }
        batches.append({k: v.to(backend.device) for k, v in batch.items()})

    for graphs in (*GRAPHS_PER_STEP, *GRAPHS_PER_STEP):  # warm-up: every graph compiled
        for i in range(3):
            steps[graphs](batches[i % 4])
    xm.wait_device_ops()
    warm_compiles = int(met.counter_value("UncachedCompile") or 0)
    times: dict[int, list[float]] = {g: [] for g in GRAPHS_PER_STEP}
    launched = dict.fromkeys(GRAPHS_PER_STEP, 0)
    transfers = dict.fromkeys(GRAPHS_PER_STEP, 0)
    for round_ in range(args.rounds):
        order = GRAPHS_PER_STEP if round_ % 2 == 0 else tuple(reversed(GRAPHS_PER_STEP))
        for graphs in order:
            graphs_before = _metric_count("TensorsGraphSize")
            transfers_before = _metric_count("TransferFromDeviceTime")
            start = time.perf_counter()
            for i in range(args.block):
                steps[graphs](batches[i % 4])
            xm.wait_device_ops()
            times[graphs].append((time.perf_counter() - start) * 1000 / args.block)
            launched[graphs] += _metric_count("TensorsGraphSize") - graphs_before
            transfers[graphs] += _metric_count("TransferFromDeviceTime") - transfers_before
    total = args.rounds * args.block
    result: dict[str, Any] = {
        "device": backend.description,
        "world_size": backend.world_size,
        "model": f"BERT hidden {args.hidden}, {args.layers} layers, seq {args.seq}, "
        f"batch {args.batch}, {backend.precision}",
        "compiles_after_warmup": int(met.counter_value("UncachedCompile") or 0) - warm_compiles,
    }
    for graphs in GRAPHS_PER_STEP:
        ordered = sorted(times[graphs])
        result[f"graphs_per_step={graphs}"] = {
            "launched_per_step": launched[graphs] / total,
            "host_transfers_per_step": transfers[graphs] / total,
            "median_ms": round(statistics.median(ordered), 2),
            "p10_ms": round(ordered[len(ordered) // 10], 2),
            "p90_ms": round(ordered[(9 * len(ordered)) // 10], 2),
        }
    backend.close()
    return result


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2
        self.exit(2, f"step_graphs.py: error: {message} (--help lists the flags)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="step_graphs.py", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (default 128)")
    parser.add_argument("--layers", type=int, default=2, help="layers (default 2)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per example (default 64)")
    parser.add_argument("--batch", type=int, default=16, help="examples per step (default 16)")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (default 20)")
    parser.add_argument("--block", type=int, default=10, help="steps per block (default 10)")
    parser.add_argument(
        "--precision", default="auto", choices=("auto", "bf16", "fp32"), help="default auto"
    )
    args = parser.parse_args(argv)
    for name in ("hidden", "layers", "seq", "batch", "rounds", "block"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)} must be at least 1")
    if args.hidden % 4:
        parser.error(f"--hidden {args.hidden} must be a multiple of 4 (4 attention heads)")
    print(json.dumps(measure(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
