"""The scale rehearsal (scripts/rehearsal/scale.py) at 1,024 nodes, and the node scripts' own
part of a 1,024-node job.

The rehearsal runs one job through the synthesized 1,024-node state machine, the real SSM
documents and the operator CLI on 1,024 simulated nodes (a few of them run the real launch.sh
as the agent starts it, with a stand-in for torchrun), one of which dies once every node
trains: the retry must cancel every batch's command (not only the dead node's batch), wait for
the replacement, preflight and relaunch all 1,024, and the job must finish, with every payload
and history far below Step Functions' quotas.
"""

from __future__ import annotations

import copy
import json
import math
import resource
import subprocess
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from scripts.rehearsal import fleet
from scripts.rehearsal.fleet import SimulatedAgents
from scripts.rehearsal.scale import HISTORY_LIMIT, PAYLOAD_LIMIT, _launched, rehearse
from stacks.supervisor_limits import INVOCATIONS_PAGE, SEND_BATCH, batches
from tests.cdk_support import synth
from tests.node_support import FakeNode, document_command, unique_job_id

NODES = 1024
#: Upper bounds only (every wait in the rehearsal ends on an event): each of its phases (every
#: node launched, launched again after the death, the job's end) and the whole test. The
#: rehearsal is one process whose threads (every execution's states, about a thousand wakes at
#: once) share one core; it took about 160 s alone on 2 cores, 600 to 711 s beside a second
#: `make test`, and more than 900 s (the suite's default bound) in one CI run whose other slow
#: tests took what they take here. A phase that stalls fails by name before the test's bound,
#: and at once where the job has ended (scripts/rehearsal/scale.py `_launched`).
PHASE_BOUND = 600
TEST_BOUND = 2400
#: Ranks a node in the test below: 1,024 x 16 + 1,024 descriptors fit under a hard limit of
#: 20,000 as well as under the agent's 524,288 (systemd's DefaultLimitNOFILE=1024:524288).
RANKS = 16


def _hosts(count: int) -> list[str]:
    """`count` addresses of the longest form (15 characters)."""
    return [f"172.{100 + n // 10_000}.{100 + n // 100 % 100}.{100 + n % 100}" for n in range(count)]


@pytest.mark.parametrize("rank", [0, 511, NODES - 1])
def test_a_node_of_a_1024_node_job_finds_its_rank_and_raises_its_open_file_limit(
    tmp_path: Path, rank: int
) -> None:
    """RunTraining's command line with 1,024 hosts (16,383 characters, the document's Hosts
    maxChars), run as the agent runs it (`sh -c`, soft RLIMIT_NOFILE 1024, the hard limit
    this machine allows): launch.sh finds the node's rank in the host list, starts torchrun
    for 1,024 nodes with the first host as master, and raises the soft limit to the hard one
    for RANKS ranks a node, or refuses in one line where the hard limit is too low."""
    node = FakeNode(tmp_path)
    node.trainium()
    hosts = _hosts(NODES)
    joined = ",".join(hosts)
    assert len(joined) == 16_383
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    values = {"Hosts": joined, "JobId": unique_job_id("scale"), "NprocPerNode": str(RANKS),
              "CodeSnapshot": node.snapshot()}  # fmt: skip
    result = subprocess.run(
        ["sh", "-c", document_command("RunTraining", values)],
        capture_output=True, text=True, timeout=120, check=False,
        env=node.env(FAKE_ADDRESS=hosts[rank]),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard)),
    )  # fmt: skip
    needed = NODES * RANKS + 1024
    if hard != resource.RLIM_INFINITY and hard < needed:
        assert result.returncode == 1
        assert f"the open-file hard limit is {hard}, below the {needed}" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-2000:]
    args = node.torchrun_args()
    assert args[:10] == [
        "--nnodes", str(NODES), "--node_rank", str(rank), "--master_addr", hosts[0],
        "--master_port", "29500", "--nproc_per_node", str(RANKS),
    ]  # fmt: skip
    assert f"soft limit raised from 1024 to {hard} (this job needs about {needed})" in (
        result.stdout + result.stderr
    )


