"""Start- and save-time accesses to shared storage at scale (stacks/start_limits.py), and a
real job of two nodes of two ranks that shows who makes each of them.

The arithmetic is pinned at 64, 256 and 1,024 nodes; at 1,024 every access fits its limit,
the Neuron compile cache's look-ups included (on /fsx, linked to S3 by a data repository
association, where every rank asked S3 before), once FSx has the Metadata IOPS
``metadata_iops_needed`` names. The job
runs under strace (every process's openat and mkdir), so the count of processes that open a
checkpoint, the tokenizer or the token cache is the kernel's, not the trainer's own word.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from stacks import config as cluster_config
from stacks import start_limits as limits
from tests.node_support import free_port
from tests.workload_support import TINY, TORCHRUN, TRAIN_PY, job_env, make_data

PINNED = {
    # name: (64 nodes, 256 nodes, 1,024 nodes), rounded to 0.01
    # The compile cache on /fsx: every rank's opens and flocks (Metadata IOPS), the NEFF once a
    # node from the file server's memory, S3 once a file through the association.
    "compile cache look-up (per graph)": (5.72, 22.87, 91.48),
    "compile cache read (per graph)": (1.49, 5.97, 23.89),
    "compile cache import (per graph)": (6, 6, 6),
    "compile cache export (per new graph)": (8, 8, 8),
    "data directory": (0.04, 0.17, 0.68),
    "tokenizer": (0.04, 0.05, 0.05),
    "token cache fill": (8.99, 9.24, 10.27),
    "token cache open": (13.65, 54.61, 218.45),
    "resume: model weights": (1.5, 1.5, 1.5),
    "resume: trainer state": (11.55, 14.68, 18.72),
    "resume point (xla)": (0.55, 2.22, 8.87),
    "save: RNG states": (0.05, 0.19, 0.77),
    "save: checkpoint write": (4.62, 4.93, 6.15),
    "save: export to S3": (166, 166, 166),
}


def test_the_arithmetic_at_64_256_and_1024_nodes() -> None:
    for index, nodes in enumerate((64, 256, 1024)):
        found = {name: round(f.demand, 2) for name, f in limits.figures(nodes).items()}
        assert found == {name: values[index] for name, values in PINNED.items()}


def test_every_access_fits_its_limit_at_1024_nodes() -> None:
    iops = limits.metadata_iops_needed(limits.MAX_NODES)
    assert iops == 6_000  # 32,768 ranks x 10 opens of the token cache in a minute
    found = limits.figures(limits.MAX_NODES, iops=iops)
    assert [name for name, figure in found.items() if not figure.within] == []
    # The compile cache's look-ups: 131,072 ops in 22.9 s at 6,000 IOPS (3,000 would do).
    assert round(found["compile cache look-up (per graph)"].demand, 2) == 22.87
    lookup = limits.compile_cache_lookup  # at the automatic 1,500: enough up to 671 nodes
    assert lookup(671, 32).within and not lookup(672, 32).within
    assert limits.metadata_iops_needed(256) == 1_500  # the smallest FSx offers suffices
    # What reaches S3 does not grow with the cluster: the association's, once a file.
    for name in ("compile cache import (per graph)", "compile cache export (per new graph)"):
        assert {limits.figures(n)[name].demand for n in (1, 64, 1024)} == {found[name].demand}


def test_the_metadata_configuration_follows_the_nodes_and_the_storage() -> None:
    """Automatic mode's IOPS (1,500 at 1,200 GiB, FSx for Lustre user guide, "File system
    metadata performance") serve the token cache's opens up to 281 nodes, 3,000 up to 562:
    above, the smallest value that serves is provisioned, never below Automatic mode's
    (botocore's fsx model: "You can't provision fewer Metadata IOPS than AUTOMATIC mode
    provisions"). Every size against FSx's rules: tests/test_stacks_storage_growth.py."""
    assert [limits.metadata_iops_needed(n) for n in (281, 282, 562, 563)] == [
        1_500,
        3_000,
        3_000,
        6_000,
    ]
    configure = limits.metadata_configuration
    assert configure(281, 1_200) == limits.MetadataConfiguration("AUTOMATIC", 1_500)
    assert configure(282, 1_200) == limits.MetadataConfiguration("USER_PROVISIONED", 3_000)
    assert configure(1_024, 2_400).properties == {"Mode": "USER_PROVISIONED", "Iops": 6_000}
    # 4,800 GiB bring 6,000 in Automatic mode: enough for 1,024 nodes; 12,000 GiB bring more.
    assert configure(1_024, 4_800).properties == {"Mode": "AUTOMATIC"}
    assert configure(1_024, 12_000) == limits.MetadataConfiguration("AUTOMATIC", 12_000)
    with pytest.raises(ValueError, match="below FSx for Lustre's smallest"):
        limits.automatic_metadata_iops(600)


def test_the_compile_cache_read_is_served_from_the_file_servers_memory() -> None:
    """1,024 nodes x 17.5 MB: 24 s at the network baseline (750 MB/s at 1,200 GiB); from disk
    (293 MB/s) it would be 61 s, over the budget."""
    read = limits.figures(limits.MAX_NODES)["compile cache read (per graph)"]
    assert round(limits.fsx_network_bytes_per_second() / 1e6) == 750
    assert read.within
    from_disk = limits.MAX_NODES * limits.NEFF_BYTES / limits.fsx_read_bytes_per_second()
    assert from_disk > limits.START_BUDGET_S


def test_the_herds_that_were_shared_exceeded_their_limits() -> None:
    herds = {name: round(h(limits.MAX_NODES, 32).demand) for name, h in limits.HERDS.items()}
    # Each of these read the shared file system (or S3) once per rank or per node before.
    assert herds == {
        # every rank asked S3 (one HEAD, three GETs): 24 x the prefix's 5,500 GET/s
        "compile cache look-up (per graph)": 131072,
        "tokenizer": 162,
        "token cache fill": 9117,  # 1,024 copies: 2.7 TB on a 1.2 TiB file system
        "resume: model weights": 1560,
        "resume: trainer state": 4772,
    }
    now = limits.figures(limits.MAX_NODES, iops=limits.metadata_iops_needed(limits.MAX_NODES))
    for name, herd in limits.HERDS.items():
        assert not herd(limits.MAX_NODES, 32).within, name
        assert now[name].within, name
    # The S3 herd was over the prefix's rate from 43 nodes.
    herd = limits.HERDS["compile cache look-up (per graph)"]
    assert herd(42, 32).within and not herd(43, 32).within


def test_the_limits_follow_the_stack_defaults() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(cluster_config.ClusterConfig)}
    assert limits.FSX_STORAGE_GIB == defaults["fsx_storage_gib"] == cluster_config.FSX_MIN_GIB
    assert defaults["fsx_throughput_per_tib"] == limits.FSX_THROUGHPUT_PER_TIB
    assert round(limits.fsx_read_bytes_per_second() / 1e6) == 293  # 1,200 GiB at 250 MB/s/TiB


