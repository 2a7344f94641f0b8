"""Preflight's agreement (one process per node, before the all-reduce): the nodes agree on
whether to run the all-reduce at all.

    python3 agreement.py --master-addr <node 0> --port <port> --node-rank <k> --nodes <n>
        --node-address <this node> [--failures "<check> ..."] [--timeout <s>]

Every node, whether its local checks passed or not, sends node 0 its address, its software
(SOFTWARE_VERSION, LAUNCH_TEMPLATE_VERSION, AMI_ID, and NEURON_SOFTWARE: the versions of its
Neuron release; 'unknown' where unset) and the names of its failed local checks. Node 0 waits
until every node has (at most --timeout seconds), decides once, and answers every node with
the same verdict: `FAIL node-software:` naming who runs what (exit 4: the fleet needs a roll;
the supervisor only sees exit codes, so the nodes themselves must refuse a mixed fleet), else
`PASS node-software: ...` and, where some node failed its local checks, `FAIL collective:`
naming it (exit 1), so that no node starts an all-reduce that a broken peer would leave
hanging until the rendezvous and process-group time-outs (torchrun's static rendezvous waits
600 s, torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py). A node that never
reports (its preflight could not run Python) is named after --timeout seconds.

The exchange: one line of JSON each way over one TCP connection per node to node 0, no process
group (no gloo full mesh over all ranks), the standard library only. It was a torch TCPStore,
the same exchange, but every node paid an `import torch` for it: 2 CPU-s and more per node
and preflight (`/usr/bin/time python -c "import torch"`, torch 2.9), for a dozen lines of
sockets.

    node k > 0                                  node 0 (serve)
    connect, retried until the timeout  ---->   accepts every node's connection
    {"rank": k, "report": {...}}\\n       ---->   until every rank reported or the timeout
                                         <----   {"software": ..., "failed": ..., ...}\\n

At scale: node 0 holds one connection per node until it answers, so its process needs nodes +
a few descriptors (preflight raises the soft RLIMIT_NOFILE, 1024 under Run Command, to the
hard limit first: check_open_files), and the kernel queues at most `backlog` connections not
yet accepted (listen(2), capped by net.core.somaxconn: 4096 since Linux 5.4): the backlog is
the node count. The nodes retry a refused connection after 0.5 to 1.5 s, drawn at random, so
that a thousand nodes that come up before node 0 do not knock all at once. The verdict names
at most 8 nodes of each kind, as the nodes print them, and counts the rest: a few KiB to send
to every node, whatever their number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import selectors
import socket
import sys
import time
from collections.abc import Callable
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


#: The longest line either side reads: a report is about 300 bytes, a verdict a few KiB
#: (the verdict names at most 8 nodes per software and per failure).
MAX_LINE = 1 << 16
#: A node's pause between connection attempts, drawn at random from this range.
RETRY_S = (0.5, 1.5)

Report = dict[str, Any]
Decide = Callable[[dict[int, Report], list[int]], dict[str, Any]]


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
    runs = "; ".join(parts[:limit])
    if len(parts) > limit:
        runs += f"; and {len(parts) - limit} more versions"
    return (
        f"FAIL node-software: the nodes run different software: {runs}: roll the fleet so "
        "that every node runs the current launch template (python scripts/cluster.py roll, "
        "see the README)"
    )


def verdict(
    reports: dict[int, dict[str, Any]], missing: list[int], limit: int = 8
) -> dict[str, Any]:
    """What the first node tells every node: the node-software line, the first nodes that
    failed their local checks ([rank, address, checks]) and that never reported, and how many
    of each there are. Only as many as a node prints (`limit`, one more for the node itself),
    so that the verdict stays a few KiB at any node count: node 0 sends it to every node."""
    software = software_verdict(
        {(rank, report["address"]): report["software"] for rank, report in reports.items()},
        limit,
    )
    failed = [
        [rank, report["address"], " ".join(dict.fromkeys(report["failures"]))]
        for rank, report in sorted(reports.items())
        if report["failures"]
    ]
    return {
        "software": software,
        "failed": failed[: limit + 1],
        "failed_count": len(failed),
        "missing": missing[:limit],
        "missing_count": len(missing),
    }


def verdict_lines(
    decision: dict[str, Any], own_rank: int, own_failed: bool, timeout: int, limit: int = 8
) -> tuple[list[str], int]:
    """The lines this node prints and its exit status (`own_failed`: this node failed a local
    check, so it is one of the verdict's failed_count)."""
    if decision["missing_count"]:
        missing = [str(rank) for rank in decision["missing"][:limit]]
        left = decision["missing_count"] - len(missing)
        more = f" and {left} more" if left > 0 else ""
        return [
            f"FAIL collective: not run: node {', '.join(missing)}{more} did not report "
            f"within {timeout} s (its preflight did not start or could not run Python)"
        ], 1
    lines = [decision["software"]]
    if decision["software"].startswith("FAIL"):
        return lines, SOFTWARE_MISMATCH_STATUS
    others = [entry for entry in decision["failed"] if entry[0] != own_rank][:limit]
    if others:
        failed = [f"node {r} ({a}): {checks}" for r, a, checks in others]
        left = decision["failed_count"] - int(own_failed) - len(others)
        more = f"; and {left} more" if left > 0 else ""
        lines.append(f"FAIL collective: not run: failed local checks on {'; '.join(failed)}{more}")
        return lines, 1
    return lines, 0


class Unreachable(Exception):
    """Node 0 could not be reached before the timeout; the message is the last error."""


class NoVerdict(Exception):
    """Node 0 was reached but gave no verdict (it ended, or it took too long)."""


def valid_report(report: object) -> bool:
    return (
        isinstance(report, dict)
        and isinstance(report.get("address"), str)
        and isinstance(report.get("software"), str)
        and isinstance(report.get("failures"), list)
        and all(isinstance(name, str) for name in report["failures"])
    )


def _rank_and_report(line: bytes, nodes: int) -> tuple[int, Report] | None:
    try:
        message = json.loads(line)
    except ValueError:
        return None
    if not isinstance(message, dict):
        return None
    rank, report = message.get("rank"), message.get("report")
    if type(rank) is not int or not 0 < rank < nodes or not valid_report(report):
        return None
    assert isinstance(report, dict)
    return rank, report


def serve(
    port: int, nodes: int, own: Report, decide: Decide, *, timeout: float,
    ready: Callable[[], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Node 0: collects the reports of nodes 1..nodes-1 until all have come or `timeout`
    seconds have passed, decides, and sends the verdict to every node that reported. A
    connection that sends anything but one valid report line is closed unanswered. `ready`
    is called once the port listens."""
    reports: dict[int, Report] = {0: own}
    answer: dict[socket.socket, int] = {}
    pending: dict[socket.socket, bytearray] = {}
    deadline = time.monotonic() + timeout
    with socket.create_server(("", port), backlog=max(nodes, 16)) as server, \
            selectors.DefaultSelector() as selector:  # fmt: skip
        server.setblocking(False)
        selector.register(server, selectors.EVENT_READ)
        if ready is not None:
            ready()
        try:
            while len(reports) < nodes and (left := deadline - time.monotonic()) > 0:
                for key, _ in selector.select(left):
                    if key.fileobj is server:
                        _accept(server, selector, pending)
                        continue
                    connection = key.fileobj
                    assert isinstance(connection, socket.socket)
                    got = _read(connection, pending[connection], nodes)
                    if got is None:
                        continue  # the line is not complete yet
                    selector.unregister(connection)
                    del pending[connection]
                    if isinstance(got, bool):
                        connection.close()
                        continue
                    rank, report = got
                    reports[rank] = report
                    answer[connection] = rank
            decision = decide(reports, [rank for rank in range(nodes) if rank not in reports])
            line = json.dumps(decision).encode() + b"\n"
            for connection in answer:
                connection.settimeout(10)
                # A node that is gone by now learns nothing, as it would from a store.
                with contextlib.suppress(OSError):
                    connection.sendall(line)
        finally:
            for connection in [*answer, *pending]:
                connection.close()
    return decision


def _accept(
    server: socket.socket, selector: selectors.BaseSelector, pending: dict[socket.socket, bytearray]
) -> None:
    while True:
        try:
            connection, _ = server.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:
            # EMFILE and the like: a busy loop if the port stayed registered. The nodes not
            # accepted are named as missing at the timeout.
            print(f"agreement: node 0 accepts no more connections: {error}", file=sys.stderr)
            selector.unregister(server)
            return
        connection.setblocking(False)
        pending[connection] = bytearray()
        selector.register(connection, selectors.EVENT_READ)


def _read(
    connection: socket.socket, buffer: bytearray, nodes: int
) -> tuple[int, Report] | bool | None:
    """The report on `connection` once its line is whole; False when it never will be (the
    peer closed first, sent too much or sent something else); None until then."""
    try:
        data = connection.recv(MAX_LINE)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return False
    if not data:
        return False
    buffer += data
    if b"\n" not in buffer:
        return None if len(buffer) <= MAX_LINE else False
    return _rank_and_report(bytes(buffer.split(b"\n", 1)[0]), nodes) or False


def ask(
    address: str, port: int, rank: int, report: Report, *, timeout: float, answer_timeout: float
) -> dict[str, Any]:
    """Node `rank` > 0: sends its report to node 0 (retrying the connection for up to
    `timeout` seconds) and returns the verdict (waiting up to `answer_timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            connection = socket.create_connection(
                (address, port), timeout=max(1.0, min(10.0, deadline - time.monotonic()))
            )
            break
        except OSError as error:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unreachable(str(error) or type(error).__name__) from error
            time.sleep(min(left, random.uniform(*RETRY_S)))
    with connection:
        try:
            connection.sendall(json.dumps({"rank": rank, "report": report}).encode() + b"\n")
            connection.settimeout(answer_timeout)
            received = bytearray()
            while b"\n" not in received and len(received) <= MAX_LINE:
                data = connection.recv(MAX_LINE)
                if not data:
                    break
                received += data
        except OSError as error:
            raise NoVerdict(str(error) or type(error).__name__) from error
    if b"\n" not in received:
        raise NoVerdict("node 0 closed the connection without one")
    try:
        decision = json.loads(bytes(received.split(b"\n", 1)[0]))
    except ValueError as error:
        raise NoVerdict(f"node 0 answered something else: {error}") from error
    if not valid_decision(decision):
        raise NoVerdict("node 0 answered something else")
    assert isinstance(decision, dict)
    return decision


def valid_decision(decision: object) -> bool:
    return (
        isinstance(decision, dict)
        and isinstance(decision.get("software"), str)
        and isinstance(decision.get("failed"), list)
        and all(isinstance(entry, list) and len(entry) == 3 for entry in decision["failed"])
        and isinstance(decision.get("missing"), list)
        and type(decision.get("failed_count")) is int
        and type(decision.get("missing_count")) is int
    )


def agree(args: argparse.Namespace) -> int:
    """Takes part in the agreement as node args.node_rank; prints the verdict lines and
    returns the exit status."""
    report = {
        "address": args.node_address,
        "software": node_software(),
        "failures": args.failures.split(),
    }
    where = f"node 0 ({args.master_addr}:{args.port})"
    if args.node_rank == 0:
        try:
            decision = serve(args.port, args.nodes, report, verdict, timeout=args.timeout)
        except OSError as error:
            print(f"FAIL collective: not run: {where} could not listen: {error}", flush=True)
            return 1
    else:
        try:
            decision = ask(
                args.master_addr, args.port, args.node_rank, report, timeout=args.timeout,
                answer_timeout=args.timeout + 60,
            )  # fmt: skip
        except Unreachable as error:
            print(
                f"FAIL collective: not run: could not reach {where} within {args.timeout} s: "
                f"{error}",
                flush=True,
            )
            return 1
        except NoVerdict as error:
            print(
                f"FAIL collective: not run: {where} gave no verdict within "
                f"{args.timeout + 60} s: {error}",
                flush=True,
            )
            return 1
    lines, status = verdict_lines(decision, args.node_rank, bool(report["failures"]), args.timeout)
    for line in lines:
        print(line, flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--master-addr", required=True, help="node 0's address")
    parser.add_argument("--port", type=int, required=True, help="node 0's TCP port for it")
    parser.add_argument("--node-rank", type=int, required=True, help="this node's index")
    parser.add_argument("--nodes", type=int, required=True, help="how many nodes take part")
    parser.add_argument("--node-address", required=True, help="this node's address")
    parser.add_argument(
        "--failures", default="", help="names of this node's failed local checks, space separated"
    )
    parser.add_argument("--timeout", type=int, default=300, help="seconds to wait for the nodes")
    args = parser.parse_args(argv)
    if not 0 <= args.node_rank < args.nodes:
        parser.error(f"--node-rank {args.node_rank} is not in 0..{args.nodes - 1}")
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port} is not a TCP port (1..65535)")
    return agree(args)


if __name__ == "__main__":
    sys.exit(main())
