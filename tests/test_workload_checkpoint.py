"""Checkpoints: portable files, atomic saves, keep-K, and crashes in the middle of a save."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.workload_support import no_xla_side_effects, single_thread
from workload import checkpoint
from workload.backend import Backend
from workload.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_model_weights,
    load_trainer_state,
    remove_partial,
    save_checkpoint,
    to_cpu,
)
from workload.checkpoint_writer import CheckpointWriter
from workload.config import TrainConfig
from workload.engine import build_optimizer
from workload.model import build_model, train_tiny_tokenizer

TEXTS = [f"the item is {w} and {v}" for w in ("great", "bad", "fine") for v in ("new", "old")] * 5

pytestmark = pytest.mark.usefixtures(single_thread.__name__)


def _tiny(task: str) -> tuple[Any, Any]:
    config = TrainConfig(
        data="d", output="o", task=task, tiny_hidden_size=16, tiny_heads=2, tiny_vocab_size=120,
        max_length=16,
    )  # fmt: skip
    with no_xla_side_effects():
        tokenizer = train_tiny_tokenizer(TEXTS, task, 120)
        torch.manual_seed(0)
        return build_model(config, tokenizer), tokenizer


@pytest.fixture(scope="module")
def bert() -> tuple[Any, Any]:
    return _tiny("classification")


def _state(step: int, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    cpu = Backend(kind="cpu", device=torch.device("cpu"))
    return {
        "format_version": FORMAT_VERSION,
        "step": step,
        "optimizer": to_cpu(optimizer.state_dict()),
        "rng": [cpu.rng_state()],
        "config": {"seed": 1, "model": "tiny"},
    }


def _trained_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    optimizer = build_optimizer(model, 1e-3, 0.01)
    ids = torch.randint(5, 60, (2, 8))
    model(input_ids=ids, labels=torch.tensor([0, 1])).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


def test_a_checkpoint_loads_with_plain_tools(tmp_path: Path, bert: tuple[Any, Any]) -> None:
    model, tokenizer = bert
    optimizer = _trained_optimizer(model)
    path = save_checkpoint(tmp_path, 5, model, tokenizer, _state(5, optimizer), keep=3)
    assert path == tmp_path / "checkpoints" / "step_00000005"
    weights = load_file(str(path / "model.safetensors"))
    assert all(t.device.type == "cpu" for t in weights.values())
    for name, tensor in model.state_dict().items():
        assert torch.equal(weights[name], tensor)
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    assert state["step"] == 5
    assert set(state["optimizer"]["state"]) == set(optimizer.state_dict()["state"])
    assert "seed: 1" in (path / "train_config.yaml").read_text()
    # The directory is a Hugging Face model directory: from_pretrained (and --model) load it.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    with no_xla_side_effects():
        loaded = AutoModelForSequenceClassification.from_pretrained(path)
        loaded_tokenizer = AutoTokenizer.from_pretrained(path)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name])
    assert (
        loaded_tokenizer("the item is great")["input_ids"]
        == tokenizer("the item is great")["input_ids"]
    )


def test_round_trip_restores_model_optimizer_and_rng(tmp_path: Path, bert: tuple[Any, Any]) -> None:
    model, tokenizer = bert
    optimizer = _trained_optimizer(model)
    cpu = Backend(kind="cpu", device=torch.device("cpu"))
    random.seed(3)
    torch.manual_seed(3)
    path = save_checkpoint(tmp_path, 1, model, tokenizer, _state(1, optimizer), keep=1)
    expected = (random.random(), torch.rand(3))

    fresh, _ = _tiny("classification")
    load_model_weights(path, fresh)
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name])
    state = load_trainer_state(path)
    new_optimizer = build_optimizer(fresh, 1e-3, 0.01)
    new_optimizer.load_state_dict(state["optimizer"])
    old, new = optimizer.state_dict()["state"], new_optimizer.state_dict()["state"]
    for key in old:
        assert torch.equal(old[key]["exp_avg"], new[key]["exp_avg"])
    cpu.seed(99)
    cpu.set_rng_state(state["rng"][0])
    assert random.random() == expected[0]
    assert torch.equal(torch.rand(3), expected[1])


def test_tied_weights_are_stored_once_and_restored(tmp_path: Path) -> None:
    model, tokenizer = _tiny("causal-lm")
    optimizer = build_optimizer(model, 1e-3, 0.0)
    path = save_checkpoint(tmp_path, 2, model, tokenizer, _state(2, optimizer), keep=1)
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    fresh, _ = _tiny("causal-lm")
    torch.nn.init.zeros_(fresh.transformer.wte.weight)
    load_model_weights(path, fresh)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight


def test_a_checkpoint_that_does_not_fit_is_refused(tmp_path: Path, bert: tuple[Any, Any]) -> None:
    model, tokenizer = bert
    path = save_checkpoint(
        tmp_path, 1, model, tokenizer, _state(1, build_optimizer(model, 1, 0)), keep=1
    )
    other, _ = _tiny("causal-lm")
    with pytest.raises(CheckpointError, match="does not fit the model"):
        load_model_weights(path, other)


def test_only_the_newest_k_are_kept(tmp_path: Path, bert: tuple[Any, Any]) -> None:
    model, tokenizer = bert
    optimizer = build_optimizer(model, 1e-3, 0.01)
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, model, tokenizer, _state(step, optimizer), keep=2)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [30, 40]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_00000040"


def test_a_failure_during_a_save_keeps_the_previous_checkpoint(
    tmp_path: Path, bert: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = bert
    optimizer = build_optimizer(model, 1e-3, 0.01)
    good = save_checkpoint(tmp_path, 10, model, tokenizer, _state(10, optimizer), keep=1)
    real_save = torch.save

    def crash_half_way(obj: object, path: Any, *args: Any, **kwargs: Any) -> None:
        with Path(path).open("wb") as handle:  # a truncated file, then the crash
            handle.write(b"PK\x03\x04 partial")
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(checkpoint.torch, "save", crash_half_way)
    with pytest.raises(OSError, match="Input/output error"):
        save_checkpoint(tmp_path, 20, model, tokenizer, _state(20, optimizer), keep=1)
    monkeypatch.setattr(checkpoint.torch, "save", real_save)
    assert latest_checkpoint(tmp_path) == good
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000010"]
    assert load_trainer_state(good)["step"] == 10


def test_a_save_killed_half_way_is_ignored_and_cleaned_up(
    tmp_path: Path, bert: tuple[Any, Any]
) -> None:
    model, tokenizer = bert
    optimizer = build_optimizer(model, 1e-3, 0.01)
    good = save_checkpoint(tmp_path, 10, model, tokenizer, _state(10, optimizer), keep=3)
    # What a SIGKILL in the middle of the next save leaves: a temporary directory with
    # some of the files, and a step directory that was never renamed into place.
    partial = tmp_path / "checkpoints" / f".tmp-step_00000020-{os.getpid()}"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\x00" * 10)
    incomplete = tmp_path / "checkpoints" / "step_00000030"
    incomplete.mkdir()
    (incomplete / "config.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == good
    remove_partial(tmp_path)
    assert not partial.exists()
    assert load_trainer_state(good)["step"] == 10


def test_trainer_state_of_another_version_is_refused(tmp_path: Path, bert: tuple[Any, Any]) -> None:
    model, tokenizer = bert
    state = {**_state(1, build_optimizer(model, 1e-3, 0.01)), "format_version": 99}
    path = save_checkpoint(tmp_path, 1, model, tokenizer, state, keep=1)
    with pytest.raises(CheckpointError, match="not a trainer state this version reads"):
        load_trainer_state(path)


# -- saves written beside the training (workload/checkpoint_writer.py) -------------------------


def test_a_save_is_written_while_training_goes_on_with_the_weights_of_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = _tiny("classification")
    optimizer = _trained_optimizer(model)
    at_step = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    writing, release = threading.Event(), threading.Event()
    real = checkpoint.save_checkpoint

    def held(*args: Any, **kwargs: Any) -> Path:
        writing.set()
        assert release.wait(timeout=300)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_checkpoint", held)
    writer = CheckpointWriter(tmp_path, tokenizer, keep=2)
    writer.submit(5, model, _state(5, optimizer))
    assert writing.wait(timeout=300)
    # submit has returned with the write in flight: the next step changes the weights.
    assert writer.in_flight
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    optimizer.step()
    assert latest_checkpoint(tmp_path) is None  # complete or absent
    release.set()
    writer.wait()
    weights = load_file(str(tmp_path / "checkpoints" / "step_00000005" / "model.safetensors"))
    assert weights.keys() == at_step.keys()
    assert all(torch.equal(weights[name], at_step[name]) for name in weights)


def test_one_save_in_flight_at_a_time_and_the_newest_k_kept(
    tmp_path: Path, bert: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = bert
    optimizer = build_optimizer(model, 1e-3, 0.01)
    real = checkpoint.save_checkpoint
    writing: list[int] = []
    overlapped: list[list[int]] = []

    def recorded(output: Path, step: int, *args: Any, **kwargs: Any) -> Path:
        writing.append(step)
        if len(writing) > 1:
            overlapped.append(list(writing))
        try:
            return real(output, step, *args, **kwargs)
        finally:
            writing.remove(step)

    monkeypatch.setattr(checkpoint, "save_checkpoint", recorded)
    writer = CheckpointWriter(tmp_path, tokenizer, keep=2)
    for step in (10, 20, 30, 40):
        writer.submit(step, model, _state(step, optimizer))
    writer.wait()
    assert overlapped == []
    assert [step for step, _ in list_checkpoints(tmp_path)] == [30, 40]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_a_background_write_that_fails_is_raised_at_the_next_check_in_one_line(
    tmp_path: Path, bert: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = bert
    optimizer = build_optimizer(model, 1e-3, 0.01)
    writer = CheckpointWriter(tmp_path, tokenizer, keep=2)
    writer.submit(10, model, _state(10, optimizer))
    writer.wait()

    def disk_full(obj: object, path: Any, *args: Any, **kwargs: Any) -> None:
        Path(path).write_bytes(b"PK\x03\x04 partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    writer.submit(20, model, _state(20, optimizer))
    expected = (
        f"checkpoint {tmp_path}/checkpoints/step_00000020 could not be written (OSError: "
        "[Errno 28] No space left on device); the previous checkpoint is the latest"
    )
    with pytest.raises(CheckpointError) as failed:
        writer.wait()
    assert str(failed.value) == expected
    with pytest.raises(CheckpointError):
        writer.check()  # and at every step after it
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_00000010"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000010"]
