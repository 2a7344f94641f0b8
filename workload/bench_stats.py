"""The benchmark's figures: one ``PathResult`` per model and path, the statistics over its
timed blocks, and the profile of its device work by kind of kernel.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from workload.bench_paths import Runner


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
