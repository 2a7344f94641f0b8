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
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import logging
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

if __package__ in (None, ""):  # run as a script: make the ``workload`` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from workload.backend import DEVICE_CHOICES, PRECISION_CHOICES, Backend, BackendError, setup_backend
from workload.config import COMPILE, ConfigError, TrainConfig
from workload.engine import (
    TrainStep,
    build_optimizer,
    build_scheduler,
    device_name,
    flops_per_sample,
    model_inputs,
    peak_flops_per_device,
)
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
PATHS = ("trainer", "plain", "hf-trainer")
#: Text to train the throw-away tokenizer on (the model only needs its special-token ids).
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a benchmark measures how many samples a training step processes per second",
] * 8


class BenchError(ValueError):
    """Bad input or an unusable environment; the message is one line for the user."""


@dataclass
class PathResult:
    """One configuration (model x path): throughput, step times, memory, MFU, compiles."""

    model: str
    path: str
    status: str  # "ok" or "skipped"
    reason: str = ""
    features: list[str] = field(default_factory=list)
    steps: int = 0
    samples_per_second: float | None = None  # batch / median step time
    samples_per_second_mean: float | None = None  # all timed samples / all timed time
    tokens_per_second: float | None = None  # every position, padding included
    useful_tokens_per_second: float | None = None  # non-padding positions only
    step_ms_median: float | None = None
    step_ms_p10: float | None = None
    step_ms_p90: float | None = None
    step_ms_min: float | None = None
    step_ms_max: float | None = None
    spread_percent: float | None = None  # (p90 - p10) / median
    warmup_seconds: float | None = None
    peak_memory_bytes: int | None = None
    model_tflops: float | None = None  # achieved model FLOP/s (6N + attention), in TFLOP/s
    mfu: float | None = None
    compilations_warmup: int | None = None
    compilations_measured: int | None = None
    compile_seconds: float | None = None
    # torch.compile (cuda, cpu): graphs Dynamo produced, graph breaks, recompilations.
    dynamo_graphs: int | None = None
    dynamo_graph_breaks: int | None = None
    dynamo_recompiles: int | None = None
    dynamo_graphs_timed: int | None = None  # graphs compiled during timed blocks
    graph_break_reasons: list[str] = field(default_factory=list)
    recompile_reasons: list[str] = field(default_factory=list)
    ratio_vs_plain: float | None = None
    ratio_vs_hf_trainer: float | None = None
    profile: dict[str, Any] | None = None  # --profile-steps: device time by kind of kernel
    #: Mean step time of each timed block (one block per round).
    step_seconds: list[float] = field(default_factory=list)


# -- the paths -------------------------------------------------------------------------------


class Runner:
    """Runs timed steps of one path; subclasses say how a step is taken."""

    name = ""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.features: list[str] = []

    def run(self, steps: int, skip: int) -> float:
        """Take ``skip + steps`` steps; return the wall time of the last ``steps``, from a
        finished device to a finished device, with no wait for the device between them."""
        raise NotImplementedError

    def resident_bytes(self) -> int:
        """Device memory this path holds between steps (parameters, gradients, optimizer)."""
        return 0


def _tensor_bytes(tensors: Iterator[Any], device: torch.device) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in tensors
        if isinstance(t, torch.Tensor) and t.device.type == device.type
    )


def _state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device
) -> int:
    """Bytes of parameters, gradients and optimizer state on ``device``."""
    params = list(model.parameters())
    total = _tensor_bytes(iter(params), device)
    total += _tensor_bytes((p.grad for p in params), device)
    if optimizer is not None:
        state = (v for s in optimizer.state.values() for v in s.values())
        total += _tensor_bytes(state, device)
    return total


