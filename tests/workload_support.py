"""Helpers for the workload tests: sample data, running train.py, reading its output."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
TRAIN_PY = REPO / "workload" / "train.py"
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).parent / "torchrun")

#: A model small enough for two shared CPU cores: 2 layers, hidden 64, 64 tokens.
TINY = (
    *("--model", "tiny", "--tiny-hidden-size", "64", "--tiny-layers", "2"),
    *("--tiny-heads", "4", "--tiny-vocab-size", "1000", "--max-length", "64"),
)


def make_data(directory: Path, *, train: int, test: int, seed: int = 0, fmt: str = "jsonl") -> Path:
    """Sample data through the real generator (in this process: no interpreter start)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import make_sample_data
    finally:
        sys.path.remove(str(REPO / "scripts"))
    with contextlib.redirect_stdout(None):
        status = make_sample_data.main(
            [
                *("--output", str(directory), "--train-size", str(train)),
                *("--test-size", str(test), "--seed", str(seed), "--format", fmt),
            ]
        )
    assert status == 0
    return directory


def job_env(*, xla: bool = False) -> dict[str, str]:
    """The environment for a training process: one thread, offline, XLA only when asked."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PJRT_", "XLA_", "NEURON_", "TORCHELASTIC_"))
        and k not in ("USE_TORCH_XLA", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
    }
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if xla:
        env["PJRT_DEVICE"] = "CPU"
        if "XLA_FLAGS" in os.environ:  # tests/conftest.py
            env["XLA_FLAGS"] = os.environ["XLA_FLAGS"]
    return env


def train_command(args: Sequence[str], *, nproc: int = 0, script: Path = TRAIN_PY) -> list[str]:
    """The command line of train.py (under torchrun with ``nproc`` processes, or alone)."""
    if nproc:
        return [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", str(script), *args]
    return [PYTHON, str(script), *args]


def run_train(
    args: Sequence[str],
    *,
    nproc: int = 0,
    xla: bool = False,
    cwd: Path | None = None,
    script: Path = TRAIN_PY,
    extra_env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run train.py (under torchrun with ``nproc`` processes, or alone when 0)."""
    command = train_command(args, nproc=nproc, script=script)
    env = job_env(xla=xla)
    env.update(extra_env or {})
    return subprocess.run(
        command,
        cwd=str(cwd or REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def start_train(
    args: Sequence[str],
    *,
    nproc: int = 0,
    xla: bool = False,
    extra_env: dict[str, str] | None = None,
    script: Path = TRAIN_PY,
) -> subprocess.Popen[str]:
    """Start train.py (or a driver script) in the background (output to pipes read at the end)."""
    return subprocess.Popen(
        train_command(args, nproc=nproc, script=script),
        cwd=str(REPO),
        env={**job_env(xla=xla), **(extra_env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_event(
    output: Path, event: str, process: subprocess.Popen[str], timeout: float = 300
) -> dict[str, Any]:
    """The first ``event`` line of ``output``'s metrics, waiting while ``process`` runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = events(output, event)
        except (FileNotFoundError, ValueError):  # not there yet, or a line half written
            found = []
        if found:
            return found[0]
        if process.poll() is not None:
            _, stderr = process.communicate()
            raise AssertionError(f"train.py ended ({process.returncode}): {stderr[-3000:]}")
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"no {event!r} line in {output} after {timeout} s")


def worker_pids(launcher: int) -> dict[int, int]:
    """{RANK: pid} of the worker processes torchrun ``launcher`` started (from /proc)."""
    workers: dict[int, int] = {}
    for task in Path(f"/proc/{launcher}/task").iterdir():
        for child in (task / "children").read_text().split():
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            ranks = [item[5:] for item in environ if item.startswith(b"RANK=")]
            if ranks:
                workers[int(ranks[0])] = int(child)
    return workers


def metrics(output: Path) -> list[dict[str, Any]]:
    lines = (output / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def events(output: Path, event: str) -> list[dict[str, Any]]:
    return [m for m in metrics(output) if m["event"] == event]


def summary(output: Path) -> dict[str, Any]:
    found = events(output, "summary")
    assert found, f"no summary line in {output / 'metrics.jsonl'}"
    return found[-1]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("train.py: error:")]


@contextlib.contextmanager
def no_xla_side_effects() -> Iterator[None]:
    """Import transformers' model code without torch-xla setting PJRT_DEVICE for us all.

    transformers imports torch-xla when it is installed, and torch-xla then sets
    PJRT_DEVICE=CPU in this process's environment (so every later subprocess would
    inherit it). Restore the environment as it was.
    """
    before = os.environ.get("PJRT_DEVICE")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PJRT_DEVICE", None)
        else:
            os.environ["PJRT_DEVICE"] = before


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """One intra-op thread while the module runs: on a shared 2-core machine a second
    spinning thread makes every small matmul wait on the others' jobs."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_rank_scripts(
    script: str, args: Sequence[str], *, out: Path, nodes: int, local: int
) -> list[dict[str, Any]]:
    """`script` (``python -c``) as the ranks of `nodes` x `local` processes, numbered and
    given the variables torchrun gives them, over gloo on a free port; each must exit 0 and
    write ``out/rank-<rank>.json``. Their reports, in rank order."""
    from tests.node_support import REPO_ROOT, free_port

    port = str(free_port())
    world = nodes * local
    processes = []
    for rank in range(world):
        env = {
            **os.environ, "PYTHONPATH": str(REPO_ROOT), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port, "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank % local), "LOCAL_WORLD_SIZE": str(local),
            "OMP_NUM_THREADS": "1",
        }  # fmt: skip
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", script, *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for process in processes:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(world)]
