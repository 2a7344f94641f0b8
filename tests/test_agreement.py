"""scripts/node/agreement.py: preflight's agreement over real sockets, at 1,024 nodes, with
nodes that come up before node 0, with junk on its port, and with a node 0 that is not there
or ends without a verdict. The verdict's wording is tested through preflight
(tests/test_preflight.py) and the rehearsals."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from scripts.node.agreement import NoVerdict, Unreachable, ask, serve, verdict, verdict_lines
from tests.node_support import NODE, free_ports

SOFTWARE = "version=0123456789abcdef launch-template-version=3 ami=ami-1 neuron=2.29.1"


def report(rank: int, failures: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"address": f"10.1.{rank // 256}.{rank % 256}", "software": SOFTWARE,
            "failures": list(failures)}  # fmt: skip


class Node0:
    """serve() in a thread; `decision` once it has answered."""

    def __init__(self, port: int, nodes: int, timeout: float = 120) -> None:
        self.listening = threading.Event()
        self.decision: dict[str, Any] | None = None
        self.thread = threading.Thread(target=self._run, args=(port, nodes, timeout), daemon=True)
        self.thread.start()
        assert self.listening.wait(60), "node 0 never listened"

    def _run(self, port: int, nodes: int, timeout: float) -> None:
        self.decision = serve(
            port, nodes, report(0), verdict, timeout=timeout, ready=self.listening.set
        )

    def result(self) -> dict[str, Any]:
        self.thread.join(180)
        assert self.decision is not None, "node 0 gave no verdict"
        return self.decision


@pytest.fixture
def descriptors() -> Iterator[None]:
    """Room for 1,024 nodes' connections, both ends, in this one process: preflight raises the
    soft limit to the hard one the same way (check_open_files)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * 1024 + 256
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.fail(f"the open-file hard limit {hard} is below the {needed} this test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class Asking:
    """Nodes asking node 0 on `port`, one thread each (small stacks: a thousand of them), and
    what each got: the verdict, or the Unreachable or NoVerdict it raised."""

    def __init__(self, port: int, checks: Callable[[int], tuple[str, ...]]) -> None:
        self.port, self.checks = port, checks
        self.answers: dict[int, Any] = {}
        self.threads: list[threading.Thread] = []

    def start(self, ranks: range) -> None:
        threading.stack_size(256 * 1024)
        try:
            for rank in ranks:
                self.threads.append(threading.Thread(target=self._ask, args=(rank,)))
                self.threads[-1].start()
        finally:
            threading.stack_size(0)

    def _ask(self, rank: int) -> None:
        mine = report(rank, self.checks(rank))
        try:
            self.answers[rank] = ask(
                "127.0.0.1", self.port, rank, mine, timeout=120, answer_timeout=180
            )
        except (Unreachable, NoVerdict) as error:
            self.answers[rank] = error

    def joined(self) -> dict[int, Any]:
        for thread in self.threads:
            thread.join(180)
        return self.answers


def test_1024_nodes_agree_half_of_them_up_before_node_0(descriptors: None) -> None:
    """1,023 nodes ask node 0 at once, 511 of them before it listens (they retry after 0.5
    to 1.5 s): every node gets the same verdict, with the one node that failed a local
    check named, and nobody missing."""
    nodes, port = 1024, free_ports(1)
    asking = Asking(port, lambda rank: ("efa",) if rank == 700 else ())
    asking.start(range(1, 512))
    node0 = Node0(port, nodes)
    asking.start(range(512, nodes))
    decision = node0.result()
    answers = asking.joined()
    assert decision["missing"] == []
    assert decision["failed"] == [[700, "10.1.2.188", "efa"]]
    assert decision["software"] == f"PASS node-software: {SOFTWARE} on all 1024 nodes"
    assert sorted(answers) == list(range(1, nodes))
    assert all(answer == decision for answer in answers.values()), {
        rank: answer for rank, answer in answers.items() if answer != decision
    }


def test_the_verdict_stays_small_when_all_1024_nodes_failed(descriptors: None) -> None:
    """Every node failed the same six checks: the verdict names 8 of them and counts the
    rest, so that it stays a few KiB (node 0 sends it to every node). It carried every failed
    node before: 80 KB here, sent to each of 1,023 nodes (80 MB out of node 0's one process),
    and growing with the fleet past the 64 KiB line a node reads."""
    nodes, port = 1024, free_ports(1)
    checks = ("efa", "storage", "disk", "nccom-local", "open-files", "neuron-release")
    asking = Asking(port, lambda rank: checks)
    asking.start(range(1, nodes))
    decision = serve(port, nodes, report(0, checks), verdict, timeout=120)
    answers = asking.joined()
    wrong = {rank: answer for rank, answer in answers.items() if answer != decision}
    example = next(iter(wrong.values()), None)
    assert not wrong, f"{len(wrong)} nodes got no verdict or another, e.g. {example!r}"
    assert len(json.dumps(decision)) < 4096
    assert decision["failed_count"] == nodes and len(decision["failed"]) == 9
    lines, status = verdict_lines(decision, 700, True, 60)
    assert status == 1
    assert lines[1] == (
        "FAIL collective: not run: failed local checks on "
        + "; ".join(f"node {rank} ({report(rank)['address']}): {' '.join(checks)}"
                    for rank in range(8))
        + "; and 1015 more"
    )  # fmt: skip


def test_junk_on_node_0s_port_is_closed_unanswered() -> None:
    """Connections that send something else (not JSON, a rank out of range, a report missing
    a field, a line longer than 64 KiB) are closed without an answer, and the nodes agree."""
    port = free_ports(1)
    node0 = Node0(port, 3)
    junk = [
        b"GET / HTTP/1.1\r\n\r\n",
        json.dumps({"rank": 3, "report": report(3)}).encode() + b"\n",
        json.dumps({"rank": 1, "report": {"address": "x"}}).encode() + b"\n",
        b"x" * (1 << 17),
    ]
    connections = []
    for message in junk:
        connection = socket.create_connection(("127.0.0.1", port), timeout=60)
        with contextlib.suppress(ConnectionError):  # node 0 may close before the last byte
            connection.sendall(message)
        connections.append(connection)
    for connection in connections:
        # Closed by node 0, no verdict (a reset where it closed with data unread).
        with contextlib.suppress(ConnectionResetError):
            assert connection.recv(1024) == b""
        connection.close()
    answers: dict[int, Any] = {}

    def node(rank: int) -> None:
        answers[rank] = ask("127.0.0.1", port, rank, report(rank), timeout=60, answer_timeout=60)

    threads = [threading.Thread(target=node, args=(rank,)) for rank in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    decision = node0.result()
    assert decision["missing"] == [] and answers == {1: decision, 2: decision}


def test_a_node_that_never_reports_is_named_once_node_0_stops_waiting() -> None:
    port = free_ports(1)
    answers: list[Any] = []
    # Node 1 first, knocking until node 0 listens: there well within node 0's 5 s.
    node1 = threading.Thread(
        target=lambda: answers.append(
            ask("127.0.0.1", port, 1, report(1), timeout=60, answer_timeout=60)
        )
    )
    node1.start()
    node0 = Node0(port, 3, timeout=5)
    node1.join(120)
    assert answers == [node0.result()]
    assert answers[0]["missing"] == [2]


def test_node_0_not_there_and_node_0_ending_without_a_verdict() -> None:
    port = free_ports(1)
    with pytest.raises(Unreachable, match="Connection refused"):
        ask("127.0.0.1", port, 1, report(1), timeout=1, answer_timeout=1)
    with socket.create_server(("127.0.0.1", port)) as server:

        def close_at_once() -> None:
            server.accept()[0].close()

        closer = threading.Thread(target=close_at_once)
        closer.start()
        # Closed unanswered: an end of file, or a reset where our report was still unread.
        with pytest.raises(NoVerdict, match=r"closed the connection|reset"):
            ask("127.0.0.1", port, 1, report(1), timeout=60, answer_timeout=60)
        closer.join(60)


def test_the_agreement_imports_no_torch() -> None:
    """What the change from a torch TCPStore was for: a node's agreement process never loads
    torch (2 CPU-s and more per node and preflight)."""
    port = free_ports(1)
    probe = (
        "import runpy, sys\n"
        f"sys.argv = ['agreement.py', '--master-addr', '127.0.0.1', '--port', '{port}',"
        " '--node-rank', '0', '--nodes', '1', '--node-address', '127.0.0.1']\n"
        "try:\n"
        f"    runpy.run_path({str(NODE / 'agreement.py')!r}, run_name='__main__')\n"
        "except SystemExit as end:\n"
        "    print('status', end.code, 'torch' in sys.modules)\n"
    )
    software = ("SOFTWARE_VERSION", "LAUNCH_TEMPLATE_VERSION", "AMI_ID", "NEURON_SOFTWARE")
    env = {name: value for name, value in os.environ.items() if name not in software}
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False,
        env=env,
    )  # fmt: skip
    assert result.stdout.splitlines() == [
        "PASS node-software: version=unknown launch-template-version=unknown ami=unknown "
        "neuron=unknown on all 1 nodes",
        "status 0 False",
    ], result.stderr


# Node 0 in a process of its own with a soft open-file limit of 64 (Run Command's is 1024,
# preflight raises it: check_open_files), for 100 nodes.
CRAMPED_NODE_0 = """
import json, resource, sys
from scripts.node.agreement import serve, verdict
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
own = {"address": "10.1.0.0", "software": "s", "failures": []}
print(json.dumps(serve(int(sys.argv[1]), 100, own, verdict, timeout=float(sys.argv[2]))))
"""


def test_node_0_out_of_descriptors_names_the_nodes_it_could_not_take_in(
    descriptors: None,
) -> None:
    """Where node 0's process runs out of descriptors it says so once (no busy loop on the
    listening socket), stops taking connections, and names the nodes it could not hear from
    as missing: the verdict that every node it did hear from gets."""
    port = free_ports(1)
    answers: dict[int, Any] = {}

    def node(rank: int) -> None:
        try:
            mine = {"address": f"10.1.0.{rank}", "software": "s", "failures": []}
            answers[rank] = ask("127.0.0.1", port, rank, mine, timeout=60, answer_timeout=60)
        except NoVerdict as error:
            answers[rank] = error

    # The nodes first, knocking until node 0 listens, so that they are all there well within
    # its 10 s.
    threads = [threading.Thread(target=node, args=(rank,)) for rank in range(1, 100)]
    for thread in threads:
        thread.start()
    node0 = subprocess.Popen(
        [sys.executable, "-c", CRAMPED_NODE_0, str(port), "10"], cwd=NODE.parent.parent,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    for thread in threads:
        thread.join(120)
    out, err = node0.communicate(timeout=120)
    decision = json.loads(out)
    heard = [rank for rank, answer in answers.items() if isinstance(answer, dict)]
    unheard = set(range(1, 100)) - set(heard)
    assert 0 < len(heard) < 64 and decision["missing_count"] == len(unheard)
    assert len(decision["missing"]) == 8 and set(decision["missing"]) <= unheard
    assert all(answers[rank] == decision for rank in heard)
    assert (
        err.count("agreement: node 0 accepts no more connections: [Errno 24] Too many open files")
        == 1
    ), err
