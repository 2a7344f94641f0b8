"""Host-side coordination of the ranks (workload/backend.py: OneGroup, NodeTree), and what a
cpu process keeps out of its start (torch-xla).

Under xla the trainer coordinates its ranks through a ``NodeTree``: a gloo group per node and
one of the nodes' local rank 0s, never a group over all ranks, whose full mesh (one socket
per peer in every process) does not scale. These tests run it for real, over gloo, with four
processes standing for two nodes of two (the tree does not depend on the device: XLA on the
CPU cannot run collectives across processes, workload/backend.py _setup_xla).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.node_support import REPO_ROOT
from tests.workload_support import run_rank_scripts
from workload.backend import BackendError, NodeTree

# One rank of a job of NODES nodes x LOCAL processes: RANK, LOCAL_RANK and LOCAL_WORLD_SIZE as
# torchrun sets them (rank = node rank x local world size + local rank).
RANK_SCRIPT = """
import datetime, json, os, sys
import torch.distributed as dist
from workload.backend import NodeTree

rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
dist.init_process_group("gloo")
world = dist.get_world_size()
tree = NodeTree(rank, world, int(os.environ["LOCAL_RANK"]), local, datetime.timedelta(seconds=60))
groups = [g for g in (tree.node, tree.leaders) if g is not None]
tree.barrier()
report = {
    "group_sizes": [dist.get_world_size(g) for g in groups],
    "leader_of_node": tree.leader,
    "any_last": tree.any_rank(rank == world - 1),
    "any_none": tree.any_rank(False),
    "broadcast": tree.broadcast_object(f"from rank {rank}"),
    "gathered": tree.all_gather_object({"rank": rank}),
}
tree.barrier()
with open(os.path.join(sys.argv[1], f"rank-{rank}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
"""


def run_ranks(tmp_path: Path, nodes: int, local: int) -> list[dict[str, Any]]:
    return run_rank_scripts(RANK_SCRIPT, [str(tmp_path)], out=tmp_path, nodes=nodes, local=local)


@pytest.mark.slow
def test_node_tree_coordinates_two_nodes_without_a_group_over_all_ranks(tmp_path: Path) -> None:
    reports = run_ranks(tmp_path, nodes=2, local=2)
    # Every rank is in its node's group of 2; ranks 0 and 2 (local rank 0) also in the
    # leaders' group of 2. No group spans the 4 ranks.
    assert [r["group_sizes"] for r in reports] == [[2, 2], [2], [2, 2], [2]]
    assert [r["leader_of_node"] for r in reports] == [0, 0, 2, 2]
    for report in reports:
        assert report["any_last"] is True  # the flag of rank 3, a non-leader of node 1
        assert report["any_none"] is False
        assert report["broadcast"] == "from rank 0"
        assert report["gathered"] == [{"rank": r} for r in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize(("nodes", "local"), [(1, 3), (3, 1)])
def test_node_tree_on_one_node_and_with_one_process_per_node(
    tmp_path: Path, nodes: int, local: int
) -> None:
    reports = run_ranks(tmp_path, nodes=nodes, local=local)
    world = nodes * local
    for report in reports:
        assert report["group_sizes"] in ([local], [nodes], [])
        assert report["any_last"] is True
        assert report["broadcast"] == "from rank 0"
        assert report["gathered"] == [{"rank": r} for r in range(world)]


def test_node_tree_refuses_nodes_of_different_sizes() -> None:
    with pytest.raises(BackendError) as error:
        NodeTree(0, 3, 0, 2, datetime.timedelta(seconds=60))
    assert str(error.value) == (
        "a world of 3 ranks is not whole nodes of 2 processes: start the same number of "
        "processes on every node"
    )


# _setup_xla on a leader of a 2-node job of 32 processes each, with the XLA runtime's world
# and torch.distributed's group calls stood in for (XLA on the CPU has a world of 1): which
# gloo groups does the xla path open?
XLA_SETUP_SCRIPT = """
import datetime, json, os
import torch.distributed as dist
import torch_xla.runtime as xr
from workload import backend as b

created = []
dist.init_process_group = lambda *args, **kwargs: None
def new_group(ranks=None, **kwargs):
    created.append({"ranks": ranks, "backend": kwargs.get("backend")})
    return object()
dist.new_group = new_group
xr.world_size, xr.global_ordinal, xr.local_ordinal = (lambda: 64), (lambda: 32), (lambda: 0)
backend = b._setup_xla("fp32", True, 64, 32, datetime.timedelta(seconds=60))
print(json.dumps({"control": type(backend.control).__name__, "created": created}))
"""


@pytest.mark.slow
def test_the_xla_path_opens_no_gloo_group_over_all_ranks() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PJRT_DEVICE": "CPU"}
    result = subprocess.run(
        [sys.executable, "-c", XLA_SETUP_SCRIPT], env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {
        "control": "NodeTree",
        "created": [
            {"ranks": list(range(32, 64)), "backend": "gloo"},  # its node
            {"ranks": [0, 32], "backend": "gloo"},  # the nodes' leaders
        ],
    }


# A cpu trainer's start as train.py makes it: the backend first, then transformers' model code.
CPU_START_SCRIPT = """
import json, os, sys
from workload.backend import setup_backend
backend = setup_backend("cpu")
import transformers.models.bert.modeling_bert
print(json.dumps({"kind": backend.kind, "torch_xla": "torch_xla" in sys.modules,
                  "PJRT_DEVICE": os.environ.get("PJRT_DEVICE")}))
"""


def test_a_cpu_trainer_leaves_torch_xla_unimported() -> None:
    """transformers and accelerate import torch-xla wherever it is installed (as here) unless
    USE_TORCH_XLA is false; without setup_backend's default this reports torch_xla True and
    PJRT_DEVICE "CPU", set by torch-xla itself."""
    pytest.importorskip("torch_xla")
    env = {k: v for k, v in os.environ.items() if k not in ("USE_TORCH_XLA", "PJRT_DEVICE")} | {
        "PYTHONPATH": str(REPO_ROOT)
    }
    result = subprocess.run(
        [sys.executable, "-c", CPU_START_SCRIPT], env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"kind": "cpu", "torch_xla": False, "PJRT_DEVICE": None}


def test_the_switch_is_the_users_where_set_and_untouched_on_xla(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from workload import backend as b

    monkeypatch.setenv("USE_TORCH_XLA", "1")
    assert b.setup_backend("cpu").kind == "cpu"
    assert os.environ["USE_TORCH_XLA"] == "1"
    monkeypatch.delenv("USE_TORCH_XLA")
    monkeypatch.setattr(b, "resolve_device_kind", lambda requested: "xla")
    monkeypatch.setattr(b, "_setup_xla", lambda *args: "xla backend")
    assert b.setup_backend("auto") == "xla backend"
    assert "USE_TORCH_XLA" not in os.environ