class StepRunner(Runner):
    """Calls a step function on pre-made device batches; waits for the device only at the
    edges of a timed block."""

    def __init__(
        self,
        backend: Backend,
        step: Callable[[Mapping[str, torch.Tensor]], Any],
        batches: list[dict[str, torch.Tensor]],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        super().__init__(backend)
        self.step = step
        self.batches = [{k: v.to(backend.device) for k, v in b.items()} for b in batches]
        self.model = model
        self.optimizer = optimizer
        self.taken = 0

    def _take(self) -> None:
        batch = self.batches[self.taken % len(self.batches)]
        self.taken += 1
        self.step(batch)

    def run(self, steps: int, skip: int) -> float:
        for _ in range(skip):
            self._take()
        self.backend.wait()
        start = time.perf_counter()
        for _ in range(steps):
            self._take()
        self.backend.wait()
        return time.perf_counter() - start

    def resident_bytes(self) -> int:
        return _state_bytes(self.model, self.optimizer, self.backend.device)


def trainer_runner(
    backend: Backend,
    model: nn.Module,
    config: TrainConfig,
    batches: list[dict[str, torch.Tensor]],
    total_steps: int,
) -> StepRunner:
    """The trainer's step, set up the way train.py sets it up."""
    model = backend.prepare_model(model)
    optimizer = build_optimizer(model, lr=config.peak_lr, weight_decay=config.weight_decay)
    scheduler = build_scheduler(
        optimizer,
        warmup_steps=int(config.warmup_ratio * total_steps),
        total_steps=total_steps,
    )
    step = TrainStep(
        model,
        optimizer,
        scheduler,
        backend,
        max_grad_norm=config.max_grad_norm,
        compile=config.compile_model,
    )
    runner = StepRunner(backend, step, batches, model, optimizer)
    runner.name = "trainer"
    defaults = optimizer.defaults
    runner.features = [
        f"{backend.precision} autocast" if backend.autocast_dtype is not None else "fp32",
        "fused AdamW"
        if defaults.get("fused")
        else " ".join([k for k in ("capturable", "foreach") if defaults.get(k)] + ["AdamW"]),
        f"{_attention(model)} attention",
    ]
    if step.compiled:
        runner.features.append("torch.compile")
    if config.max_grad_norm > 0:
        runner.features.append(f"grad clip {config.max_grad_norm:g}")
    return runner


def plain_runner(
    backend: Backend,
    model: nn.Module,
    config: TrainConfig,
    batches: list[dict[str, torch.Tensor]],
    total_steps: int,
) -> StepRunner:
    """The textbook loop (the Hugging Face course's "training loop in native PyTorch")."""
    from transformers import get_scheduler

    model = model.to(backend.device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.peak_lr)
    scheduler = get_scheduler(
        "linear", optimizer, num_warmup_steps=0, num_training_steps=total_steps
    )

    def step(batch: Mapping[str, torch.Tensor]) -> None:
        outputs = model(**model_inputs(batch))
        outputs.loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        backend.sync()  # torch_xla.sync() on XLA, as its textbook loop does; no-op elsewhere

    runner = StepRunner(backend, step, batches, model, optimizer)
    runner.name = "plain"
    runner.features = ["fp32", "AdamW", f"{_attention(model)} attention", "eager"]
    return runner


class HfTrainerRunner(Runner):
    """transformers.Trainer, timed from each step's start to its end by a callback."""

    name = "hf-trainer"

    def __init__(
        self,
        backend: Backend,
        model: nn.Module,
        config: TrainConfig,
        batches: list[dict[str, torch.Tensor]],
        workdir: Path,
    ) -> None:
        super().__init__(backend)
        from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

        examples = [
            {k: v[i] for k, v in model_inputs(batch).items()}
            for batch in batches
            for i in range(len(next(iter(batch.values()))))
        ]
        bf16 = backend.autocast_dtype == torch.bfloat16
        # Its best settings on a GPU: bf16, fused AdamW (the default optim), SDPA attention
        # (the model's), and torch.compile where the trainer compiles too.
        compile_ = backend.kind == "cuda" and config.compile != "off"
        args = TrainingArguments(
            output_dir=str(workdir),
            per_device_train_batch_size=config.batch_size,
            learning_rate=config.peak_lr,
            weight_decay=config.weight_decay,
            max_grad_norm=config.max_grad_norm,
            max_steps=1,
            bf16=bf16,
            torch_compile=compile_,
            use_cpu=backend.kind == "cpu",
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_drop_last=True,
            seed=config.seed,
        )
        runner = self
        self._skip = 0
        self._start = self._end = 0.0

        class _Timer(TrainerCallback):
            # Waits for the device before the first timed step and after the last one only.
            def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                if state.global_step == runner._skip:
                    runner.backend.wait()
                    runner._start = time.perf_counter()

            def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                if state.global_step == state.max_steps:
                    runner.backend.wait()
                    runner._end = time.perf_counter()

        self.trainer = Trainer(
            model=model, args=args, train_dataset=_ListDataset(examples), callbacks=[_Timer()]
        )
        # Its end-of-training summary would go to stdout, in the middle of the report.
        self.trainer.remove_callback(PrinterCallback)
        self.model = model
        self.features = [
            "bf16 autocast" if bf16 else "fp32",
            f"optim={getattr(args.optim, 'value', args.optim)}",
            f"{_attention(model)} attention",
        ]
        if compile_:
            self.features.append("torch.compile")

    def run(self, steps: int, skip: int) -> float:
        # Every train() builds a new optimizer, so its first step (state allocation) is
        # always skipped.
        self._skip = max(skip, 1)
        self._start = self._end = 0.0
        self.trainer.args.max_steps = self._skip + steps
        with _quiet_transformers():
            self.trainer.train()
        return self._end - self._start if steps else 0.0

    def resident_bytes(self) -> int:
        return _state_bytes(self.model, None, self.backend.device)


class _ListDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, items: list[dict[str, torch.Tensor]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def hf_trainer_unavailable(backend: Backend) -> str | None:
    """Why the Hugging Face Trainer baseline cannot run here, or None if it can."""
    if backend.kind == "xla":
        return "transformers.Trainer's XLA path targets TPUs; Trainium uses optimum-neuron"
    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        return f"transformers.Trainer needs {' and '.join(missing)}, not installed here"
    from transformers.utils import is_torch_xla_available

    if is_torch_xla_available():
        return "transformers was imported with torch-xla enabled; set USE_TORCH_XLA=0"
    return None


def _attention(model: nn.Module) -> str:
    config = getattr(Backend.unwrap(model), "config", None)
    return str(getattr(config, "_attn_implementation", None) or "default")


# -- measurement -----------------------------------------------------------------------------


def dynamo_stats() -> dict[str, Any]:
    """``torch.compile`` counts so far in this process: graphs Dynamo handed to the
    backend, graph breaks (with reasons) and recompilations (with the failed guards).

    From ``torch._dynamo.utils``: ``counters["stats"]["unique_graphs"]``,
    ``counters["graph_break"]`` (reason -> count) and ``guard_failures`` (code -> the
    guard failures that made it recompile), the counts ``torch._dynamo.explain`` reads.
    """
    try:
        from torch._dynamo import utils as dynamo_utils
    except ImportError:  # pragma: no cover - torch without Dynamo
        return {"graphs": 0, "breaks": {}, "recompiles": []}
    counters = dynamo_utils.counters
    failures = getattr(dynamo_utils, "guard_failures", {})
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "breaks": dict(counters["graph_break"]),
        "recompiles": [str(r) for reasons in failures.values() for r in reasons],
    }


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:limit]


