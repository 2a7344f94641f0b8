"""What warm spares (the cluster's ``spare_nodes`` setting) cost against the training time they
save when nodes die.

A node that dies mid-job costs the whole job a recovery: the supervisor notices, ends and
retries the attempt (docs/operating.md, "A node that dies mid-job": ``2P + G + R`` with the
supervisor's poll, grace and retry delay), and the retry needs ``node_count`` healthy nodes.
Without a spare it waits for the group's replacement (an EC2 launch and the node's whole
bootstrap, which began when the group saw the instance gone); with one it starts on the spare at
once. Everything after that (preflight, the start, the checkpoint load, the work since the last
checkpoint) is the same either way, so what a spare saves per death is

    saved = max(0, replacement - (2P + G + R))

while every node of the cluster, the job's and the spares, is paid for. Spares themselves are
paid for the whole run. Deaths happen at a rate per node-hour on the job's nodes.

The default rate is Meta's Llama 3 figure (interruptions.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from scripts.cost_lib.interruptions import LLAMA3_RATE_PER_NODE_HOUR, RATE_SOURCE

#: The supervisor's share before a retry reads the group, at its defaults: 2P + G + R with
#: PollSeconds 300, FailureGraceSeconds 300, RetryDelaySeconds 60 (docs/operating.md).
SUPERVISOR_RETRY_SECONDS = 2 * 300 + 300 + 60
#: An EC2 launch, API call to a running instance: 25.8 s on average for general-purpose types
#: (brevdev/ec2-coldboot-research, "Fix Plan" 1.2: API 19%, Pending->Running 69%).
EC2_LAUNCH_SECONDS = 26.0
#: A replacement's bootstrap is bounded by the launch lifecycle hook's timeout (45 minutes,
#: stacks/compute.py BOOTSTRAP_TIMEOUT): the default takes the bound, as no trn1 bootstrap's
#: phases (scripts/node/bootstrap.sh logs each one's seconds) are recorded here.
BOOTSTRAP_BOUND_SECONDS = 45 * 60
REPLACEMENT_SECONDS = EC2_LAUNCH_SECONDS + BOOTSTRAP_BOUND_SECONDS


@dataclass(frozen=True)
class SpareEstimate:
    """Spares against no spares for one run (JSON field names are part of the interface)."""

    nodes: int
    spare_nodes: int
    usd_per_node_hour: float
    interruptions_per_node_hour: float
    rate_source: str
    train_hours: float
    expected_deaths: float
    #: What one death costs in waiting without a spare and what a spare saves of it.
    replacement_seconds: float
    supervisor_retry_seconds: float
    saved_seconds_per_death: float
    hours_without_spares: float
    hours_with_spares: float
    hours_saved: float
    cost_without_spares_usd: float
    cost_with_spares_usd: float
    spare_node_hours: float
    #: Positive: the spares pay for themselves.
    net_saving_usd: float
    #: The rate per node-hour at which both cost the same; None if spares never pay.
    break_even_rate_per_node_hour: float | None


def estimate_spares(
    *,
    nodes: int,
    spare_nodes: int,
    usd_per_node_hour: float,
    train_seconds: float,
    rate_per_node_hour: float = LLAMA3_RATE_PER_NODE_HOUR,
    rate_source: str = RATE_SOURCE,
    replacement_seconds: float = REPLACEMENT_SECONDS,
    supervisor_retry_seconds: float = SUPERVISOR_RETRY_SECONDS,
) -> SpareEstimate:
    """Expected time and cost of a run of `train_seconds` on `nodes` with and without
    `spare_nodes`. Deaths come at `rate_per_node_hour` on the job's nodes while it trains; a
    spare is assumed ready at each death (a second death within one replacement time has a
    probability of rate x nodes x replacement, 0.8% at 64 nodes with the defaults)."""
    train_hours = train_seconds / 3600
    deaths = rate_per_node_hour * nodes * train_hours
    saved = max(0.0, replacement_seconds - supervisor_retry_seconds)
    # Both pay the supervisor's share and everything after the retry; only the wait differs.
    hours_without = train_hours + deaths * saved / 3600
    hours_with = train_hours
    cost_without = nodes * usd_per_node_hour * hours_without
    cost_with = (nodes + spare_nodes) * usd_per_node_hour * hours_with
    # nodes (1 + rate nodes saved) = nodes + spares, per hour of training.
    break_even = spare_nodes / (nodes * nodes * saved / 3600) if saved > 0 else None
    return SpareEstimate(
        nodes=nodes,
        spare_nodes=spare_nodes,
        usd_per_node_hour=usd_per_node_hour,
        interruptions_per_node_hour=rate_per_node_hour,
        rate_source=rate_source,
        train_hours=train_hours,
        expected_deaths=deaths,
        replacement_seconds=replacement_seconds,
        supervisor_retry_seconds=supervisor_retry_seconds,
        saved_seconds_per_death=saved,
        hours_without_spares=hours_without,
        hours_with_spares=hours_with,
        hours_saved=hours_without - hours_with,
        cost_without_spares_usd=cost_without,
        cost_with_spares_usd=cost_with,
        spare_node_hours=spare_nodes * hours_with,
        net_saving_usd=cost_without - cost_with,
        break_even_rate_per_node_hour=break_even,
    )


def _usd(value: float) -> str:
    return f"-${-value:,.2f}" if value < 0 else f"${value:,.2f}"


def render_spares(s: SpareEstimate) -> list[str]:
    """The comparison as lines for the table's output."""
    be = (
        f"{s.break_even_rate_per_node_hour:.3g} per node-hour"
        if s.break_even_rate_per_node_hour is not None
        else "never (a spare saves no waiting)"
    )
    verdict = "pay for themselves" if s.net_saving_usd > 0 else "cost more than they save"
    return [
        f"spares: {s.spare_nodes} on {s.nodes} node(s) at {s.interruptions_per_node_hour:.3g} "
        f"interruptions per node-hour ({s.rate_source})",
        f"spares: {s.expected_deaths:.3g} expected node deaths in {s.train_hours:.4g} h of "
        f"training, each {s.saved_seconds_per_death / 60:.1f} min shorter with a spare "
        f"(replacement {s.replacement_seconds / 60:.1f} min against the supervisor's "
        f"{s.supervisor_retry_seconds / 60:.1f} min before a retry)",
        f"spares: {s.hours_saved:.3g} h saved for {s.spare_node_hours:.4g} spare node-hours; "
        f"${s.cost_with_spares_usd:,.2f} with spares against ${s.cost_without_spares_usd:,.2f} "
        f"without: they {verdict} (net {_usd(s.net_saving_usd)}); break-even at {be}",
    ]
