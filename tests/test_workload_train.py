"""The trainer end to end on the CPU: 2-process torchrun (gloo), kill and resume, outputs.

The expensive runs share one reference job (module fixture): 2 processes, 1600 sample
reviews, 200 steps of a 2-layer, hidden-64 BERT.
"""

from __future__ import annotations

import os
import shutil
import signal
import textwrap
import time
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from safetensors.torch import load_file

from tests.workload_support import (
    REPO,
    TINY,
    events,
    job_env,
    make_data,
    metrics,
    no_xla_side_effects,
    run_train,
    single_thread,
    start_train,
    summary,
    wait_for_event,
    worker_pids,
)
from workload.backend import setup_backend
from workload.checkpoint import list_checkpoints, load_trainer_state
from workload.config import ConfigError, parse_config
from workload.stop import HOLD_VARIABLE, hold_after_step
from workload.train import train

STEPS = 200  # 4 epochs of 1600 examples at 2 x 16
JOB = (
    *TINY,
    *("--epochs", "4", "--batch-size", "16", "--lr", "2e-3", "--dropout", "0.1"),
    *("--log-every", "10", "--eval-every", "50", "--checkpoint-every", "40"),
    *("--keep-checkpoints", "2", "--device", "cpu", "--seed", "7"),
)

#: Runs train.py with a checkpoint save that SIGKILLs its own process half-way: after
#: every file of the step's temporary directory is written, before the rename. The write
#: is the background writer's (workload/checkpoint_writer.py), never the training thread's.
KILL_DURING_SAVE = textwrap.dedent(
    """
    import os, signal, sys, threading
    sys.path.insert(0, {repo!r})
    import workload.checkpoint as checkpoint
    import workload.train as train

    real = checkpoint._fsync_tree

    def fsync_then_die(directory):
        if threading.current_thread() is threading.main_thread():
            raise SystemExit("a checkpoint was written on the training thread")
        real(directory)
        if "step_{step:08d}" in directory.name:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint._fsync_tree = fsync_then_die
    sys.exit(train.main())
    """
)


@pytest.fixture(scope="module")
def sample_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("data"), train=1600, test=400, seed=0)