class DeviceMeter:
    """Per-segment peak memory (CUDA), graph compilations (XLA) and ``torch.compile``
    graphs, graph breaks and recompilations (elsewhere)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @contextlib.contextmanager
    def segment(self, runner: Runner, out: dict[str, Any]) -> Iterator[None]:
        kind = self.backend.kind
        if kind == "cuda":
            torch.cuda.synchronize(self.backend.device)
            torch.cuda.reset_peak_memory_stats(self.backend.device)
            start_alloc = torch.cuda.memory_allocated(self.backend.device)
            own = runner.resident_bytes()
        compiles = self.backend.compile_count()
        compile_s = _xla_compile_seconds() if kind == "xla" else 0.0
        dynamo = dynamo_stats() if kind != "xla" else None
        started = time.perf_counter()
        yield
        out["seconds"] = time.perf_counter() - started
        if dynamo is not None:
            after = dynamo_stats()
            out["dynamo_graphs"] = after["graphs"] - dynamo["graphs"]
            breaks = {
                reason: count - dynamo["breaks"].get(reason, 0)
                for reason, count in after["breaks"].items()
            }
            out["dynamo_breaks"] = {r: c for r, c in breaks.items() if c > 0}
            out["dynamo_recompiles"] = after["recompiles"][len(dynamo["recompiles"]) :]
        if kind == "cuda":
            peak = torch.cuda.max_memory_allocated(self.backend.device)
            # What this path holds plus the most it allocated on top during the segment;
            # the other paths' resident state is left out.
            out["peak_memory_bytes"] = own + peak - start_alloc
        if compiles is not None:
            out["compilations"] = (self.backend.compile_count() or 0) - compiles
            out["compile_seconds"] = _xla_compile_seconds() - compile_s


def _xla_compile_seconds() -> float:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return float(data[1]) / 1e9 if data else 0.0


def process_peak_memory(backend: Backend) -> tuple[int | None, str]:
    """Peak memory of the device (XLA) or of this process (CPU), and what it measures."""
    if backend.kind == "xla":
        try:
            import torch_xla.core.xla_model as xm

            info: Any = xm.get_memory_info(backend.device)
            return int(info.get("peak_bytes_used") or info["bytes_used"]), "xla device peak"
        except Exception:  # not every PJRT plugin reports memory
            return None, "unavailable"
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "process peak RSS"


def summarize(
    result: PathResult,
    blocks: list[tuple[float, int]],
    samples_per_step: int,
    seq_len: int,
    useful_tokens_per_sample: float | None = None,
) -> None:
    """Statistics over the timed blocks (``(seconds, steps)`` each); a block's step time is
    its mean, since the host does not wait for the device between the steps of a block."""
    result.steps = sum(n for _, n in blocks)
    per_step = [seconds / n for seconds, n in blocks if n > 0]
    result.step_seconds = [round(t, 6) for t in per_step]
    ms = sorted(t * 1000 for t in per_step)
    result.step_ms_median = statistics.median(ms)
    # Throughput from the median block: robust to the stalls of a shared machine. The mean
    # over all timed steps is kept beside it.
    result.samples_per_second = samples_per_step * 1000 / result.step_ms_median
    result.samples_per_second_mean = (
        samples_per_step * result.steps / sum(seconds for seconds, _ in blocks)
    )
    result.tokens_per_second = result.samples_per_second * seq_len
    useful = seq_len if useful_tokens_per_sample is None else useful_tokens_per_sample
    result.useful_tokens_per_second = result.samples_per_second * useful
    if len(ms) >= 2:
        deciles = statistics.quantiles(ms, n=10, method="inclusive")
        result.step_ms_p10, result.step_ms_p90 = deciles[0], deciles[-1]
    else:
        result.step_ms_p10 = result.step_ms_p90 = ms[0]
    result.step_ms_min, result.step_ms_max = ms[0], ms[-1]
    result.spread_percent = 100 * (result.step_ms_p90 - result.step_ms_p10) / result.step_ms_median


#: Kernel-name patterns of each kind of device work, first match wins (lower case).
KERNEL_KINDS = (
    ("attention", ("fmha", "flash", "attention", "attn", "cudnn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "sm90_", "cublas")),
    ("optimizer", ("adam",)),
    ("multi-tensor (grad norm, clip, zero)", ("multi_tensor", "foreach")),
    ("inductor fused (triton)", ("triton",)),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, patterns in KERNEL_KINDS:
        if any(p in low for p in patterns):
            return kind
    return "other"


def profile_runner(runner: Runner, steps: int, path: Path) -> dict[str, Any]:
    """Profile ``steps`` timed steps of ``runner`` with ``torch.profiler``: writes the
    kernel table to ``path``; returns device milliseconds per step by kind of kernel and
    the fraction of the wall time the device was busy (below 1: the host is the limit)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if runner.backend.kind == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        wall = runner.run(steps, skip=0)
    kernels = [  # device work only: no CPU ops, no annotation ranges shown on the device
        e
        for e in prof.events()
        if e.device_type != torch.autograd.DeviceType.CPU
        and not getattr(e, "is_user_annotation", False)
        and e.time_range.elapsed_us() > 0
    ]
    by_kind: dict[str, float] = {}
    for e in kernels:
        kind = kernel_kind(e.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + e.time_range.elapsed_us() / 1000 / steps
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy_us, end = 0.0, -math.inf
    for lo, hi in spans:  # union of kernel intervals
        if hi > end:
            busy_us += hi - max(lo, end)
            end = hi
    on_device = runner.backend.kind == "cuda"
    sort_by = "self_device_time_total" if on_device else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=40)
    summary: dict[str, Any] = {"steps": steps, "wall_ms_per_step": 1000 * wall / steps}
    if on_device:
        summary |= {
            "device_busy_ms_per_step": busy_us / 1000 / steps,
            "device_busy_fraction": (busy_us / 1e6 / wall) if wall > 0 else None,
            "kernels_per_step": len(kernels) / steps,
            "device_ms_per_step_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        }
    path.write_text(json.dumps(summary, indent=2) + "\n\n" + table + "\n")
    return summary


# -- one model ---------------------------------------------------------------------------------


def train_config(args: argparse.Namespace, size: str, output: Path) -> TrainConfig:
    overrides = dict(MODEL_SIZES[size])
    task = overrides.pop("task", None) or args.task or "classification"
    if args.task and args.task != task:
        raise BenchError(f"--model {size} trains {task}; --task {args.task} is for --model tiny")
    try:
        return TrainConfig(
            data="synthetic",
            output=str(output),
            model="tiny",
            task=task,
            batch_size=args.batch_size,
            max_length=args.seq_len,
            seed=args.seed,
            compile=args.compile,
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
) -> list[dict[str, torch.Tensor]]:
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


def useful_tokens_per_sample(batches: list[dict[str, torch.Tensor]]) -> float:
    """Mean non-padding positions per example over ``batches``."""
    masks = torch.cat([b["attention_mask"] for b in batches])
    return float(masks.sum()) / masks.shape[0]


def bench_model(
    size: str, args: argparse.Namespace, backend: Backend, output: Path
) -> list[PathResult]:
    config = train_config(args, size, output)
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
        config, vocab, num_labels, count=4, fill=args.fill, pad_id=int(tokenizer.pad_token_id)
    )
    useful = useful_tokens_per_sample(batches)
    total_steps = args.warmup + args.rounds * args.steps
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
    for name in args.paths:
        result = PathResult(model=size, path=name, status="ok")
        results[name] = result
        if name == "trainer":
            runners.append(trainer_runner(backend, fresh_model(), config, batches, total_steps))
        elif name == "plain":
            runners.append(plain_runner(backend, fresh_model(), config, batches, total_steps))
        else:
            reason = hf_trainer_unavailable(backend)
            if reason:
                result.status, result.reason = "skipped", reason
                continue
            runners.append(
                HfTrainerRunner(backend, fresh_model(), config, batches, output / "hf-trainer")
            )

    try:
        blocks, peaks = measure(runners, results, args, backend, size)
        if args.profile_steps:
            for runner in runners:
                name = f"profile-{size}-{runner.name}.txt"
                summary = profile_runner(runner, args.profile_steps, args.output / name)
                results[runner.name].profile = summary
                log.info("%s/%s: profile %s", size, runner.name, json.dumps(summary))
    except torch.OutOfMemoryError as exc:
        raise BenchError(
            f"--model {size} at batch {config.batch_size} x {config.max_length} does not fit "
            f"in device memory ({_first_line(str(exc), 120)}); use a smaller --batch-size"
        ) from None
    peak_flops = peak_flops_per_device(backend, args.peak_tflops or None)
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
    return [results[name] for name in args.paths]