@pytest.mark.slow
@pytest.mark.timeout(TEST_BOUND)
def test_one_job_on_1024_simulated_nodes_survives_a_node_dying(tmp_path: Path) -> None:
    # The session's 1,024-node synth (tests/test_supervisor_scale.py reads the same one).
    cluster = synth(node_count=str(NODES))
    name = cluster.config.cluster_name
    template = copy.deepcopy(cluster.templates["operations"])  # the session's stays as it is
    report = rehearse(NODES, tmp_path, synthesized=(name, template), timeout=PHASE_BOUND)
    print("\n" + "\n".join(report.lines()))
    assert report.final_status == "SUCCEEDED", report.lines()
    # Every wake ended well: one that fails leaves the messages it received unanswered.
    assert "FAILED" not in report.wakes, report.lines()
    # The attempt the death ended, handed over for the retry, and the one that finished.
    assert len(report.executions) == 2, report.executions
    assert report.notifications.count(f"trainium-cluster {name}: job scale-rehearsal retry") <= 1
    # Two attempts, each a Preflight and a RunTraining command per batch of 50.
    assert report.calls["ssm.SendCommand"] == 2 * 2 * batches(NODES) == 84
    # The retry cancelled every batch's command: the dead node's batch its own, then the
    # others (each at most once more, by a batch that found its own ended meanwhile).
    assert report.calls["ssm.CancelCommand"] >= batches(NODES)
    # Every simulated invocation ends with the most output the agent keeps (fleet.py: 2,500
    # characters of Output each). A batch reads its invocations with Details 25 at a time and
    # keeps only their classes (stacks/supervisor_results.py): 110,582 bytes at 1,024 nodes
    # (RunTrainingAddResultsPage), where one page of 50 made 179,224 (Step Functions quotas:
    # 256 KiB a state; half of it leaves room for longer host lists and settings).
    assert report.largest_payload < PAYLOAD_LIMIT / 2, report.largest_payload_state
    # A ListCommandInvocations page per 25 invocations of each batch, each attempt's two
    # documents: at least (the CLI reads some more).
    pages = sum(
        math.ceil(min(SEND_BATCH, NODES - SEND_BATCH * b) / INVOCATIONS_PAGE)
        for b in range(batches(NODES))
    )
    assert pages == 41 and report.calls["ssm.ListCommandInvocations"] >= 2 * 2 * pages
    assert report.most_child_events < HISTORY_LIMIT / 10, report.map_runs
    assert max(report.job_events) < 1_000, report.job_events
    # The sample nodes ran the real launch.sh in both attempts: torchrun got the cluster's
    # size and the node's position in the host list as its rank.
    assert len(report.real_ranks) >= 2 * 6, report.real_ranks
    assert all(n == NODES and rank == position for n, rank, position in report.real_ranks)


class _NeverLaunched:
    """Nodes that never launch: each wait for them runs out (SimulatedAgents.wait_launched)."""

    def wait_launched(
        self, count: int, timeout: float, *, after: frozenset[str] = frozenset()
    ) -> frozenset[str]:
        time.sleep(min(timeout, 0.05))
        raise TimeoutError(f"0 of {count} nodes run RunTraining")


