"""The stop's agreement (workload/stop.py ``StopAgreement``): a vote that no step waits for.

Each log step reads the vote started at the log step before and starts the next, so the
host-side all-reduce (at 1,024 nodes a ring over the nodes' leaders, about 2,000 hops) runs
beside the steps in between instead of holding the device idle. The guarantee is unchanged:
every rank stops after the same step, saved. Tested over gloo for real (torch.distributed's
async_op work for one group over all ranks; ``NodeTree``'s vote thread for a group per node),
and in the trainer under torchrun with SIGTERM reaching one rank, or the ranks at different
times. Nothing waits on the clock: a rank that must join late waits for a file another rank
writes, and the tests wait for the trainers' own records.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.workload_support import (
    REPO,
    TINY,
    events,
    make_data,
    run_rank_scripts,
    start_train,
    summary,
    worker_pids,
)
from workload.checkpoint import list_checkpoints, load_trainer_state

# One rank of NODES x LOCAL processes over gloo, as torchrun numbers them. CONTROL is "one"
# (OneGroup over the gloo world: cpu and cuda) or "tree" (NodeTree: xla).
VOTE_SCRIPT = """
import datetime, json, os, sys, time
from pathlib import Path
import torch.distributed as dist
from workload.backend import Backend, NodeTree, OneGroup
from workload.stop import StopAgreement
import torch

rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
out, control = Path(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
world = dist.get_world_size()
backend = Backend(kind="cpu", device=torch.device("cpu"), rank=rank, world_size=world,
                  local_rank=int(os.environ["LOCAL_RANK"]), local_world_size=local,
                  owns_process_group=True)
if control == "tree":
    timeout = datetime.timedelta(seconds=60)
    backend.control = NodeTree(rank, world, backend.local_rank, local, timeout)
else:
    backend.control = OneGroup(dist.group.WORLD, world)

# 1. A vote in flight does not hold up the rank that started it: the last rank joins only
# once rank 0, its vote started, has written the file "go" (a vote that waited for every
# rank inside start_any_rank would never get there). Other coordination runs meanwhile.
last = world - 1
if rank != last:
    answer = backend.start_any_rank(False)
    if rank == 0:
        (out / "go").write_text("rank 0 went on with its vote in flight")
else:
    while not (out / "go").exists():
        time.sleep(0.01)
    answer = backend.start_any_rank(True)
gathered = backend.all_gather_object(rank)
late_join = answer()

# 2. Flags raised at different log steps on different ranks: every rank reads the same
# answers at the same log steps (log steps are numbered 1..8 here).
def stop_step(requested_from):
    agreement = StopAgreement(backend.start_any_rank)
    for log_step in range(1, 9):
        if agreement.at_log_step(requested_from is not None and log_step >= requested_from):
            return log_step
    agreement.finish()
    return None

scenarios = {
    "the last rank alone, from log step 2": stop_step(2 if rank == last else None),
    "rank r from log step r + 2": stop_step(rank + 2),
    "nobody": stop_step(None),
}
with open(out / f"rank-{rank}.json", "w") as f:
    json.dump({"late_join": late_join, "gathered": gathered, "stops": scenarios}, f)
# Every rank past its last collective before any tears its pairs down: a rank that exits while
# a peer's gloo transport still works on the last vote can abort it ("terminate called").
dist.barrier()
backend.close()  # the groups torn down here, not at the interpreter's exit (test_workload_close)
"""


def run_votes(tmp_path: Path, control: str, nodes: int, local: int) -> list[dict[str, Any]]:
    return run_rank_scripts(
        VOTE_SCRIPT, [str(tmp_path), control], out=tmp_path, nodes=nodes, local=local
    )


@pytest.mark.slow
@pytest.mark.parametrize(("control", "nodes", "local"), [("one", 1, 3), ("tree", 2, 2)])
def test_a_vote_runs_beside_the_steps_and_every_rank_reads_the_same_answer(
    tmp_path: Path, control: str, nodes: int, local: int
) -> None:
    reports = run_votes(tmp_path, control, nodes, local)
    world = nodes * local
    for report in reports:
        # Rank 0 went on (wrote "go") while its vote waited for the last rank.
        assert report["late_join"] is True
        assert report["gathered"] == list(range(world))
        # A flag raised at log step k is in the vote started there, read at k + 1.
        assert report["stops"] == {
            "the last rank alone, from log step 2": 3,
            "rank r from log step r + 2": 3,
            "nobody": None,
        }


# -- in the trainer: torchrun, 2 processes on the CPU ----------------------------------------

#: train.py with its votes recorded: each vote's flag, the training step at which it was
#: started and the one at which its answer was read, one JSON line per event in
#: VOTES/rank-R.jsonl; the step each rank ended at, from its own summary.
RECORD_VOTES = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {repo!r})
    import workload.backend as backend
    import workload.engine as engine
    import workload.train as train

    rank = os.environ["RANK"]
    path = os.path.join(os.environ["VOTES"], f"rank-{{rank}}.jsonl")
    steps = [0]

    def record(**event):
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\\n")

    step = engine.TrainStep.__call__
    def counted(self, batch):
        step(self, batch)
        steps[0] += 1
    engine.TrainStep.__call__ = counted

    start = backend.Backend.start_any_rank
    def recorded(self, flag):
        started = steps[0]
        record(event="start", flag=flag, step=started)
        answer = start(self, flag)
        def read():
            value = answer()
            record(event="read", started=started, step=steps[0], answer=value)
            return value
        return read
    backend.Backend.start_any_rank = recorded

    any_rank = backend.Backend.any_rank
    def synchronous(self, flag):
        record(event="any_rank", step=steps[0])
        return any_rank(self, flag)
    backend.Backend.any_rank = synchronous

    run = train.train
    def summarized(*args, **kwargs):
        result = run(*args, **kwargs)
        record(event="end", step=result["step"], stopped=result["stopped_by_signal"])
        return result
    train.train = summarized
    sys.exit(train.main())
    """
)