def test_nodes_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="nodes 1025 is not 1 to 1024"):
        limits.figures(1025)


# -- who reads what: a job of 2 nodes x 2 ranks under strace ---------------------------------

STRACE = shutil.which("strace")
_CALL = re.compile(r'^(\d+)\s+(openat|mkdir)\((?:AT_FDCWD, )?"([^"]+)"(?:, ([A-Z_|]+))?')


def _run_two_nodes(args: list[str], trace_dir: Path) -> None:
    port = str(free_port())
    launchers = []
    for node in range(2):
        # --seccomp-bpf: the traced processes stop at openat and mkdir only, not at every system
        # call (strace(1): "ptrace(2)-stops only when system calls that are being traced
        # occur"; it needs -f). The same lines, and the test's CPU 74 -> 47 s here.
        command = [
            *(str(STRACE), "-f", "--seccomp-bpf", "-qq", "-e", "trace=openat,mkdir"),
            *("-o", str(trace_dir / f"node-{node}.txt")),
            *(TORCHRUN, "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=2"),
            *("--master_addr=127.0.0.1", f"--master_port={port}", str(TRAIN_PY), *args),
        ]
        launchers.append(
            subprocess.Popen(
                command, env=job_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    for launcher in launchers:
        output, _ = launcher.communicate(timeout=600)
        assert launcher.returncode == 0, output[-4000:]


def _processes(trace_dir: Path, path_part: str, *, call: str = "openat") -> set[tuple[str, str]]:
    """(node, pid) of every process that made ``call`` on a path containing ``path_part``
    (opens for reading only)."""
    found = set()
    for trace in trace_dir.glob("node-*.txt"):
        for line in trace.read_text(errors="replace").splitlines():
            match = _CALL.match(line)
            if not match or match.group(2) != call or path_part not in match.group(3):
                continue
            if call == "openat" and not (match.group(4) or "").startswith("O_RDONLY"):
                continue
            if "= -1 E" in line:
                continue  # failed (a line cut by another thread's call has no result yet)
            found.add((trace.name, match.group(1)))
    return found


def _ranks(trace_dir: Path) -> int:
    """Processes that opened train.py's module: the ranks (torchrun itself never imports it)."""
    return len(_processes(trace_dir, "workload/train.py"))


@pytest.mark.slow
@pytest.mark.skipif(STRACE is None, reason="strace is not installed")
def test_a_job_of_two_nodes_reads_each_shared_file_as_start_limits_says(tmp_path: Path) -> None:
    data = make_data(tmp_path / "data", train=48, test=16, seed=5)
    output = tmp_path / "job"
    job = [
        *("--data", str(data), "--output", str(output), *TINY, "--device", "cpu"),
        *("--batch-size", "4", "--log-every", "1", "--eval-every", "0"),
    ]
    fresh, resumed = tmp_path / "fresh", tmp_path / "resumed"
    fresh.mkdir()
    resumed.mkdir()
    _run_two_nodes([*job, "--max-steps", "2"], fresh)
    _run_two_nodes([*job, "--max-steps", "3"], resumed)
    by = {who: limits.count(who, nodes=2, ranks=2) for who in (limits.ONE, limits.PER_NODE)}
    who = {access.name: access.who for access in limits.ACCESSES}

    # The tokenizer: trained and saved by rank 0, loaded by rank 0 only; the others get it
    # as an object (before: every other rank loaded it from the shared output).
    assert len(_processes(fresh, "/tokenizer/tokenizer.json")) == by[who["tokenizer"]] == 1
    # The token cache: one process tokenizes and writes each split (before: one per node).
    writers = _processes(fresh, "/.tmp-train-", call="mkdir")
    assert len(writers) == by[who["token cache fill"]] == 1
    # ... and every rank opens it (TOKEN_CACHE_OPENS counts these).
    assert len(_processes(resumed, "meta.json")) == 4 == limits.count(limits.PER_RANK, 2, 2)
    # Resume: rank 0 alone reads the weights and the trainer state (before: all 4).
    step = output / "checkpoints" / "step_00000002"
    assert len(_processes(resumed, str(step / "model.safetensors"))) == 1
    assert len(_processes(resumed, str(step / "trainer_state.pt"))) == 1
    assert by[who["resume: model weights"]] == by[who["resume: trainer state"]] == 1
    assert (output / "checkpoints" / "step_00000003").is_dir()


# -- the node tree's gather and scatter (the xla path's control groups), over gloo ------------

TREE_SCRIPT = """
import datetime, json, os, sys
import torch.distributed as dist
from workload.backend import NodeTree

rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
dist.init_process_group("gloo")
world = dist.get_world_size()
tree = NodeTree(rank, world, int(os.environ["LOCAL_RANK"]), local, datetime.timedelta(seconds=60))
report = {
    "gathered": tree.gather_object({"rank": rank}),
    "scattered": tree.scatter_object([f"for {r}" for r in range(world)] if rank == 0 else None),
    "from_leader": tree.from_node_leader(f"leader {rank}"),
}
with open(os.path.join(sys.argv[1], f"rank-{rank}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize(("nodes", "local"), [(2, 2), (1, 3), (3, 1)])
def test_the_node_tree_gathers_to_rank_0_and_scatters_from_it(
    tmp_path: Path, nodes: int, local: int
) -> None:
    import json
    import sys

    from tests.node_support import REPO_ROOT

    port, world = str(free_port()), nodes * local
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", TREE_SCRIPT, str(tmp_path)],
            env={
                **os.environ,
                "PYTHONPATH": str(REPO_ROOT),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(rank % local),
                "LOCAL_WORLD_SIZE": str(local),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    for process in processes:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output
    reports = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(world)]
    assert reports[0]["gathered"] == [{"rank": r} for r in range(world)]
    assert [r["gathered"] for r in reports[1:]] == [None] * (world - 1)  # rank 0's alone
    assert [r["scattered"] for r in reports] == [f"for {r}" for r in range(world)]
    assert [r["from_leader"] for r in reports] == [f"leader {r - r % local}" for r in range(world)]