def measure(
    runners: list[Runner],
    results: dict[str, PathResult],
    args: argparse.Namespace,
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
        seg = segment(runner, 0, args.warmup)
        results[runner.name].warmup_seconds = seg["seconds"]
        log.info("%s/%s: warm-up %.1f s", size, runner.name, seg["seconds"])
    for round_index in range(args.rounds):
        shift = round_index % len(runners) if runners else 0
        for runner in runners[shift:] + runners[:shift]:
            segment(runner, args.steps, 0)
    return blocks, peaks


# -- output ------------------------------------------------------------------------------------


def machine_info(backend: Backend) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": backend.description,
        "device_kind": backend.kind,
        "precision": backend.precision,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "peak_tflops_bf16_per_device": None,
    }
    name = device_name(backend)
    peak = peak_flops_per_device(backend)
    if peak:
        info["peak_tflops_bf16_per_device"] = peak / 1e12
        info["peak_source"] = name
    if backend.kind == "cuda":
        info["gpu"] = torch.cuda.get_device_name(backend.device)
        info["cuda"] = torch.version.cuda
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(backend.device).total_memory
    for module in ("transformers", "accelerate", "triton"):
        with contextlib.suppress(ImportError):
            info[module] = importlib.import_module(module).__version__
    return info


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _rate(value: float | None) -> str:
    """Throughput with three significant digits below 100 (CPU runs of big models)."""
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.0f} MiB"