LOG_EVERY = 4
SMALL = (*TINY, "--batch-size", "8", "--device", "cpu", "--log-every", str(LOG_EVERY))


@pytest.fixture(scope="module")
def small_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("small"), train=96, test=24, seed=3)


def _recorded(votes: Path, rank: int) -> list[dict[str, Any]]:
    path = votes / f"rank-{rank}.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _start(tmp_path: Path, small_data: Path) -> tuple[subprocess.Popen[str], Path, Path]:
    output, votes = tmp_path / "job", tmp_path / "votes"
    votes.mkdir()
    driver = tmp_path / "train_recording_votes.py"
    driver.write_text(RECORD_VOTES.format(repo=str(REPO)))
    job = ["--data", str(small_data), "--output", str(output), *SMALL, "--checkpoint-every", "0"]
    process = start_train(
        [*job, "--max-steps", "100000"], nproc=2, extra_env={"VOTES": str(votes)}, script=driver
    )
    return process, output, votes


def _wait_for(process: subprocess.Popen[str], found: Any, what: str) -> Any:
    deadline = time.monotonic() + 300  # an upper bound only: the wait ends on the record
    while time.monotonic() < deadline:
        result = found()
        if result:
            return result
        if process.poll() is not None:
            raise AssertionError(f"train.py ended ({process.returncode}) before {what}")
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"no {what} after 300 s")


def _stopped_together(process: subprocess.Popen[str], output: Path, votes: Path) -> int:
    """Both ranks' end step (the same), checked against the stop line and the checkpoint;
    and every vote started at a log step and read at the next, LOG_EVERY steps later."""
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    ends = [[e for e in _recorded(votes, r) if e["event"] == "end"] for r in (0, 1)]
    assert ends[0] == ends[1] and len(ends[0]) == 1 and ends[0][0]["stopped"] is True, ends
    step = int(ends[0][0]["step"])
    assert summary(output)["step"] == step
    assert [line["step"] for line in events(output, "stop")] == [step]
    assert list_checkpoints(output)[-1][0] == step
    assert load_trainer_state(output / "checkpoints" / f"step_{step:08d}")["step"] == step
    for rank in (0, 1):
        recorded = _recorded(votes, rank)
        starts = [e["step"] for e in recorded if e["event"] == "start"]
        reads = [(e["started"], e["step"]) for e in recorded if e["event"] == "read"]
        # Started at every log step up to the one before the stop, each read LOG_EVERY
        # steps (all of them trained while it was out) after it was started.
        assert starts == list(range(LOG_EVERY, step, LOG_EVERY))
        assert reads == [(s, s + LOG_EVERY) for s in starts]
        assert [e for e in recorded if e["event"] == "any_rank"] == []  # nothing synchronous
    return step


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_after_the_same_step_without_a_blocking_vote(
    tmp_path: Path, small_data: Path
) -> None:
    process, output, votes = _start(tmp_path, small_data)
    _wait_for(process, lambda: events(output, "train") if (output / "metrics.jsonl").is_file()
              else [], "a train line")  # fmt: skip
    os.kill(worker_pids(process.pid)[1], signal.SIGTERM)  # rank 0 learns of it by the vote
    step = _stopped_together(process, output, votes)
    flagged = [e["step"] for e in _recorded(votes, 1) if e["event"] == "start" and e["flag"]]
    assert flagged == [step - LOG_EVERY]  # the first vote that carried it stopped the job


@pytest.mark.slow
def test_sigterm_reaching_the_ranks_at_different_times_stops_both_after_the_same_step(
    tmp_path: Path, small_data: Path
) -> None:
    process, output, votes = _start(tmp_path, small_data)
    workers = _wait_for(process, lambda: worker_pids(process.pid) if len(
        worker_pids(process.pid)) == 2 else {}, "two workers")  # fmt: skip
    _wait_for(process, lambda: _recorded(votes, 1), "a vote on rank 1")
    os.kill(workers[1], signal.SIGTERM)
    # Rank 1's flag is in a vote that has started: only then does rank 0 get its SIGTERM.
    _wait_for(
        process,
        lambda: [e for e in _recorded(votes, 1) if e["event"] == "start" and e["flag"]],
        "rank 1's vote with its flag",
    )
    with contextlib.suppress(ProcessLookupError):  # rank 0 may have stopped on rank 1's vote
        os.kill(workers[0], signal.SIGTERM)
    step = _stopped_together(process, output, votes)
    first = next(e["step"] for e in _recorded(votes, 1) if e["event"] == "start" and e["flag"])
    assert step == first + LOG_EVERY
