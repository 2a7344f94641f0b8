"""The benchmark's report for people: the text table printed after a run, the same table in
Markdown for the README, and the bar chart of throughput (bench.png).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workload.bench_stats import PathResult


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
