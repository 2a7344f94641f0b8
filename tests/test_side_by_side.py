"""Two test runs (or two rehearsals) on one machine never touch each other's jobs.

The node scripts and the tests find a job's processes by their tags in every process of the
machine: TRAINIUM_JOB_ID (stop.sh, hosts.job_processes) and TRAINIUM_NODE_ADDRESS (launch.sh
first stops whatever any job left on its node address: scripts/node/lib.sh job_pids "*";
LoopbackHosts.kill ends every process tagged with a node's address; a scale rehearsal's node
death those tagged with its address in its state folder). Loopback nodes share the machine's
ports. So each run's job IDs, node addresses and ports must be its own.
"""

from __future__ import annotations

import itertools
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.cluster_lib.arguments import JOB_ID
from scripts.rehearsal import ports
from scripts.rehearsal.direct import PREFLIGHT_PORT_OFFSETS, Rehearsal
from scripts.rehearsal.fleet import SimulatedAgents, SimulatedHosts, SimulatedInstances
from scripts.rehearsal.hosts import LoopbackHosts, job_processes
from tests.node_support import (
    NODE,
    NODE_ADDRESS,
    REPO_ROOT,
    FakeNode,
    _process_address,
    loopback_address,
    tagged,
    unique_job_id,
)


@pytest.fixture
def other_run() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes standing for another run's job; whatever is left is ended at the end."""
    processes: list[subprocess.Popen[str]] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def test_a_job_name_gives_each_test_run_an_id_of_its_own_that_launch_accepts(
    tmp_path: Path, other_run: list[subprocess.Popen[str]]
) -> None:
    """Two runs of one test name the same job; stop.sh in the one (no --node-address: all of
    the machine's processes of the job ID) leaves the other's job running."""
    theirs, ours = unique_job_id("saving"), unique_job_id("saving")
    assert theirs != ours and theirs.startswith("saving-")
    # launch.sh's pattern (scripts/node/lib.sh JOB_ID_PATTERN, the CLI's arguments.JOB_ID).
    assert JOB_ID.fullmatch(unique_job_id("x" * 55))
    with pytest.raises(ValueError, match="is not a job ID"):
        unique_job_id("x" * 56)
    other_run.append(tagged(theirs, loopback_address()))
    node = FakeNode(tmp_path)
    result = node.run("stop.sh", "--job-id", ours, "--grace", "2")
    assert result.returncode == 0, result.stderr
    assert f"job {ours} has no running processes on this node" in result.stderr
    assert other_run[0].poll() is None
    assert job_processes(ours) == [] and job_processes(theirs) == [other_run[0].pid]


def test_a_test_nodes_loopback_address_is_its_own(
    tmp_path: Path, other_run: list[subprocess.Popen[str]]
) -> None:
    """launch.sh stops whatever any job left on its node address before it starts: a test
    node's launch must not reach another run's job, which sat on 127.0.0.1 before."""
    addresses = {loopback_address() for _ in range(20)}
    assert len(addresses) > 1
    assert all(a.startswith("127.") and not a.startswith("127.0.") for a in addresses)
    node = FakeNode(tmp_path)
    (tmp_path / "other").mkdir()
    other = FakeNode(tmp_path / "other")
    assert other.loopback != node.loopback
    # The other run's job carries this node's state directory too: only the address tells
    # it apart.
    other_run.append(tagged(unique_job_id("theirs"), other.loopback, state=node.state))
    ours = tagged(unique_job_id("left-over"), node.loopback, state=node.state)
    try:
        result = node.run("launch.sh", "--hosts", node.loopback, "--job-id", unique_job_id("j"),
                          "--nproc-per-node", "1", FAKE_LOOPBACK=node.loopback)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert ours.wait(timeout=60) == -signal.SIGTERM
        assert other_run[0].poll() is None, "launch.sh stopped another node's job"
    finally:
        if ours.poll() is None:
            ours.kill()
        ours.wait(timeout=10)


def test_two_loopback_rehearsals_have_addresses_of_their_own(
    other_run: list[subprocess.Popen[str]],
) -> None:
    """A node's death in one loopback rehearsal (LoopbackHosts.kill: every process tagged with
    the node's address) leaves the other rehearsal's node alone."""
    blocks = {LoopbackHosts(2).addresses[0] for _ in range(20)}
    assert len(blocks) > 1, blocks
    first = LoopbackHosts(3)
    second = LoopbackHosts(3)
    while second.addresses[0] == first.addresses[0]:  # one draw in 65,024
        second = LoopbackHosts(3)
    assert first.addresses[1:] == [first.addresses[0][:-1] + n for n in ("2", "3")]
    other_run.append(tagged(unique_job_id("theirs"), first.addresses[0]))
    second.kill(0)
    assert other_run[0].poll() is None, "one rehearsal's node death killed the other's"
    first.kill(0)
    assert other_run[0].wait(timeout=30) == -signal.SIGKILL


def test_two_scale_rehearsals_have_addresses_of_their_own() -> None:
    """The simulated fleet's nodes that run launch.sh for real (and a node's death) find
    processes by node address too."""
    networks = {SimulatedHosts(1024).addresses[0].rsplit(".", 2)[0] for _ in range(10)}
    assert len(networks) > 1, networks
    hosts = SimulatedHosts(1024)
    assert len(set(hosts.addresses)) == 1024
    assert all(a.startswith(hosts.network + ".") for a in hosts.addresses)


