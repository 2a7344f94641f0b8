"""How often a node is interrupted: the one default rate the cost model's checkpoint interval
(checkpoints.py) and warm spares (spares.py) both use.

Meta, "The Llama 3 Herd of Models" (arXiv:2407.21783, section 3.3.4 and Table 5): 419
unexpected interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs in servers of
8 (2,048 nodes), that is 419 / (2,048 x 54 x 24) = 1.58e-4 interruptions per node-hour, one per
6,335 node-hours. It counts every unexpected interruption of a server (GPUs, HBM, network,
software), the figure that bills a recovery; a Trainium node is taken to fail as often as one
such server (no public trn1 figure exists). `estimate_cost.py --interruptions-per-node-hour`
replaces it.
"""

from __future__ import annotations

LLAMA3_UNEXPECTED_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_GPUS_PER_NODE = 8
LLAMA3_NODE_HOURS = LLAMA3_GPUS // LLAMA3_GPUS_PER_NODE * LLAMA3_DAYS * 24
#: Interruptions per node-hour: about 1.58e-4.
LLAMA3_RATE_PER_NODE_HOUR = LLAMA3_UNEXPECTED_INTERRUPTIONS / LLAMA3_NODE_HOURS
RATE_SOURCE = (
    f"Meta, The Llama 3 Herd of Models (arXiv:2407.21783) section 3.3.4: "
    f"{LLAMA3_UNEXPECTED_INTERRUPTIONS} unexpected interruptions in {LLAMA3_DAYS} days on "
    f"{LLAMA3_GPUS:,} GPUs ({LLAMA3_GPUS // LLAMA3_GPUS_PER_NODE:,} nodes of "
    f"{LLAMA3_GPUS_PER_NODE}) = {LLAMA3_RATE_PER_NODE_HOUR:.3g} per node-hour"
)
