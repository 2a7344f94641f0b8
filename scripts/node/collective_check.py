"""Cross-node collective check run by preflight.sh under torchrun on every node.

First the ranks agree on the node software: each all-gathers the (SOFTWARE_VERSION,
LAUNCH_TEMPLATE_VERSION, AMI_ID) of its node (from the environment, 'unknown' where unset),
and where the nodes differ every node prints one `FAIL node-software:` line naming who runs
what and exits 4, before any all-reduce: the supervisor only sees exit codes, so the nodes
themselves must refuse a mixed fleet. Otherwise it prints `PASS node-software: ...`, then
all-reduces a tensor across every process of every node, checks the sum, and reports the
bandwidth. On Trainium it goes through torch-xla's "xla" process group (Neuron collectives
over EFA: the path training uses); elsewhere through gloo on the CPU. The software check
always runs over gloo (all_gather_object needs a CPU group).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

#: The node scripts' software: bootstrap writes these into node.env (scripts/node/lib.sh).
SOFTWARE_FIELDS = (
    ("version", "SOFTWARE_VERSION"),
    ("launch-template-version", "LAUNCH_TEMPLATE_VERSION"),
    ("ami", "AMI_ID"),
)
#: Exit status when the nodes run different software (preflight.sh's 3 means "replace
#: this node", which a roll of the fleet, not a replacement, fixes).
SOFTWARE_MISMATCH_STATUS = 4


def use_xla(device: str) -> bool:
    if device != "auto":
        return device == "xla"
    if not Path("/dev/neuron0").exists():
        return False
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        return False
    return True


def node_software() -> str:
    """`version=... launch-template-version=... ami=...`, as preflight's node-software line."""
    return " ".join(f"{name}={os.environ.get(var) or 'unknown'}" for name, var in SOFTWARE_FIELDS)


def check_software(group: Any, limit: int = 8) -> str:
    """All-gathers every rank's node and software; returns the one line to print (on each
    node's first process), which starts with PASS or FAIL. The FAIL line names the nodes of
    each software, at most `limit` per software (SSM shows 24,000 characters of output)."""
    import torch.distributed as dist

    node = (
        int(os.environ.get("GROUP_RANK", "0")),
        os.environ.get("TRAINIUM_NODE_ADDRESS") or socket.gethostname(),
    )
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (node, node_software()), group=group)
    nodes: dict[tuple[int, str], str] = dict(sorted(gathered))
    software = sorted(set(nodes.values()))
    if len(software) == 1:
        return f"PASS node-software: {software[0]} on all {len(nodes)} nodes"
    groups: dict[str, list[str]] = {}
    for (rank, host), sw in nodes.items():
        groups.setdefault(sw, []).append(f"node {rank} ({host})")
    parts = []
    for sw, names in sorted(groups.items(), key=lambda item: -len(item[1])):
        more = f" and {len(names) - limit} more" if len(names) > limit else ""
        parts.append(
            f"{', '.join(names[:limit])}{more} {'runs' if len(names) == 1 else 'run'} {sw}"
        )
    runs = "; ".join(parts)
    return (
        f"FAIL node-software: the nodes run different software: {runs}: roll the fleet so "
        "that every node runs the current launch template (python scripts/cluster.py roll, "
        "see the README)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("auto", "cpu", "xla"), default="auto")
    parser.add_argument("--size-mb", type=float, default=64.0, help="all-reduce size per process")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout", type=int, default=300, help="seconds to wait for peers")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    xla = use_xla(args.device)
    if xla:
        import torch_xla

        dist.init_process_group("xla", init_method="xla://")
        device = torch_xla.device()
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        device = torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    # Every rank reaches the same verdict from the same gathered list, so all stop together.
    software = check_software(dist.new_group(backend="gloo") if xla else None)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(software, flush=True)
    if software.startswith("FAIL"):
        dist.destroy_process_group()
        return SOFTWARE_MISMATCH_STATUS
    elements = max(1, int(args.size_mb * 1024 * 1024 / 4))

    # The input comes from the host, so no rank's value is baked into its graph as a
    # constant: every rank traces the same graph (clone + all-reduce), and under XLA it is
    # compiled once, by the correctness check below, before anything is timed.
    source = torch.full((elements,), float(rank + 1), dtype=torch.float32).to(device)

    def all_reduce() -> torch.Tensor:
        tensor = source.clone()
        dist.all_reduce(tensor)
        if xla:
            torch_xla.sync()
        return tensor

    try:
        result = all_reduce().cpu()
        expected = world * (world + 1) / 2
        if not torch.all(result == expected):
            print(
                f"collective check: rank {rank} got {result[0].item()} instead of {expected}",
                file=sys.stderr,
            )
            return 1
        all_reduce().cpu()  # warm-up: nothing left to compile or connect inside the timing
        start = time.perf_counter()
        for _ in range(args.iters):
            last = all_reduce()
        last.cpu()  # waits for the device (XLA runs asynchronously)
        seconds = (time.perf_counter() - start) / max(args.iters, 1)
        if rank == 0:
            size = elements * 4
            algbw = size / seconds / 1e9
            report = {
                "event": "collective",
                "backend": "xla" if xla else "gloo",
                "world_size": world,
                "nodes": int(os.environ.get("GROUP_WORLD_SIZE", "1")),
                "bytes": size,
                "seconds": round(seconds, 6),
                "algbw_gbps": round(algbw, 3),
                "busbw_gbps": round(algbw * 2 * (world - 1) / world, 3),
            }
            print(json.dumps(report), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
