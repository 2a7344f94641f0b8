"""Preflight's all-reduce across every process of every node (preflight.sh runs it under
torchrun once the nodes have agreed to: agreement.py): all-reduces a tensor, checks the sum,
and reports the bandwidth. On Trainium it goes through torch-xla's "xla" process group
(Neuron collectives over EFA: the path training uses); elsewhere through gloo on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path


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