def test_a_node_death_in_a_scale_rehearsal_spares_another_on_the_same_network(
    tmp_path: Path, other_run: list[subprocess.Popen[str]]
) -> None:
    """Two scale rehearsals draw their network from 127 (SimulatedHosts): one in 127 that two
    side by side share it, and then their nodes share addresses. A node's death
    (SimulatedAgents.die) kills the processes tagged with the node's address in the node's
    own state folder only; the other rehearsal's node at the same address lives on. Before,
    the death killed every process tagged with the address."""
    hosts = SimulatedHosts(1)
    instances = SimulatedInstances(hosts, tmp_path / "fleet", itertools.count(1))
    instances.real_slots = frozenset({0})
    (victim,) = instances.instances
    instances.lay_out_real(victim)
    agents = SimulatedAgents(instances)
    other_run.append(
        tagged(unique_job_id("theirs"), victim.address, state=tmp_path / "theirs" / "state")
    )
    ours = tagged(unique_job_id("ours"), victim.address, state=victim.root / "state")
    try:
        agents.die(victim)
        assert ours.wait(timeout=30) == -signal.SIGKILL
        assert other_run[0].poll() is None, "a node's death killed another rehearsal's node"
    finally:
        agents.close()
        if ours.poll() is None:
            ours.kill()
        ours.wait(timeout=10)


def test_the_loopback_rehearsals_ports_are_below_the_ephemeral_range(tmp_path: Path) -> None:
    """Binding port 0 takes a port of the ephemeral range
    (/proc/sys/net/ipv4/ip_local_port_range), which the kernel also hands to outgoing
    connections and which successive binds walk through: the master port and preflight's
    come from below it, free when chosen, and never twice from one process."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    chosen = []
    for _ in range(10):
        rehearsal = Rehearsal(LoopbackHosts(2), tmp_path / "r", echo=None)
        chosen.append(rehearsal.master_port)
        assert rehearsal.master_port >= ports.LOWEST
        assert rehearsal.master_port + max(PREFLIGHT_PORT_OFFSETS) < low
    assert len(set(chosen)) == len(chosen), chosen
    fixed = Rehearsal(LoopbackHosts(2), tmp_path / "n", echo=None, master_port=29500)
    assert fixed.master_port == 29500


def test_a_port_in_use_is_never_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """The free-port check binds every port the caller needs: one another run listens on is
    passed over."""
    with socket.socket() as busy:
        busy.bind(("", 0))
        taken = busy.getsockname()[1]
        busy.listen()
        draws = iter([taken - 1, taken - 1, taken + 5])
        monkeypatch.setattr(ports, "ephemeral_low", lambda: 65535)
        monkeypatch.setattr(ports._random, "randrange", lambda *_: next(draws))
        assert ports.free_port(1) == taken + 5


#: The folders the node scripts write by default outside a test's own (a node's /var).
NODE_DEFAULTS = re.compile(r"\$\{(TRAINIUM_[A-Z_]+):-(/var/[^}]*)\}")


def node_folders() -> dict[str, str]:
    """Every TRAINIUM_* variable whose default is a folder under /var, in scripts/node/*.sh."""
    found: dict[str, str] = {}
    for script in sorted(NODE.glob("*.sh")):
        found.update(NODE_DEFAULTS.findall(script.read_text()))
    return found


def test_test_nodes_and_rehearsal_nodes_write_only_their_own_folders(tmp_path: Path) -> None:
    """The caches, state, logs and the precompile scratch of a node (/var/cache, /var/lib,
    /var/log, /var/tmp on a real one) are the test node's or the rehearsal's own, never
    the machine's, which another run would share."""
    folders = node_folders()
    assert {"TRAINIUM_STATE_DIR", "TRAINIUM_ENV_CACHE", "TRAINIUM_PRECOMPILE_DIR"} <= set(folders)
    (tmp_path / "node").mkdir()
    node_env = FakeNode(tmp_path / "node").env()
    rehearsal_env = Rehearsal(LoopbackHosts(1), tmp_path / "r", echo=None).env
    for name, env, root in (("FakeNode", node_env, tmp_path / "node"),
                            ("Rehearsal", rehearsal_env, tmp_path / "r")):  # fmt: skip
        for variable, default in folders.items():
            assert variable in env, f"{name} leaves {variable} at {default}"
            assert Path(env[variable]).is_relative_to(root), (name, variable, env[variable])


def test_each_test_process_has_a_node_address_of_its_own() -> None:
    """The node scripts' tests (tests/test_launch_scripts.py) run launch.sh on a node at
    NODE_ADDRESS, drawn once per test process: two runs, or two pytest-xdist workers, each
    launch on an address of their own, where all launched on 10.1.0.12 before."""
    drawn = {_process_address() for _ in range(20)}
    assert len(drawn) > 1, drawn
    assert all(re.fullmatch(r"10\.2\.\d+\.\d+", a) for a in drawn | {NODE_ADDRESS}), drawn
    found = subprocess.run(
        [sys.executable, "-c", "from tests.node_support import NODE_ADDRESS; print(NODE_ADDRESS)"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=120,
    ).stdout.strip()  # fmt: skip
    assert re.fullmatch(r"10\.2\.\d+\.\d+", found), found
