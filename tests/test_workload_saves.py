"""Saves off the critical path (workload/checkpoint_writer.py) in the trainer, on the CPU.

A checkpoint is copied to host memory at its step and written by a background thread while
training goes on; a stop waits for the save in flight; a write that fails fails the job in
one line. The runs here hold a write in flight with a driver script (it waits inside the
write for the process's SIGTERM), so nothing races the clock.
"""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.workload_support import (
    REPO,
    TINY,
    error_lines,
    events,
    make_data,
    run_train,
    start_train,
    summary,
    worker_pids,
)
from workload.checkpoint import list_checkpoints, load_trainer_state

STEPS = 40
JOB = (
    *TINY,
    *("--batch-size", "8", "--device", "cpu", "--log-every", "4", "--dropout", "0.1"),
    *("--checkpoint-every", "8", "--keep-checkpoints", "10", "--eval-every", "0"),
    *("--max-steps", str(STEPS), "--seed", "5"),
)

#: train.py whose write of checkpoint 8 (in the writer's thread) waits, after writing its
#: files and before fsyncing and renaming them, until the process has received SIGTERM.
HOLD_WRITE_UNTIL_SIGTERM = textwrap.dedent(
    """
    import os, sys, threading
    sys.path.insert(0, {repo!r})
    import workload.checkpoint as checkpoint
    import workload.stop as stop
    import workload.train as train

    term = threading.Event()
    handle = stop.StopRequest._handle
    def handled(self, signum, frame):
        handle(self, signum, frame)
        term.set()
    stop.StopRequest._handle = handled

    real = checkpoint._fsync_tree
    def fsync_once_stopped(directory):
        if "step_00000008" in directory.name:
            assert threading.current_thread() is not threading.main_thread()
            if not term.wait(timeout=600):
                raise RuntimeError("no SIGTERM came")
        real(directory)
    checkpoint._fsync_tree = fsync_once_stopped
    sys.exit(train.main())
    """
)

#: train.py on a disk that is full when checkpoint 4's trainer state is written.
DISK_FULL_AT_4 = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    import workload.checkpoint as checkpoint
    import workload.train as train

    real = checkpoint.torch.save
    def save(obj, path, *args, **kwargs):
        if "step_00000004" in str(path):
            raise OSError(28, "No space left on device")
        return real(obj, path, *args, **kwargs)
    checkpoint.torch.save = save
    sys.exit(train.main())
    """
)


@pytest.fixture(scope="module")
def small_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("saves"), train=96, test=24, seed=4)


def _final_weights(output: Path) -> dict[str, torch.Tensor]:
    return load_file(str(output / "checkpoints" / f"step_{STEPS:08d}" / "model.safetensors"))


@pytest.mark.slow
def test_sigterm_with_a_save_in_flight_finishes_it_and_the_job_resumes_bit_identically(
    small_data: Path, tmp_path: Path
) -> None:
    reference = tmp_path / "reference"
    done = run_train(["--data", str(small_data), "--output", str(reference), *JOB], nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]

    output = tmp_path / "job"
    args = ["--data", str(small_data), "--output", str(output), *JOB]
    driver = tmp_path / "train_holding_a_write.py"
    driver.write_text(HOLD_WRITE_UNTIL_SIGTERM.format(repo=str(REPO)))
    process = start_train(args, nproc=2, script=driver)
    # Step 12 is logged while checkpoint 8's write waits: training went on beside it.
    deadline = time.monotonic() + 300  # an upper bound only: the wait ends on the line
    while not [line for line in _train_lines(output) if line["step"] >= 12]:
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no step 12 while checkpoint 8 was being written"
        time.sleep(0.05)
    assert [step for step, _ in list_checkpoints(output)] == []  # 8 is still in flight
    for pid in worker_pids(process.pid).values():  # as stop.sh does: every trainer
        os.kill(pid, signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    result = summary(output)
    assert result["stopped_by_signal"] is True
    stopped = int(result["step"])
    assert 12 <= stopped < STEPS
    # The save in flight was finished, then the stop's own (and any between them).
    saved = [step for step, _ in list_checkpoints(output)]
    assert saved[0] == 8 and saved[-1] == stopped
    assert load_trainer_state(output / "checkpoints" / "step_00000008")["step"] == 8
    assert not list((output / "checkpoints").glob(".tmp-*"))

    resumed = run_train(args, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in events(output, "resume")] == [stopped]
    final, expected = _final_weights(output), _final_weights(reference)
    assert final.keys() == expected.keys()
    assert [name for name in final if not torch.equal(final[name], expected[name])] == []


def _train_lines(output: Path) -> list[dict[str, int]]:
    try:
        return events(output, "train")
    except (FileNotFoundError, ValueError):  # not there yet, or a line half written
        return []


def test_a_write_that_fails_in_the_background_fails_the_job_in_one_line(
    small_data: Path, tmp_path: Path
) -> None:
    output = (tmp_path / "job").resolve()
    driver = tmp_path / "train_disk_full.py"
    driver.write_text(DISK_FULL_AT_4.format(repo=str(REPO)))
    args = ["--data", str(small_data), "--output", str(output), *JOB, "--checkpoint-every", "4"]
    failed = run_train(args, script=driver)
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr
    assert error_lines(failed.stderr) == [
        f"train.py: error: checkpoint {output}/checkpoints/step_00000004 could not be written "
        "(OSError: [Errno 28] No space left on device); the previous checkpoint is the latest"
    ]
    # Found at a step after the failed write, at the latest when the next save (8) began.
    assert max(line["step"] for line in events(output, "train")) <= 8
    assert not [m for m in events(output, "summary")]
    assert list_checkpoints(output) == []
    assert not list((output / "checkpoints").glob(".tmp-*"))