def table_rows(results: list[PathResult]) -> list[list[str]]:
    rows = []
    for r in results:
        if r.status != "ok":
            rows.append([r.model, r.path, "skipped", *[""] * 9, r.reason])
            continue
        ratio = [
            f"{v:.2f}x vs {name}"
            for v, name in ((r.ratio_vs_plain, "plain"), (r.ratio_vs_hf_trainer, "hf-trainer"))
            if v is not None
        ]
        rows.append(
            [
                r.model,
                r.path,
                _rate(r.samples_per_second),
                _rate(r.tokens_per_second),
                _rate(r.useful_tokens_per_second),
                f"{_fmt(r.step_ms_median, '.1f')} ({_fmt(r.step_ms_p10, '.1f')}-"
                f"{_fmt(r.step_ms_p90, '.1f')})",
                _mib(r.peak_memory_bytes),
                _fmt(r.model_tflops, ".3g"),
                _fmt(None if r.mfu is None else 100 * r.mfu, ".1f", "%"),
                _compiles(r),
                _dynamo(r),
                ", ".join(ratio) or "-",
                ", ".join(r.features),
            ]
        )
    return rows


def _compiles(r: PathResult) -> str:
    if r.compilations_warmup is None:
        return "-"
    return f"{r.compilations_warmup}+{r.compilations_measured} ({r.compile_seconds or 0:.1f} s)"


