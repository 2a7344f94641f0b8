"""The XLA code path for real: torch-xla 2.9 on the CPU (PJRT_DEVICE=CPU), as on Trainium
minus the Neuron compiler.

One XLA job and one eager job start from the same initial model directory and train the
same steps on the same data. The XLA job must stop compiling after warm-up (first steps
and first evaluation), through epochs, evaluations and checkpoint saves; both must agree
on the losses within float tolerance and on the accuracy; and each one's checkpoint must
evaluate to the same accuracy on the other device.

torch-xla's CPU client runs collectives neither across processes (each torchrun process
gets its own single-device PJRT client) nor across threads (pytorch/xla#5005, #9089), so
the XLA jobs here are single-process; the data-parallel parts of the same code path run
with 2 processes in test_workload_train.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.workload_support import (
    REPO,
    error_lines,
    events,
    make_data,
    metrics,
    no_xla_side_effects,
    run_train,
    single_thread,
    summary,
)
from workload.backend import Backend
from workload.batches import EvalBatches, make_loader
from workload.config import TrainConfig
from workload.data import find_split_files, read_split
from workload.engine import evaluate
from workload.model import build_model, train_tiny_tokenizer
from workload.token_cache import TokenizedSplit

pytestmark = [pytest.mark.xla, pytest.mark.slow]

STEPS = 80  # 4 epochs of 640 examples at batch 32: crosses three epoch boundaries
LOSS_TOLERANCE = 1e-4  # absolute, on losses of 0.2 to 0.7 (measured: 2.4e-6 after 80 steps)


def _job(data: Path, model: Path, output: Path, device: str) -> list[str]:
    return [
        *("--data", str(data), "--model", str(model), "--output", str(output)),
        *("--device", device, "--max-length", "64", "--batch-size", "32"),
        *("--max-steps", str(STEPS), "--lr", "2e-3", "--dropout", "0", "--seed", "11"),
        *("--log-every", "5", "--eval-every", "20", "--checkpoint-every", "20"),
        *("--keep-checkpoints", "5"),
    ]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("xla-data"), train=640, test=150, seed=5)


@pytest.fixture(scope="module")
def initial_model(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one starting point of both jobs: a tiny BERT and its tokenizer, saved."""
    directory = tmp_path_factory.mktemp("initial")
    config = TrainConfig(
        data=str(data), output="unused", tiny_hidden_size=64, tiny_heads=4,
        tiny_vocab_size=1000, max_length=64, dropout=0.0,
    )  # fmt: skip
    raw = read_split(find_split_files(data, "train"), "classification")
    with no_xla_side_effects():
        tokenizer = train_tiny_tokenizer(raw.texts(), "classification", 1000)
        torch.manual_seed(0)
        model = build_model(config, tokenizer)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def xla_job(data: Path, initial_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("xla") / "job"
    result = run_train(_job(data, initial_model, output, "xla"), nproc=1, xla=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return output


@pytest.fixture(scope="module")
def eager_job(data: Path, initial_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("eager") / "job"
    result = run_train(_job(data, initial_model, output, "cpu"), nproc=1)
    assert result.returncode == 0, result.stderr[-4000:]
    return output


def test_no_compilation_after_warm_up(xla_job: Path) -> None:
    lines = [m for m in metrics(xla_job) if m["event"] in ("train", "eval")]
    assert all("xla_compiles" in line for line in lines)
    first_eval = next(i for i, line in enumerate(lines) if line["event"] == "eval")
    warm = lines[first_eval]["xla_compiles"]
    assert 0 < warm <= 10
    # Later: 60 more steps, three epoch boundaries, three evaluations, four checkpoint saves.
    after = lines[first_eval:]
    assert [line["xla_compiles"] for line in after] == [warm] * len(after)
    assert all(line["xla_compiles_after_warmup"] == 0 for line in after)
    result = summary(xla_job)
    assert result["xla_compiles"] == warm
    assert result["xla_compiles_after_warmup"] == 0
    assert result["device"] == "xla:CPU"
    assert result["precision"] == "fp32"
    assert [p.name for p in sorted((xla_job / "checkpoints").iterdir())] == [
        "step_00000020", "step_00000040", "step_00000060", "step_00000080",
    ]  # fmt: skip


def test_xla_matches_eager(xla_job: Path, eager_job: Path) -> None:
    xla_train, eager_train = events(xla_job, "train"), events(eager_job, "train")
    assert [m["step"] for m in xla_train] == [m["step"] for m in eager_train]
    gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(xla_train, eager_train, strict=True)]
    assert max(gaps) < LOSS_TOLERANCE, gaps
    for a, b in zip(events(xla_job, "eval"), events(eager_job, "eval"), strict=True):
        assert a["step"] == b["step"]
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], abs=LOSS_TOLERANCE)
        # The seeds' bar between devices: under 0.1% difference in model quality.
        assert abs(a["eval_accuracy"] - b["eval_accuracy"]) < 0.001
    assert summary(xla_job)["final_eval_accuracy"] > 0.85  # it learned


@pytest.mark.usefixtures(single_thread.__name__)
def test_an_xla_checkpoint_evaluates_the_same_on_eager_cpu(xla_job: Path, data: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    checkpoint = xla_job / "checkpoints" / f"step_{STEPS:08d}"
    with no_xla_side_effects():
        model: Any = AutoModelForSequenceClassification.from_pretrained(checkpoint)
    (cache,) = (data / ".token-cache").glob("test-*")
    split = TokenizedSplit(cache, "classification")
    loader = make_loader(
        split, EvalBatches(len(split), 32, 0, 1), num_workers=0, pin_memory=False, seed=0
    )
    result = evaluate(
        model, loader, Backend(kind="cpu", device=torch.device("cpu")), "classification"
    )
    assert result.count == 150
    assert result.accuracy == summary(xla_job)["final_eval_accuracy"]


def test_an_eager_checkpoint_evaluates_the_same_under_xla(
    eager_job: Path, data: Path, initial_model: Path, tmp_path: Path
) -> None:
    # Resuming a finished job only evaluates: the eager job's output, continued under XLA.
    output = tmp_path / "job"
    shutil.copytree(eager_job, output)
    result = run_train(_job(data, initial_model, output, "xla"), nproc=1, xla=True)
    assert result.returncode == 0, result.stderr[-4000:]
    resumed = summary(output)
    assert resumed["device"] == "xla:CPU"
    assert resumed["resumed_from"].endswith(f"step_{STEPS:08d}")
    assert resumed["final_eval_accuracy"] == summary(eager_job)["final_eval_accuracy"]
    assert resumed["final_eval_loss"] == pytest.approx(
        summary(eager_job)["final_eval_loss"], abs=1e-4
    )


def test_two_xla_processes_on_cpu_are_refused_clearly(
    data: Path, initial_model: Path, tmp_path: Path
) -> None:
    result = run_train(_job(data, initial_model, tmp_path / "job", "xla"), nproc=2, xla=True)
    assert result.returncode != 0
    lines = error_lines(result.stderr)
    assert lines, result.stderr[-3000:]
    assert (
        "torchrun started 2 processes but the XLA runtime (PJRT_DEVICE=CPU) sees a world of 1"
        in lines[0]
    ), result.stderr[-6000:]
    # torchrun reports the failed workers with its own traceback; none runs through ours.
    assert 'File "' + str(REPO / "workload") not in result.stderr
