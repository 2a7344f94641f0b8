"""The estimate for people (a table of every candidate, the comparisons, the notes) and as
JSON (the field names of ``Report`` and ``Estimate`` are part of the interface).
"""

from __future__ import annotations

import json
from dataclasses import asdict

from scripts.cost_lib.checkpoints import CheckpointPlan
from scripts.cost_lib.model import Report


def fmt_duration(seconds: float) -> str:
    """``1 h 02 min 03 s``, ``2 min 03 s`` or ``4.5 s``."""
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min {secs:02d} s"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{seconds:.1f} s"


def fmt_usd(value: float | None) -> str:
    """Dollars with cents, or three significant digits below one dollar."""
    if value is None:
        return "n/a"
    return f"${value:,.2f}" if value >= 1 or value == 0 else f"${value:.3g}"


def render(report: Report) -> str:
    """A column per instance type, then a line per comparison, then the notes."""
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
    if report.checkpoints is not None:
        out.append("")
        out.extend(_checkpoint_lines(report.checkpoints, main.instance_type))
    if report.notes:
        out.append("")
        out.extend(f"note: {n}" for n in report.notes)
    return "\n".join(out)


def _checkpoint_lines(plan: CheckpointPlan, instance_type: str) -> list[str]:
    lines = [
        f"checkpoints on {plan.nodes} x {instance_type}: an interruption every "
        f"{plan.mean_hours_between_interruptions:,.1f} h ({plan.interruptions_per_node_hour:.3g} "
        f"per node-hour x {plan.nodes} nodes; {plan.rate_source})",
        f"  a save of {fmt_duration(plan.save_seconds)}: save every "
        f"{fmt_duration(plan.best_interval_seconds)} of training ({plan.interval_source}); an "
        f"interruption then loses {fmt_duration(plan.lost_seconds_per_interruption_at_best)} of "
        f"work on average, saves and lost work {plan.overhead_at_best:.2%} of the run",
    ]
    if plan.interval_seconds is not None:
        assert plan.lost_seconds_per_interruption is not None and plan.overhead is not None
        lines.append(
            f"  at your interval of {fmt_duration(plan.interval_seconds)}: "
            f"{fmt_duration(plan.lost_seconds_per_interruption)} lost per interruption, saves "
            f"and lost work {plan.overhead:.2%} of the run"
        )
    lost = (
        ""
        if plan.expected_lost_seconds is None
        else (f", {fmt_duration(plan.expected_lost_seconds)} of work redone")
    )
    lines.append(
        f"  in {fmt_duration(plan.run_seconds)} to train: {plan.expected_interruptions:.3g} "
        f"interruptions expected{lost} (the restart itself comes on top)"
    )
    return lines


def _percent(fraction: float, up: str, down: str) -> str:
    return f"{abs(fraction) * 100:.0f}% {up if fraction >= 0 else down}"


def to_json(report: Report) -> str:
    data = asdict(report)
    return json.dumps(data, indent=2, allow_nan=False, default=str)