@pytest.fixture(scope="module")
def reference(sample_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted job, started from a directory that is not the repository."""
    output = tmp_path_factory.mktemp("reference") / "job"
    elsewhere = tmp_path_factory.mktemp("cwd")
    result = run_train(
        ["--data", str(sample_data), "--output", str(output), *JOB], nproc=2, cwd=elsewhere
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return output


@pytest.mark.slow
def test_two_processes_learn_the_sample_task(reference: Path) -> None:
    result = summary(reference)
    assert result["world_size"] == 2
    assert result["step"] == STEPS
    assert result["eval_count"] == 400  # every test example, none twice
    assert result["final_eval_accuracy"] >= 0.90
    losses = [line["loss"] for line in events(reference, "train")]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:3]) / 3


@pytest.mark.slow
def test_outputs_of_a_job(reference: Path) -> None:
    train_lines = events(reference, "train")
    assert [line["step"] for line in train_lines] == list(range(10, STEPS + 1, 10))
    for line in train_lines:
        assert {"step", "loss", "lr", "samples_per_second", "tokens_per_second"} <= set(line)
        assert line["samples_per_second"] > 0
        assert line["tokens_per_second"] == pytest.approx(line["samples_per_second"] * 64, 1e-3)
        assert "xla_compiles" not in line
    assert [line["step"] for line in events(reference, "eval")] == [50, 100, 150, 200]
    result = summary(reference)
    for key in ("final_eval_accuracy", "total_time_s", "mean_samples_per_second", "mfu"):
        assert key in result
    assert result["mfu"] is None  # no known peak for a CPU
    assert result["flops_per_sample"] > 0
    assert [step for step, _ in list_checkpoints(reference)] == [160, 200]
    assert list((reference / "tensorboard").glob("events.out.tfevents.*"))
    assert (reference / "tokenizer" / "tokenizer.json").is_file()
    state = load_trainer_state(reference / "checkpoints" / "step_00000200")
    assert state["world_size"] == 2
    assert len(state["rng"]) == 2
    assert state["config"]["seed"] == 7


@pytest.mark.slow
def test_a_job_killed_during_a_save_resumes_to_the_same_parameters(
    reference: Path, sample_data: Path, tmp_path: Path
) -> None:
    output = tmp_path / "job"
    driver = tmp_path / "train_killed_during_save.py"
    driver.write_text(KILL_DURING_SAVE.format(repo=str(REPO), step=120))
    args = ["--data", str(sample_data), "--output", str(output), *JOB]

    killed = run_train(args, nproc=2, script=driver)
    assert killed.returncode != 0
    assert "Signals.SIGKILL" in killed.stderr or "SIGKILL" in killed.stderr
    leftovers = list((output / "checkpoints").glob(".tmp-step_00000120-*"))
    assert leftovers, "the save at step 120 should have been cut short"
    assert [step for step, _ in list_checkpoints(output)] == [40, 80]

    resumed = run_train(args, nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert not list((output / "checkpoints").glob(".tmp-*"))
    resumes = events(output, "resume")
    assert [(r["step"], Path(r["checkpoint"]).name) for r in resumes] == [(80, "step_00000080")]
    assert summary(output)["step"] == STEPS

    # Same data order, dropout masks, optimizer and schedule: the same parameters.
    final = load_file(str(output / "checkpoints" / "step_00000200" / "model.safetensors"))
    expected = load_file(str(reference / "checkpoints" / "step_00000200" / "model.safetensors"))
    assert final.keys() == expected.keys()
    different = [name for name in final if not torch.equal(final[name], expected[name])]
    assert different == []
    assert summary(output)["final_eval_accuracy"] == summary(reference)["final_eval_accuracy"]


# -- in-process jobs: one CPU process, a few steps -----------------------------------------------


@pytest.fixture(scope="module")
def small_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("small"), train=96, test=24, seed=3)


def _train_here(argv: list[str]) -> dict[str, Any]:
    config = parse_config(argv)
    with no_xla_side_effects():
        return train(config, setup_backend(config.device, config.precision))


SMALL = (*TINY, "--batch-size", "8", "--device", "cpu", "--log-every", "2")


@pytest.mark.usefixtures(single_thread.__name__)
def test_a_finished_job_resumes_to_its_summary(small_data: Path, tmp_path: Path) -> None:
    argv = ["--data", str(small_data), "--output", str(tmp_path), *SMALL, "--max-steps", "6"]
    first = _train_here(argv)
    assert first["step"] == 6
    again = _train_here(argv)
    assert again["step"] == 6
    assert again["resumed_from"] == str(tmp_path / "checkpoints" / "step_00000006")
    assert again["final_eval_accuracy"] == first["final_eval_accuracy"]
    assert [m["event"] for m in metrics(tmp_path)][-3:] == ["resume", "eval", "summary"]


@pytest.mark.usefixtures(single_thread.__name__)
def test_bf16_autocast_on_request(small_data: Path, tmp_path: Path) -> None:
    result = _train_here(
        ["--data", str(small_data), "--output", str(tmp_path), *SMALL, "--max-steps", "2",
         "--precision", "bf16"]
    )  # fmt: skip
    assert result["precision"] == "bf16"
    assert 0 <= result["final_eval_accuracy"] <= 1
    assert result["final_eval_loss"] > 0


@pytest.mark.usefixtures(single_thread.__name__)
def test_graph_extraction_skips_checkpoints_and_values(
    small_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEURON_EXTRACT_GRAPHS_ONLY", "1")
    result = _train_here(
        ["--data", str(small_data), "--output", str(tmp_path), *SMALL, "--max-steps", "4"]
    )
    assert result["graphs_only"] is True
    assert result["final_eval_accuracy"] is None
    assert all(line["loss"] is None for line in events(tmp_path, "train"))
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.usefixtures(single_thread.__name__)
def test_causal_lm_and_a_local_model_directory(small_data: Path, tmp_path: Path) -> None:
    first = tmp_path / "lm"
    result = _train_here(
        ["--data", str(small_data), "--output", str(first), *SMALL, "--task", "causal-lm",
         "--max-steps", "4", "--lr", "3e-3"]
    )  # fmt: skip
    assert result["task"] == "causal-lm"
    assert 0 < result["final_eval_accuracy"] < 1
    assert result["eval_count"] > 24  # tokens, not examples
    # A checkpoint directory is a model directory: fine-tune from it like from a hub name.
    checkpoint = first / "checkpoints" / "step_00000004"
    second = tmp_path / "from-checkpoint"
    again = _train_here(
        ["--data", str(small_data), "--output", str(second), *SMALL, "--task", "causal-lm",
         "--max-steps", "2", "--model", str(checkpoint)]
    )  # fmt: skip
    assert again["model"] == str(checkpoint)
    assert (small_data / ".token-cache").is_dir()  # a shared tokenizer's cache sits by the data
    shutil.rmtree(small_data / ".token-cache")


TOKENIZER_FINGERPRINT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {repo!r})
    from workload.data import find_split_files, read_split
    from workload.token_cache import tokenizer_fingerprint
    from workload.model import train_tiny_tokenizer
    from pathlib import Path

    raw = read_split(find_split_files(Path({data!r}), "train"), "classification")
    for task in ("classification", "causal-lm"):
        print(tokenizer_fingerprint(train_tiny_tokenizer(raw.texts(), task, 400)))
    """
)