def _dynamo(r: PathResult) -> str:
    """torch.compile: graphs (of which compiled while timed), graph breaks, recompiles."""
    if not r.dynamo_graphs:
        return "-"
    timed = f" ({r.dynamo_graphs_timed} timed)" if r.dynamo_graphs_timed else ""
    return f"{r.dynamo_graphs}{timed}/{r.dynamo_graph_breaks}/{r.dynamo_recompiles}"


HEADER = [
    "model",
    "path",
    "samples/s",
    "tokens/s",
    "useful tokens/s",
    "step ms median (p10-p90)",
    "peak mem",
    "TFLOP/s",
    "MFU",
    "compiles (warm-up+timed)",
    "graphs/breaks/recompiles",
    "ratio",
    "features",
]


def render_text(report: dict[str, Any], results: list[PathResult]) -> str:
    rows = [HEADER, *table_rows(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = [
        f"device: {report['machine']['device']} ({report['machine']['precision']}), "
        f"torch {report['machine']['torch']}, {report['machine']['cpu_count']} CPUs, "
        f"torch threads {report['machine']['torch_threads']}; batch {report['batch_size']} x "
        f"{report['seq_len']} tokens (fill {report['fill']:g}); {report['rounds']} rounds x "
        f"{report['steps']} steps after {report['warmup']} warm-up",
        "",
    ]
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    mem = report.get("process_peak_memory_bytes")
    if mem is not None:
        lines.append(f"\n{report['process_peak_memory_kind']}: {_mib(mem)} (all paths)")
    for r in results:
        if r.ratio_vs_plain is not None:
            verdict = "faster than" if r.ratio_vs_plain >= 1 else "SLOWER than"
            lines.append(
                f"{r.model}: the trainer's step is {r.ratio_vs_plain:.2f}x the plain loop "
                f"({verdict} the baseline)"
            )
    return "\n".join(lines)


def render_markdown(results: list[PathResult]) -> str:
    """The table for the README; memory, MFU and compile columns only where measured."""
    body = table_rows(results)
    optional = {
        HEADER.index(c)
        for c in (
            "useful tokens/s",
            "peak mem",
            "MFU",
            "compiles (warm-up+timed)",
            "graphs/breaks/recompiles",
        )
    }
    useful, tokens = HEADER.index("useful tokens/s"), HEADER.index("tokens/s")

    def shown(i: int) -> bool:
        if i == useful:  # only where the data pads
            return any(row[i] != row[tokens] for row in body)
        return i not in optional or any(row[i] not in ("n/a", "-", "") for row in body)

    keep = [i for i in range(len(HEADER)) if shown(i)]
    lines = ["| " + " | ".join(HEADER[i] for i in keep) + " |", "|" + "---|" * len(keep)]
    lines += ["| " + " | ".join(row[i] or " " for i in keep) + " |" for row in body]
    return "\n".join(lines)


def plot(results: list[PathResult], machine: str, path: Path) -> str | None:
    """A bar chart of samples/s per configuration; None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    done = [r for r in results if r.samples_per_second]
    models = list(dict.fromkeys(r.model for r in done)) or ["(none)"]
    colors = {"trainer": "#1f77b4", "plain": "#ff7f0e", "hf-trainer": "#2ca02c"}
    # One panel per model: their throughputs differ by orders of magnitude.
    fig, axes = plt.subplots(
        len(models), 1, figsize=(7, 0.45 * len(done) + 1.0 * len(models) + 0.8), squeeze=False
    )
    for ax, model in zip(axes[:, 0], models, strict=True):
        rows = [r for r in done if r.model == model]
        values = [r.samples_per_second or 0.0 for r in rows]
        ax.barh([r.path for r in rows], values, color=[colors.get(r.path, "grey") for r in rows])
        for y, value in enumerate(values):
            ax.text(value, y, f" {_rate(value)}", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, max(values, default=1.0) * 1.2)
        ax.set_title(model, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("samples/s (higher is better)")
    fig.suptitle(f"Training-step throughput on {machine}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


# -- command line ------------------------------------------------------------------------------


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
    if backend.kind != "xla":
        # transformers and accelerate move a Trainer to the XLA device whenever torch-xla is
        # installed; keep the baseline on the device the benchmark runs on.
        os.environ.setdefault("USE_TORCH_XLA", "0")
    try:
        if backend.world_size > 1:
            raise BenchError("run the benchmark as one process (not under torchrun)")
        if args.compile == "on" and backend.kind == "xla":
            raise BenchError("--compile on: XLA compiles the whole graph already; use auto/off")
        args.output.mkdir(parents=True, exist_ok=True)
        results: list[PathResult] = []
        with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
            for size in sizes:
                results.extend(bench_model(size, args, backend, Path(tmp)))
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
