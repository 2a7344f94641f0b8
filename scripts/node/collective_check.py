"""The cross-node checks preflight.sh runs on every node, in two steps.

`--agree` (one process per node, before anything else): the nodes agree on whether to run the
all-reduce at all. Every node, whether its local checks passed or not, puts its address, its
software (SOFTWARE_VERSION, LAUNCH_TEMPLATE_VERSION, AMI_ID, and NEURON_SOFTWARE: the versions
of its Neuron release; 'unknown' where unset) and the
names of its failed local checks into a torch TCPStore on the first host, waits until every
node has done so (at most --timeout seconds), and all reach the same verdict from the same
data: `FAIL node-software:` naming who runs what (exit 4: the fleet needs a roll; the supervisor
only sees exit codes, so the nodes themselves must refuse a mixed fleet), else `PASS
node-software: ...` and, where some node failed its local checks, `FAIL collective:` naming it
(exit 1), so that no node starts an all-reduce that a broken peer would leave hanging until
the rendezvous and process-group time-outs (torchrun's static rendezvous waits 600 s,
torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py). A node that never reports
(its preflight could not run Python) is named after --timeout seconds. One connection per
node to the first host, no process group: no gloo full mesh over all ranks.

Without `--agree` (under torchrun, once every node agreed): all-reduces a tensor across every
process of every node, checks the sum, and reports the bandwidth. On Trainium it goes through
torch-xla's "xla" process group (Neuron collectives over EFA: the path training uses);
elsewhere through gloo on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

#: The node's software: the first three bootstrap writes into node.env (scripts/node/lib.sh);
#: NEURON_SOFTWARE is preflight's reading of the Neuron release (torch-neuronx, neuronx-cc,
#: libneuronxla, runtime, driver: neuron_release.py versions).
SOFTWARE_FIELDS = (
    ("version", "SOFTWARE_VERSION"),
    ("launch-template-version", "LAUNCH_TEMPLATE_VERSION"),
    ("ami", "AMI_ID"),
    ("neuron", "NEURON_SOFTWARE"),
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
    """`version=... launch-template-version=... ami=... neuron=...`: what the nodes compare."""
    return " ".join(f"{name}={os.environ.get(var) or 'unknown'}" for name, var in SOFTWARE_FIELDS)


def software_verdict(nodes: dict[tuple[int, str], str], limit: int = 8) -> str:
    """The node-software line for every node's (rank, address) -> software, starting with
    PASS or FAIL. The FAIL line names the nodes of each software, at most `limit` per
    software (SSM shows 24,000 characters of output)."""
    software = sorted(set(nodes.values()))
    if len(software) == 1:
        return f"PASS node-software: {software[0]} on all {len(nodes)} nodes"
    groups: dict[str, list[str]] = {}
    for (rank, host), sw in sorted(nodes.items()):
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


def verdict(reports: dict[int, dict[str, Any]], missing: list[int]) -> dict[str, Any]:
    """What the first node tells every node: the node-software line, the nodes that failed
    their local checks ([rank, address, checks]) and those that never reported."""
    software = software_verdict(
        {(rank, report["address"]): report["software"] for rank, report in reports.items()}
    )
    failed = [
        [rank, report["address"], " ".join(dict.fromkeys(report["failures"]))]
        for rank, report in sorted(reports.items())
        if report["failures"]
    ]
    return {"software": software, "failed": failed, "missing": missing}


def verdict_lines(
    decision: dict[str, Any], own_rank: int, timeout: int, limit: int = 8
) -> tuple[list[str], int]:
    """The lines this node prints and its exit status."""
    missing = [str(rank) for rank in decision["missing"]]
    if missing:
        more = f" and {len(missing) - limit} more" if len(missing) > limit else ""
        return [
            f"FAIL collective: not run: node {', '.join(missing[:limit])}{more} did not report "
            f"within {timeout} s (its preflight did not start or could not run Python)"
        ], 1
    lines = [decision["software"]]
    if decision["software"].startswith("FAIL"):
        return lines, SOFTWARE_MISMATCH_STATUS
    failed = [f"node {r} ({a}): {checks}" for r, a, checks in decision["failed"] if r != own_rank]
    if failed:
        more = f"; and {len(failed) - limit} more" if len(failed) > limit else ""
        lines.append(
            f"FAIL collective: not run: failed local checks on {'; '.join(failed[:limit])}{more}"
        )
        return lines, 1
    return lines, 0


def agree(args: argparse.Namespace) -> int:
    """The `--agree` step (see the module's docstring); prints its verdict lines. The first
    node reads every report and writes one verdict that all read: O(nodes) requests and bytes
    at the store, not O(nodes squared)."""
    from torch.distributed import TCPStore

    # torch raises DistNetworkError (cannot connect) and DistStoreError (wait timed out), both
    # RuntimeErrors (torch/distributed/__init__.py).
    timeout = timedelta(seconds=args.timeout)
    keys = [f"node/{rank}" for rank in range(args.nodes)]
    first = args.node_rank == 0
    try:
        # The first node serves the store; the others retry connecting until the timeout.
        store = TCPStore(
            args.master_addr, args.port, world_size=args.nodes, is_master=first,
            timeout=timeout, wait_for_workers=False,
        )  # fmt: skip
    except RuntimeError as error:
        print(
            f"FAIL collective: not run: could not reach node 0 ({args.master_addr}:{args.port}) "
            f"within {args.timeout} s: {str(error).splitlines()[0]}",
            flush=True,
        )
        return 1
    report = {
        "address": args.node_address,
        "software": node_software(),
        "failures": args.failures.split(),
    }
    store.set(keys[args.node_rank], json.dumps(report))
    if first:
        with contextlib.suppress(RuntimeError):
            store.wait(keys, timeout)
        present = [rank for rank, key in enumerate(keys) if store.check([key])]
        missing = [rank for rank in range(args.nodes) if rank not in present]
        # multi_get is TCPStore's (torch/csrc/distributed/c10d/Store.hpp); torch's type stub
        # (torch/_C/_distributed_c10d.pyi) does not list it.
        values = store.multi_get([keys[rank] for rank in present])  # type: ignore[attr-defined]
        reports = {rank: json.loads(value) for rank, value in zip(present, values, strict=True)}
        decision = verdict(reports, missing)
        store.set("verdict", json.dumps(decision))
        # The store lives in this process: serve until every node that reported has read the
        # verdict (bounded: a node that dies now does not hold this one).
        with contextlib.suppress(RuntimeError):
            store.wait([f"done/{rank}" for rank in present if rank], timedelta(seconds=60))
    else:
        try:
            store.wait(["verdict"], timeout + timedelta(seconds=60))
        except RuntimeError:
            print(
                f"FAIL collective: not run: node 0 ({args.master_addr}) gave no verdict within "
                f"{args.timeout + 60} s",
                flush=True,
            )
            return 1
        decision = json.loads(store.get("verdict"))
        store.set(f"done/{args.node_rank}", "1")
    lines, status = verdict_lines(decision, args.node_rank, args.timeout)
    for line in lines:
        print(line, flush=True)
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=("auto", "cpu", "xla"), default="auto")
    parser.add_argument("--size-mb", type=float, default=64.0, help="all-reduce size per process")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout", type=int, default=300, help="seconds to wait for peers")
    agreement = parser.add_argument_group("the agreement step (one process per node)")
    agreement.add_argument("--agree", action="store_true", help="run the agreement step")
    agreement.add_argument("--master-addr", help="the first node's address (serves the store)")
    agreement.add_argument("--port", type=int, help="the store's TCP port on the first node")
    agreement.add_argument("--node-rank", type=int, help="this node's index in the host list")
    agreement.add_argument("--nodes", type=int, help="how many nodes take part")
    agreement.add_argument("--node-address", help="this node's address, for the verdict lines")
    agreement.add_argument(
        "--failures", default="", help="names of this node's failed local checks, space separated"
    )
    args = parser.parse_args()
    if args.agree:
        needed = ("master_addr", "port", "node_rank", "nodes", "node_address")
        missing = [f"--{name.replace('_', '-')}" for name in needed if getattr(args, name) is None]
        if missing:
            parser.error(f"--agree needs {' '.join(missing)}")
        if not 0 <= args.node_rank < args.nodes:
            parser.error(f"--node-rank {args.node_rank} is not in 0..{args.nodes - 1}")
        return agree(args)

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