@pytest.mark.parametrize("job", ["ended", "running", "not started"])
def test_a_wait_for_the_nodes_names_what_it_waited_for_and_ends_with_the_job(job: str) -> None:
    """The rehearsal's waits for the nodes fail at once, with the job's status and cause, once
    the job has ended (rather than at the phase's bound), and name the phase at the bound. The
    job's execution in moto (no interpreter: RUNNING until stopped)."""
    import boto3
    from moto import mock_aws

    with mock_aws():
        sfn = boto3.client("stepfunctions", region_name="us-east-1")
        machine = sfn.create_state_machine(
            name="job", roleArn="arn:aws:iam::123456789012:role/job",
            definition='{"StartAt": "S", "States": {"S": {"Type": "Succeed"}}}',
        )["stateMachineArn"]  # fmt: skip
        execution = f"{machine.replace(':stateMachine:', ':execution:', 1)}:attempt-1"
        if job != "not started":
            sfn.start_execution(stateMachineArn=machine, name="attempt-1")
        if job == "ended":
            sfn.stop_execution(executionArn=execution)
        agents = cast(SimulatedAgents, _NeverLaunched())
        bound = 600 if job == "ended" else 0.2
        started = time.monotonic()
        with pytest.raises((RuntimeError, TimeoutError)) as raised:
            _launched(agents, sfn, [execution], nodes=4, timeout=bound,
                      waiting_for="every node to launch")  # fmt: skip
    message = str(raised.value)
    if job == "ended":
        assert message == (
            "the job ended ABORTED while the rehearsal waited for every node to launch "
            "(0 of 4 nodes run RunTraining)"
        )
        assert time.monotonic() - started < bound / 2  # at once, not at the bound
    else:
        assert message == "waited 0.2 s for every node to launch: 0 of 4 nodes run RunTraining"


class _WindingDown:
    """A real node's launch.sh for SimulatedAgents: it exits 0 once told to (the exit file
    that `_tell` writes) and, where `held`, only once the test lets it."""

    def __init__(self, told: Path, held: threading.Event | None = None) -> None:
        self.told, self.held = told, held

    def poll(self) -> int | None:
        if not self.told.is_file() or (self.held is not None and not self.held.is_set()):
            return None
        return 0

    def kill(self) -> None:
        raise AssertionError("finish ends every node well")


def _batches(
    agents: SimulatedAgents, root: Path, sizes: list[int], real: dict[tuple[int, int], Any]
) -> dict[tuple[int, int], str]:
    """Running RunTraining invocations in batches of `sizes` nodes, one command each; the
    nodes of `real` ((batch, node): its script) run a real node's script. Returns the keys."""
    commands = sorted(str(uuid.uuid4()) for _ in sizes)
    keys = {}
    for b, (command, size) in enumerate(zip(commands, sizes, strict=True)):
        for n in range(size):
            instance = SimpleNamespace(instance_id=f"i-{b}{n}", state="running",
                                       root=root / f"{b}{n}", address="10.0.0.1")  # fmt: skip
            instance.root.mkdir()
            folder = instance.root / "invocation"
            folder.mkdir()
            key = keys[b, n] = f"{command}-{instance.instance_id}"
            agents.running[key] = fleet._Running(folder, cast(Any, instance), "RunTraining", 0.0)
            if (b, n) in real:
                invocation = SimpleNamespace(folder=folder, instance=instance)
                agents.real[key] = fleet._Real(key, command, invocation, real[b, n], 0.0)
                (instance.root / f"{command}.started").touch()
    return keys


def _ended(root: Path, b: int, n: int) -> bool:
    return (root / f"{b}{n}" / "invocation" / "status.json").is_file()


