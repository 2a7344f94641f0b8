"""``Backend.close`` tears the process group down while the interpreter is whole.

A gloo group that outlives ``destroy_process_group`` (a Python handle still reaches it) is torn
down at the interpreter's exit instead, and gloo's teardown there now and then ends the rank in
std::terminate ("terminate called without an active exception", status -6): a trainer that
stopped on SIGTERM, saved and wrote its summary was reported by torchrun as failed. That is
rare (about 1 rank in 45 of the vote rehearsal), so a test that waits for it cannot tell; what
can be counted every time is whether the group is gone: its gloo worker and transport threads
(and rank 0's store thread) end when it is destroyed and live on while anything pins it.

Each rank below runs as the trainer does (``setup_backend`` from torchrun's variables, DDP, a
step, a vote of the stop's agreement) and counts the threads in /proc/self/task before the
group, while it is up and after the close.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.workload_support import run_rank_scripts

RANK_SCRIPT = """
import json, os, sys
import torch
from torch import nn
import torch.distributed as dist
from workload.backend import setup_backend

def threads():
    return sorted(int(t) for t in os.listdir("/proc/self/task"))

out, how = sys.argv[1], sys.argv[2]
warm = nn.Linear(4, 2)
warm(torch.ones(3, 4)).sum().backward()  # autograd's own start-up, before counting
before = threads()
backend = setup_backend("cpu", "fp32")
model = backend.prepare_model(nn.Linear(4, 2))  # DDP: two ranks
model(torch.ones(3, 4)).sum().backward()
agreed = backend.start_any_rank(backend.rank == 1)()
up = threads()
cycle = {"model": model}
cycle["self"] = cycle  # DDP's reducer, as in the trainer, reached only through a cycle
del model, cycle
if how == "close":
    backend.close()
else:  # what close did before: the registry's references only, the control group kept
    dist.destroy_process_group()
after = threads()
with open(os.path.join(out, f"rank-{backend.rank}.json"), "w") as f:
    json.dump({"before": before, "up": up, "after": after, "agreed": agreed}, f)
"""


def run_ranks(tmp_path: Path, how: str) -> list[dict[str, Any]]:
    return run_rank_scripts(RANK_SCRIPT, [str(tmp_path), how], out=tmp_path, nodes=1, local=2)


def test_close_ends_every_thread_the_process_group_started(tmp_path: Path) -> None:
    for rank, report in enumerate(run_ranks(tmp_path, "close")):
        assert report["agreed"] is True
        started = set(report["up"]) - set(report["before"])
        assert started, f"rank {rank}: the group started no thread to count"
        assert set(report["after"]) == set(report["before"]), (
            f"rank {rank}: threads {sorted(set(report['after']) - set(report['before']))} "
            "of the process group outlive the close"
        )


def test_the_count_sees_a_group_that_a_handle_still_pins(tmp_path: Path) -> None:
    # The check above can fail: destroying the group while Backend.control still holds it
    # leaves its threads running, to be torn down at the interpreter's exit.
    for rank, report in enumerate(run_ranks(tmp_path, "destroy")):
        assert set(report["after"]) - set(report["before"]), f"rank {rank}"
