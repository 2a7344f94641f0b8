"""One model's benchmark: its training configuration and synthetic batches, every path built
from the same weights, warm-up, then timed blocks in interleaved rounds (A B C, B C A, ...),
an optional profile, and the statistics and ratios of each path.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workload.backend import Backend
from workload.bench_device import DeviceMeter
from workload.bench_paths import PATHS, Batch, PathInputs, Runner
from workload.bench_stats import PathResult, profile_runner, summarize
from workload.config import ConfigError, TrainConfig
from workload.engine import flops_per_sample, peak_flops_per_device
from workload.model import ModelError, build_model, train_tiny_tokenizer

log = logging.getLogger("bench")

#: Model sizes: the trainer's ``tiny`` builder at the standard architectures' dimensions
#: and dropout (BERT-base: 110M parameters; GPT-2 small: 124M), so nothing is downloaded.
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "bert-base": {
        "task": "classification",
        "tiny_hidden_size": 768,
        "tiny_layers": 12,
        "tiny_heads": 12,
        "tiny_vocab_size": 30522,
        "dropout": 0.1,
    },
    "gpt2": {
        "task": "causal-lm",
        "tiny_hidden_size": 768,
        "tiny_layers": 12,
        "tiny_heads": 12,
        "tiny_vocab_size": 50257,
        "dropout": 0.1,
    },
}
#: Text to train the throw-away tokenizer on (the model only needs its special-token ids).
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a benchmark measures how many samples a training step processes per second",
] * 8


class BenchError(ValueError):
    """Bad input or an unusable environment; the message is one line for the user."""


@dataclass(frozen=True)
class BenchOptions:
    """What to time and how, as the command line gives it."""

    paths: tuple[str, ...]  # names in PATHS, in the order they are reported
    batch_size: int
    seq_len: int
    task: str | None  # --model tiny only; the other sizes fix their task
    compile: str  # the trainer's torch.compile choice: auto, on or off
    seed: int
    fill: float  # shortest example as a fraction of seq_len
    warmup: int  # untimed steps of each path first
    steps: int  # timed steps per block (one block per path and round)
    rounds: int
    profile_steps: int  # 0: no profile
    peak_tflops: float  # per-device peak for MFU; 0: the built-in table
    output: Path  # where the profiles are written


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:limit]


def train_config(options: BenchOptions, size: str, output: Path) -> TrainConfig:
    """The trainer's configuration of model ``size`` at the benchmark's batch shape."""
    overrides = dict(MODEL_SIZES[size])
    task = overrides.pop("task", None) or options.task or "classification"
    if options.task and options.task != task:
        raise BenchError(f"--model {size} trains {task}; --task {options.task} is for --model tiny")
    try:
        return TrainConfig(
            data="synthetic",
            output=str(output),
            model="tiny",
            task=task,
            batch_size=options.batch_size,
            max_length=options.seq_len,
            seed=options.seed,
            compile=options.compile,
            **overrides,
        )
    except ConfigError as exc:
        raise BenchError(str(exc)) from None


def synthetic_batches(
    config: TrainConfig,
    vocab_size: int,
    num_labels: int,
    count: int,
    *,
    fill: float = 1.0,
    pad_id: int = 0,
) -> list[Batch]:
    """``count`` fixed-shape batches of random tokens, as the trainer's data loader gives.

    ``fill`` < 1 pads them as real text does: each example's length is drawn uniformly
    from ``ceil(fill * max_length)`` to ``max_length``; the rest is padding (``pad_id``,
    attention mask 0, no loss on it).
    """
    gen = torch.Generator().manual_seed(config.seed)
    shape = (config.batch_size, config.max_length)
    shortest = min(config.max_length, max(2, math.ceil(fill * config.max_length)))
    positions = torch.arange(config.max_length)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, vocab_size, shape, generator=gen)
        lengths = torch.randint(shortest, config.max_length + 1, (shape[0],), generator=gen)
        mask = (positions[None, :] < lengths[:, None]).long()
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad_id))
        batch = {"input_ids": ids, "attention_mask": mask}
        if config.task == "classification":
            batch["token_type_ids"] = torch.zeros_like(ids)
            batch["labels"] = torch.randint(0, num_labels, (shape[0],), generator=gen)
        else:
            batch["labels"] = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        batches.append(batch)
    return batches


def useful_tokens_per_sample(batches: list[Batch]) -> float:
    """Mean non-padding positions per example over ``batches``."""
    masks = torch.cat([b["attention_mask"] for b in batches])
    return float(masks.sum()) / masks.shape[0]


def bench_model(
    size: str, options: BenchOptions, backend: Backend, output: Path
) -> list[PathResult]:
    """Time every path of ``options.paths`` on model ``size``; ``output`` is scratch space.
    A path that cannot run here is reported as skipped, with the reason."""
    config = train_config(options, size, output)
    tokenizer = train_tiny_tokenizer(_CORPUS, config.task, vocab_size=200)

    def fresh_model() -> nn.Module:
        backend.seed(config.seed)  # every path starts from the same weights
        try:
            return build_model(config, tokenizer, xla=backend.kind == "xla")
        except ModelError as exc:
            raise BenchError(str(exc)) from None

    probe = fresh_model()
    model_config: Any = probe.config
    vocab = int(model_config.vocab_size)
    num_labels = int(getattr(model_config, "num_labels", 2))
    flops = flops_per_sample(probe, config.max_length)
    params = sum(p.numel() for p in probe.parameters())
    del probe
    batches = synthetic_batches(
        config, vocab, num_labels, count=4, fill=options.fill, pad_id=int(tokenizer.pad_token_id)
    )
    useful = useful_tokens_per_sample(batches)
    total_steps = options.warmup + options.rounds * options.steps
    log.info(
        "%s: %.1fM parameters, %s, batch %d x %d tokens",
        size,
        params / 1e6,
        config.task,
        config.batch_size,
        config.max_length,
    )

    runners: list[Runner] = []
    results: dict[str, PathResult] = {}
    for name in options.paths:
        result = PathResult(model=size, path=name, status="ok")
        results[name] = result
        path = PATHS[name]
        reason = path.unavailable(backend)
        if reason:
            result.status, result.reason = "skipped", reason
            continue
        inputs = PathInputs(backend, config, batches, total_steps, workdir=output / name)
        runners.append(path.build(inputs, fresh_model()))

    try:
        blocks, peaks = measure(runners, results, options, backend, size)
        if options.profile_steps:
            for runner in runners:
                name = f"profile-{size}-{runner.name}.txt"
                summary = profile_runner(runner, options.profile_steps, options.output / name)
                results[runner.name].profile = summary
                log.info("%s/%s: profile %s", size, runner.name, json.dumps(summary))
    except torch.OutOfMemoryError as exc:
        raise BenchError(
            f"--model {size} at batch {config.batch_size} x {config.max_length} does not fit "
            f"in device memory ({_first_line(str(exc), 120)}); use a smaller --batch-size"
        ) from None
    peak_flops = peak_flops_per_device(backend, options.peak_tflops or None)
    for runner in runners:
        result = results[runner.name]
        summarize(result, blocks[runner.name], config.batch_size, config.max_length, useful)
        if backend.kind == "cuda":
            result.peak_memory_bytes = int(peaks[runner.name])
        if result.samples_per_second:
            result.model_tflops = result.samples_per_second * flops / 1e12
            if peak_flops:
                result.mfu = result.samples_per_second * flops / peak_flops
    ours = results.get("trainer")
    if ours and ours.samples_per_second:
        for other, attr in (("plain", "ratio_vs_plain"), ("hf-trainer", "ratio_vs_hf_trainer")):
            base = results.get(other)
            if base and base.samples_per_second:
                setattr(ours, attr, ours.samples_per_second / base.samples_per_second)
    return [results[name] for name in options.paths]


def measure(
    runners: list[Runner],
    results: dict[str, PathResult],
    options: BenchOptions,
    backend: Backend,
    size: str,
) -> tuple[dict[str, list[tuple[float, int]]], dict[str, float]]:
    """Warm every path up, then time them in rotating order: each path's timed blocks
    (seconds, steps) and its peak memory."""
    meter = DeviceMeter(backend)
    blocks: dict[str, list[tuple[float, int]]] = {r.name: [] for r in runners}
    peaks: dict[str, float] = {r.name: 0.0 for r in runners}

    def segment(runner: Runner, steps: int, skip: int) -> dict[str, Any]:
        result = results[runner.name]
        seg: dict[str, Any] = {}
        with meter.segment(runner, seg):
            seconds = runner.run(steps, skip=skip)
        if steps > 0:
            blocks[runner.name].append((seconds, steps))
        peaks[runner.name] = max(peaks[runner.name], seg.get("peak_memory_bytes", 0.0))
        if "compilations" in seg:
            count = int(seg["compilations"])
            if steps > 0:
                result.compilations_measured = (result.compilations_measured or 0) + count
            else:
                result.compilations_warmup = count
                result.compilations_measured = 0
            result.compile_seconds = (result.compile_seconds or 0.0) + seg["compile_seconds"]
        if "dynamo_graphs" in seg:
            result.dynamo_graphs = (result.dynamo_graphs or 0) + seg["dynamo_graphs"]
            if steps > 0:
                result.dynamo_graphs_timed = (result.dynamo_graphs_timed or 0) + seg[
                    "dynamo_graphs"
                ]
            elif result.dynamo_graphs_timed is None:
                result.dynamo_graphs_timed = 0
            breaks = seg["dynamo_breaks"]
            result.dynamo_graph_breaks = (result.dynamo_graph_breaks or 0) + sum(breaks.values())
            result.dynamo_recompiles = (result.dynamo_recompiles or 0) + len(
                seg["dynamo_recompiles"]
            )
            for reason in [*breaks, *seg["dynamo_recompiles"]]:
                kept = result.graph_break_reasons if reason in breaks else result.recompile_reasons
                line = _first_line(reason)
                if line not in kept and len(kept) < 10:
                    kept.append(line)
        return seg

    for runner in runners:
        results[runner.name].features = runner.features
        seg = segment(runner, 0, options.warmup)
        results[runner.name].warmup_seconds = seg["seconds"]
        log.info("%s/%s: warm-up %.1f s", size, runner.name, seg["seconds"])
    for round_index in range(options.rounds):
        shift = round_index % len(runners) if runners else 0
        for runner in runners[shift:] + runners[:shift]:
            segment(runner, options.steps, 0)
    return blocks, peaks