def test_finish_ends_a_real_nodes_batch_as_soon_as_its_script_has_exited(tmp_path: Path) -> None:
    """Three batches of three nodes (one SendCommand each): the first and the last each with a
    real node, whose invocation ends only once its script exits, the last's at once and the
    first's when the test lets it. The last batch ends (its real node's status with its
    simulated nodes') as soon as its real node has exited, while the first batch's real node
    still winds down and its end is held back, so that a batch's invocations end together
    whatever the machine's pace; then the first batch, then the other. Ended after every real
    node (as before), the last batch's simulated nodes waited for the first batch's real node
    and a thousand other nodes."""
    agents = SimulatedAgents(cast(Any, None))
    held = threading.Event()
    scripts = {
        (0, 0): _WindingDown(tmp_path / "exit-0", held),
        (2, 2): _WindingDown(tmp_path / "exit-2"),
    }
    keys = _batches(agents, tmp_path, [3, 3, 3], cast(Any, scripts))
    for (b, n), script in scripts.items():
        script.told = tmp_path / f"{b}{n}" / f"{keys[b, n][:36]}.exit"
    ended: list[str] = []
    simulated_end = agents._end

    def end(key: str, code: int, *, ending: str = "") -> None:
        ended.append(key)
        simulated_end(key, code, ending=ending)

    agents._end = end  # type: ignore[method-assign]
    finishing = threading.Thread(target=agents.finish, kwargs={"timeout": 60})
    try:
        finishing.start()
        bound = time.monotonic() + 60  # an upper bound: the watcher looks every 0.2 s
        while True:
            with agents._answering:  # as an API answer sees the invocations
                seen = {(b, n): _ended(tmp_path, b, n) for b in range(3) for n in range(3)}
            if seen[2, 0]:
                break
            assert time.monotonic() < bound, f"the last batch still runs; ended: {ended}"
            time.sleep(0.05)
        # The last batch whole, its real node's status with it; nothing of the first batch,
        # whose real node is held (its end too, though the node was told first).
        assert [seen[2, n] for n in range(3)] == [True, True, True]
        assert not any(seen[0, n] or seen[1, n] for n in range(3)), seen
    finally:
        held.set()
        finishing.join(60)
        agents.close()
    assert not finishing.is_alive()
    assert ended == [keys[2, 0], keys[2, 1], keys[0, 1], keys[0, 2],
                     keys[1, 0], keys[1, 1], keys[1, 2]]  # fmt: skip
    assert agents.running == {} and agents.real == {}
    for b, n in ((0, 0), (2, 2)):
        status = json.loads((tmp_path / f"{b}{n}" / "invocation" / "status.json").read_text())
        assert status["status"] == "Success"


def test_no_api_answer_sees_a_batch_half_ended(tmp_path: Path) -> None:
    """Each batch's first invocation to end starts its FailureGraceSeconds for the others: so
    `finish` ends a batch under the lock of API answers. Here, after each node's end, an
    "API answer" (a reader under that lock) is given a tenth of a second to look: it must
    never find a batch with some invocations ended and others running. Ended one by one
    outside the lock (as before), the reader sees the first node of each batch ended alone,
    which on a busy machine lasted past the scale rehearsal's 5 s grace: the supervisor
    cancelled the rest and the 1,024-node job failed ("RunTraining ended Cancelled")."""
    agents = SimulatedAgents(cast(Any, None))
    keys = _batches(agents, tmp_path, [3, 3, 2], {})
    seen: list[dict[tuple[int, int], bool]] = []
    look, looked, done = threading.Event(), threading.Event(), threading.Event()

    def reader() -> None:
        while not done.is_set():
            if look.wait(0.05):
                look.clear()
                with agents._answering:
                    seen.append({bn: _ended(tmp_path, *bn) for bn in keys})
                looked.set()

    simulated_end = agents._end

    def end(key: str, code: int, *, ending: str = "") -> None:
        simulated_end(key, code, ending=ending)
        looked.clear()
        look.set()
        looked.wait(0.1)  # an upper bound: under the lock the reader waits for the batch

    agents._end = end  # type: ignore[method-assign]
    watching = threading.Thread(target=reader)
    watching.start()
    try:
        agents.finish(timeout=60)
    finally:
        done.set()
        watching.join(60)
        agents.close()
    with agents._answering:
        seen.append({bn: _ended(tmp_path, *bn) for bn in keys})
    assert seen[-1] == dict.fromkeys(keys, True)
    for snapshot in seen:
        for b in range(3):
            batch = [ended for (c, _), ended in snapshot.items() if c == b]
            assert all(batch) or not any(batch), f"batch {b} half ended: {snapshot}"
