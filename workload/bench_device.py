"""What the device and the process report while the benchmark runs.

``DeviceMeter`` measures one segment of a path's steps: peak memory (CUDA), graph
compilations and their time (XLA), and ``torch.compile`` graphs, graph breaks and
recompilations (elsewhere). ``process_peak_memory`` and ``machine_info`` describe the whole
run for bench.json.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import platform
import resource
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from workload.backend import Backend
from workload.engine import device_name, peak_flops_per_device

if TYPE_CHECKING:
    from workload.bench_paths import Runner


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


def machine_info(backend: Backend) -> dict[str, Any]:
    """The device, its peak FLOP/s where known, and the versions that ran (for bench.json)."""
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