def test_tiny_tokenizers_are_the_same_in_every_process(small_data: Path) -> None:
    # Hash seeds differ per process: only separate processes show a non-deterministic trainer.
    import subprocess
    import sys

    code = TOKENIZER_FINGERPRINT.format(repo=str(REPO), data=str(small_data))
    runs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True, text=True, check=True, env={**job_env(), "PYTHONHASHSEED": seed},
        ).stdout.split()
        for seed in ("1", "2")
    ]  # fmt: skip
    assert runs[0] == runs[1]
    assert len(set(runs[0])) == 2


# -- SIGTERM: a leg that ends at its time limit, an instance that shuts down ------------------


def _stopped_at(output: Path) -> int:
    """The step a SIGTERM stopped the job at, checked against the saved checkpoint."""
    result = summary(output)
    assert result["stopped_by_signal"] is True
    step = int(result["step"])
    assert [line["step"] for line in events(output, "stop")] == [step]
    assert list_checkpoints(output)[-1][0] == step
    state = load_trainer_state(output / "checkpoints" / f"step_{step:08d}")
    assert state["step"] == step
    return step


def test_sigterm_stops_at_a_log_step_saves_exits_0_and_the_job_resumes_there(
    small_data: Path, tmp_path: Path
) -> None:
    output = tmp_path / "job"
    job = ["--data", str(small_data), "--output", str(output), *SMALL, "--checkpoint-every", "0"]
    process = start_train([*job, "--max-steps", "100000"])
    first = wait_for_event(output, "train", process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    step = _stopped_at(output)
    assert step >= first["step"]
    assert step % 2 == 0  # a log step (--log-every 2): where the ranks agree to stop

    resumed = run_train([*job, "--max-steps", str(step + 4)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in events(output, "resume")] == [step]
    result = summary(output)
    assert result["step"] == step + 4
    assert result["stopped_by_signal"] is False
    assert [line["step"] for line in events(output, "train")][-2:] == [step + 2, step + 4]


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_at_the_same_step(
    small_data: Path, tmp_path: Path
) -> None:
    output = tmp_path / "job"
    job = ["--data", str(small_data), "--output", str(output), *SMALL, "--checkpoint-every", "0"]
    process = start_train([*job, "--max-steps", "100000"], nproc=2)
    wait_for_event(output, "train", process)
    workers = worker_pids(process.pid)
    assert sorted(workers) == [0, 1]
    os.kill(workers[1], signal.SIGTERM)  # rank 0 learns of it only through the agreement
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]  # torchrun: every worker exited 0
    step = _stopped_at(output)
    state = load_trainer_state(output / "checkpoints" / f"step_{step:08d}")
    assert state["world_size"] == 2 and len(state["rng"]) == 2

    resumed = run_train([*job, "--max-steps", str(step + 2)], nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in events(output, "resume")] == [step]
    assert summary(output)["step"] == step + 2


# -- the hold of rehearsals: training waits at a known step until a stop is requested --------


@pytest.mark.slow
def test_a_held_job_waits_after_its_step_and_a_stop_then_runs_as_always(
    small_data: Path, tmp_path: Path
) -> None:
    """TRAINIUM_HOLD_AFTER_STEP=5 (workload/stop.py): both ranks wait after step 5; SIGTERM to
    one of them ends the wait on both, and the stop runs as it does without a hold: at the
    next log step the ranks agree on (6), with its checkpoint, exit 0. A job that did not
    hold would stop at whatever step the signal met."""
    output = tmp_path / "job"
    job = ["--data", str(small_data), "--output", str(output), *SMALL, "--checkpoint-every", "4"]
    process = start_train([*job, "--max-steps", "100000"], nproc=2, extra_env={HOLD_VARIABLE: "5"})
    held = wait_for_event(output, "hold", process)
    assert held["step"] == 5
    # Held, nothing moves however long the test takes: 2 s are dozens of this job's steps.
    time.sleep(2)
    assert [line["step"] for line in events(output, "train")] == [2, 4]
    workers = worker_pids(process.pid)
    os.kill(workers[1], signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    assert _stopped_at(output) == 6
    assert [line["step"] for line in events(output, "train")] == [2, 4, 6]
    assert [c for c, _ in list_checkpoints(output)] == [4, 6]


@pytest.mark.parametrize("value", ["soon", "0", "-3", "2.5", "٣"])
def test_a_hold_step_that_is_not_a_step_is_refused_in_one_line(value: str) -> None:
    with pytest.raises(ConfigError) as refused:
        hold_after_step({HOLD_VARIABLE: value})
    assert str(refused.value) == (
        f"{HOLD_VARIABLE} {value!r} is not a step: use a whole number of at least 1, or leave "
        "it unset (it holds the trainers after that step for rehearsals of faults)"
    )
    assert hold_after_step({HOLD_VARIABLE: "12"}) == 12
    assert hold_after_step({}) is None


# -- resume: reading the trainer state, seeding the Neuron runtime ---------------------------


class _Rank:
    """The parts of a Backend that ``read_once`` uses, for one rank of a job whose other ranks
    say what ``errors`` and ``broadcast`` stand for."""

    def __init__(self, rank: int, errors: list[Any], broadcast: Any = None) -> None:
        self.rank, self.is_main = rank, rank == 0
        self.errors, self.broadcast = errors, broadcast
        self.reads = 0

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj if r == self.rank else e for r, e in enumerate(self.errors)]

    def broadcast_object(self, obj: Any) -> Any:
        return obj if self.is_main else self.broadcast


def test_the_trainer_state_is_read_by_rank_0_alone_and_reaches_every_rank() -> None:
    from workload.turns import read_once

    ranks = [_Rank(r, [None] * 4, broadcast={"step": 8}) for r in range(4)]
    results = []
    for rank in ranks:

        def read(rank: _Rank = rank) -> dict[str, int]:
            rank.reads += 1
            return {"step": 8}

        results.append(read_once(cast(Any, rank), read))
    assert [rank.reads for rank in ranks] == [1, 0, 0, 0]
    assert results == [{"step": 8}] * 4


def test_a_read_error_on_rank_0_is_raised_on_every_rank() -> None:
    from workload.checkpoint import CheckpointError
    from workload.turns import SharedError, read_once

    message = "step_00000008/trainer_state.pt: not a trainer state"

    def broken() -> None:
        raise CheckpointError(message)

    # Rank 0's error travels with its exit status (workload/turns.py exit_status): 1 for a
    # checkpoint, 2 for the job's own input (its data, its flags).
    for rank in range(3):
        backend: Any = _Rank(rank, [(message, 1), None, None])
        with pytest.raises(SharedError, match="not a trainer state") as raised:
            read_once(backend, broken)
        assert raised.value.status == 1


def test_the_stochastic_rounding_seed_follows_the_seed_and_the_resume_step(tmp_path: Path) -> None:
    from workload.checkpoint import REQUIRED_FILES
    from workload.config import parse_config
    from workload.train import stochastic_rounding_seed

    def seed_for(seed: int) -> str:
        args = ["--data", "d", "--output", str(tmp_path), "--seed", str(seed)]
        return stochastic_rounding_seed(parse_config(args))

    fresh = seed_for(7)
    assert fresh == str(7 * 1_000_003) and fresh == seed_for(7)
    assert seed_for(8) != fresh
    checkpoint = tmp_path / "checkpoints" / "step_00000120"
    checkpoint.mkdir(parents=True)
    for name in REQUIRED_FILES:
        (checkpoint / name).touch()
    assert seed_for(7) == str(7 * 1_000_003 + 120)
