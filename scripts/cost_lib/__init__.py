"""The cost model behind ``scripts/estimate_cost.py``, apart from its command line.

- ``model``: work, candidates (an instance type at a price and a throughput), the estimate of
  each, the comparison with the main one and the break-even throughput;
- ``inputs``: what was measured: a training run's metrics.jsonl and a benchmark's bench.json;
- ``checkpoints``: the checkpoint interval that minimizes expected lost work (Young/Daly) at an
  interruption rate (Meta's Llama 3 figures by default), and what an interruption costs;
- ``render``: the estimate as a table for people, or as JSON.
"""

from __future__ import annotations


class EstimateError(ValueError):
    """Input that cannot be turned into an estimate; the message is one line for the user."""
