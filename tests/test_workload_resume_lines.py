"""The trainer's first lines say what it starts from: a fresh start (no checkpoint in its
output), or the checkpoint and step it resumed (launch.sh says the same before torchrun:
tests/test_launch_scripts.py); and a resumed job given another --lr says in one line that
its restored optimizer and learning-rate schedule go on instead (torch's LambdaLR keeps the
learning rate the job began with as each param group's initial_lr, restored with the
optimizer's state)."""

from __future__ import annotations

from pathlib import Path

from tests.workload_support import TINY, make_data, run_train

JOB = (*TINY, "--batch-size", "8", "--device", "cpu", "--seed", "3", "--log-every", "1")


def test_a_fresh_start_and_a_resume_say_so_and_a_new_lr_is_not_silently_dropped(
    tmp_path: Path,
) -> None:
    data = make_data(tmp_path / "data", train=64, test=16)
    output = tmp_path / "job"
    args = ["--data", str(data), "--output", str(output), *JOB, "--checkpoint-every", "2"]
    first = run_train([*args, "--max-steps", "2", "--lr", "1e-3"], timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"starting fresh at step 0: no checkpoint in {output}" in first.stderr
    again = run_train([*args, "--max-steps", "4", "--lr", "5e-4"], timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "starting fresh" not in again.stderr
    assert f"resuming from {output / 'checkpoints' / 'step_00000002'} at step 2" in again.stderr
    assert (
        "--lr 0.0005 is not applied: the job resumes with its restored optimizer and "
        "learning-rate schedule (started at lr 0.001); start a new job to change it"
    ) in again.stderr, again.stderr[-3000:]
    same = run_train([*args, "--max-steps", "6", "--lr", "1e-3"], timeout=600)
    assert same.returncode == 0 and "is not applied" not in same.stderr
