"""How often to save a checkpoint, and what an interruption costs at the interval you have.

The interval: Young (1974), "A first order approximation to the optimum checkpoint
interval", Communications of the ACM 17(9), 530-531, and Daly (2006), "A higher order estimate
of the optimum checkpoint interval for restart dumps", Future Generation Computer Systems
22(3), 303-312. With a save that takes C seconds and a mean time between interruptions M, an
interruption at a uniformly random moment of a cycle of tau seconds of training plus the save
loses (tau + C) / 2 of work on average; the time spent saving (C / tau of the run) plus the work
redone ((tau + C) / 2M of it) is least at tau = sqrt(2 C M), Young's interval and the first
term of Daly's (his higher-order terms matter only where C approaches M, and are left out).
The restart itself (a replacement node, the load of the checkpoint) comes on top.

The interruption rate: Meta's Llama 3 paper by default (interruptions.py), per node-hour; a job
on N nodes stops whenever any of them fails, N times as often. Give your own fleet's rate where
you have one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scripts.cost_lib.interruptions import LLAMA3_RATE_PER_NODE_HOUR, RATE_SOURCE

INTERVAL_SOURCE = "Young 1974 (CACM 17(9)), Daly 2006 (FGCS 22(3)): sqrt(2 x save x MTBI)"


@dataclass(frozen=True)
class CheckpointPlan:
    """The checkpoint interval against the job's interruption rate (JSON field names are part
    of the interface). Intervals are seconds of training between the end of one save and the
    start of the next."""

    nodes: int
    interruptions_per_node_hour: float
    rate_source: str
    mean_hours_between_interruptions: float  # of the job: any of its nodes
    save_seconds: float
    best_interval_seconds: float
    interval_source: str
    lost_seconds_per_interruption_at_best: float
    overhead_at_best: float  # fraction of the run spent saving or redoing work
    interval_seconds: float | None  # the job's own interval, where given
    lost_seconds_per_interruption: float | None
    overhead: float | None
    run_seconds: float
    expected_interruptions: float  # in run_seconds
    expected_lost_seconds: float | None  # redone work over the run, at interval_seconds


def best_interval(save_seconds: float, mean_seconds_between: float) -> float:
    """Young's interval sqrt(2 C M) (Daly's first-order term)."""
    return math.sqrt(2 * save_seconds * mean_seconds_between)


def lost_per_interruption(interval: float, save_seconds: float) -> float:
    """Work lost on average when an interruption falls uniformly in a cycle of `interval`
    seconds of training and a save of `save_seconds`: half the cycle."""
    return (interval + save_seconds) / 2


def overhead(interval: float, save_seconds: float, mean_seconds_between: float) -> float:
    """The fraction of the run spent saving or redoing lost work (first order)."""
    return (
        save_seconds / interval
        + lost_per_interruption(interval, save_seconds) / mean_seconds_between
    )


def plan(
    *,
    nodes: int,
    save_seconds: float,
    run_seconds: float,
    interval_seconds: float | None = None,
    per_node_hour: float | None = None,
) -> CheckpointPlan:
    rate = LLAMA3_RATE_PER_NODE_HOUR if per_node_hour is None else per_node_hour
    source = RATE_SOURCE if per_node_hour is None else "given (--interruptions-per-node-hour)"
    mean_hours = 1 / (rate * nodes)
    mean_seconds = mean_hours * 3600
    best = best_interval(save_seconds, mean_seconds)
    interruptions = run_seconds / mean_seconds
    lost = None
    if interval_seconds is not None:
        lost = lost_per_interruption(interval_seconds, save_seconds)
    return CheckpointPlan(
        nodes=nodes,
        interruptions_per_node_hour=rate,
        rate_source=source,
        mean_hours_between_interruptions=mean_hours,
        save_seconds=save_seconds,
        best_interval_seconds=best,
        interval_source=INTERVAL_SOURCE,
        lost_seconds_per_interruption_at_best=lost_per_interruption(best, save_seconds),
        overhead_at_best=overhead(best, save_seconds, mean_seconds),
        interval_seconds=interval_seconds,
        lost_seconds_per_interruption=lost,
        overhead=None
        if interval_seconds is None
        else overhead(interval_seconds, save_seconds, mean_seconds),
        run_seconds=run_seconds,
        expected_interruptions=interruptions,
        expected_lost_seconds=None if lost is None else interruptions * lost,
    )
