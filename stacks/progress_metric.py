"""A job's progress as a CloudWatch metric: the metric filters on the training log group that
turn rank 0's metrics-file lines (docs/job-contract.md, scripts/cluster_lib/progress.py) into
datapoints, so that whoever reads progress asks CloudWatch for one metric per cluster instead
of reading every node's log stream. No CDK import: the rehearsal's stand-in
(scripts/rehearsal/metric_filter.py) and the CLI read the same names.

Every line of the metrics file becomes one datapoint, stamped with the log event's time, of:

- JobStep, no dimension: every line with a step, value the step (PATTERN_ANY);
- JobStep with the dimension Phase: every line whose phase is one of PHASES (PATTERN_PHASE).

The rules they follow (CloudWatch Logs user guide, "Filter pattern syntax for metric filters,
subscription filters, filter log events, and Live Tail", Matching terms in JSON log events;
the PutMetricFilter API reference, MetricTransformation):

- A JSON pattern `{ SELECTOR OPERATOR VALUE }` matches only log events that are JSON objects;
  `>=` compares numbers, `=` with a quoted value compares strings, `&&` and `||` join
  comparisons and parentheses group them. A line a node's command prints (text, or a logger's
  prefix before JSON) never matches, though the group holds those streams too.
- A metric value taken from a field (`$.step`) must be a field the pattern matches.
- Dimensions come from fields of the event, at most three per filter; CloudWatch Logs may
  disable a filter that makes 1,000 different dimension values within an hour, so the phase
  filter matches only the four documented phases: an entry point that writes another phase
  cannot make new metrics.
- No default value: it would emit a datapoint for every event of the group that does not
  match (the commands' output lines), which would read as progress.
- At most 100 metric filters per log group: these are two.

The cluster runs one job at a time (the job queue's slot, stacks/job_queue.py), so the metric
is the cluster's, in its namespace (ClusterConfig.metrics_namespace), and a reader takes the
datapoints since the attempt began; a JobId dimension would need the job's ID in every line of
every entry point, which the contract does not ask for.
"""

from __future__ import annotations

#: The metric both filters publish, in the cluster's namespace.
METRIC_NAME = "JobStep"
#: The dimension of the phase filter, taken from the line's `phase`.
PHASE_DIMENSION = "Phase"
#: The phases the contract names (scripts/cluster_lib/progress.py PHASES, the same order).
PHASES = ("compiling", "training", "saving", "evaluating")
#: Every line with a step (an integer >= 0 by the schema).
PATTERN_ANY = "{ $.step >= 0 }"
#: Every line with a step and one of the four phases.
PATTERN_PHASE = (
    "{ ($.step >= 0) && (" + " || ".join(f'$.phase = "{phase}"' for phase in PHASES) + ") }"
)
#: The datapoint's value: the line's step.
METRIC_VALUE = "$.step"
