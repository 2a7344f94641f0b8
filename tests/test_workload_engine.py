"""The shared training step, evaluation, the lr schedule and the FLOP/MFU arithmetic."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.workload_support import no_xla_side_effects, single_thread
from workload.backend import Backend, BackendError, resolve_device_kind
from workload.config import TrainConfig
from workload.engine import (
    TrainStep,
    build_optimizer,
    build_scheduler,
    evaluate,
    flops_per_sample,
    lr_factor,
    mfu,
    peak_flops_per_device,
)
from workload.model import build_model, train_tiny_tokenizer

CPU = Backend(kind="cpu", device=torch.device("cpu"))
TEXTS = [f"this {w} thing is {v}" for w in ("red", "blue", "odd") for v in ("good", "bad")] * 4

pytestmark = pytest.mark.usefixtures(single_thread.__name__)


def _model(task: str, hidden: int = 32, layers: int = 2) -> Any:
    config = TrainConfig(
        data="d", output="o", task=task, tiny_hidden_size=hidden, tiny_layers=layers,
        tiny_heads=2, tiny_vocab_size=100, max_length=12,
    )  # fmt: skip
    with no_xla_side_effects():
        tokenizer = train_tiny_tokenizer(TEXTS, task, 100)
        torch.manual_seed(0)
        return build_model(config, tokenizer)


def _batch(n: int, length: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (n, length), generator=generator)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": (ids[:, 1] > 50).long(),
        "weight": torch.ones(n),
    }


def test_lr_schedule_warms_up_decays_and_never_hits_zero() -> None:
    factors = [lr_factor(step, 10, 100) for step in range(100)]
    assert factors[0] == pytest.approx(1 / 11)
    assert max(factors) == factors[10] == 1.0
    assert factors[99] == pytest.approx(1 / 90)
    assert all(f > 0 for f in factors)
    assert all(a < b for a, b in itertools.pairwise(factors[:11]))
    assert all(a > b for a, b in itertools.pairwise(factors[10:]))


def test_train_step_learns_and_reports_the_mean_loss() -> None:
    model = _model("classification")
    optimizer = build_optimizer(model, 3e-3, 0.01)
    step = TrainStep(model, optimizer, build_scheduler(optimizer, 2, 25), CPU)
    assert not step.compiled  # torch.compile is for cuda only unless asked
    batch = _batch(16)
    losses = [step(batch).item() for _ in range(25)]
    assert losses[-1] < 0.5 * losses[0]
    assert step.pop_mean_loss() == pytest.approx(sum(losses) / len(losses))
    assert [step(batch).item(), step(batch).item()] == pytest.approx(losses[-2:], rel=0.5)
    assert step.pop_mean_loss() < losses[0]
    assert step.last_lr > 0


@dataclass
class _TwoRanks(Backend):
    """Rank 0 of two on the CPU; the other rank's loss sum is this rank's + ``other_extra``."""

    other_extra: float = 0.0
    reduced: int = 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.reduced += 1
        return tensor + (tensor + self.other_extra)


def test_the_logged_loss_is_the_mean_over_ranks() -> None:
    model = _model("classification")
    optimizer = build_optimizer(model, 1e-3, 0.01)
    # Over 3 steps the other rank's losses are 1 higher each: its sum is 3 higher.
    two = _TwoRanks(kind="cpu", device=torch.device("cpu"), world_size=2, other_extra=3.0)
    step = TrainStep(model, optimizer, None, two)
    losses = [step(_batch(8, seed=s)).item() for s in range(3)]
    assert two.reduced == 0  # off XLA the steps reduce nothing: one all-reduce per log line
    assert step.pop_mean_loss() == pytest.approx(sum(losses) / 3 + 0.5)
    assert two.reduced == 1


def test_bf16_leaves_weights_optimizer_state_and_evaluation_sums_in_full_precision() -> None:
    bf16 = Backend(kind="cpu", device=torch.device("cpu"), autocast_dtype=torch.bfloat16)
    model = _model("classification")
    optimizer = build_optimizer(model, 1e-3, 0.01)
    step = TrainStep(model, optimizer, None, bf16)
    for seed in range(2):
        step(_batch(8, seed=seed))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    state = [v for s in optimizer.state.values() for k, v in s.items() if k != "step"]
    assert state and {v.dtype for v in state} == {torch.float32}
    # 301 examples: a bf16 count rounds above 256 (to 300 or 302); the int32 counts do not.
    result = evaluate(model, [_batch(43, seed=s) for s in range(7)], bf16, "classification")
    assert result.count == 301
    correct = result.accuracy * 301
    assert correct == pytest.approx(round(correct), abs=1e-9)


def test_no_decay_for_biases_and_layer_norms() -> None:
    model = _model("classification")
    decay, no_decay = build_optimizer(model, 1e-3, 0.1).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_padding_rows_do_not_count_in_evaluation() -> None:
    model = _model("classification")
    batch = _batch(6)
    exact = evaluate(model, [batch], CPU, "classification")
    padded = {k: torch.cat([v, v[:2]]) for k, v in batch.items()}
    padded["weight"] = torch.tensor([1.0] * 6 + [0.0] * 2)
    with_padding = evaluate(model, [padded], CPU, "classification")
    assert with_padding.count == exact.count == 6
    assert with_padding.accuracy == pytest.approx(exact.accuracy)
    assert with_padding.loss == pytest.approx(exact.loss, rel=1e-5)
    logits = model(input_ids=batch["input_ids"]).logits
    assert exact.accuracy == pytest.approx(
        (logits.argmax(-1) == batch["labels"]).float().mean().item()
    )


def test_causal_lm_evaluation_counts_real_next_tokens() -> None:
    model = _model("causal-lm")
    batch = _batch(4)
    batch["attention_mask"][:, 9:] = 0
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    result = evaluate(model, [batch], CPU, "causal-lm")
    assert result.count == 4 * 8  # 9 real tokens per row predict 8 next tokens
    reference = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        labels=batch["labels"],
    ).loss
    assert result.loss == pytest.approx(reference.item(), rel=1e-4)


def test_flops_per_sample_follows_the_formula() -> None:
    hidden, layers, seq = 32, 2, 12
    bert = _model("classification", hidden, layers)
    # per layer: Q, K, V, O (h*h each) + FFN (2 * h*4h); pooler h*h; classifier h*2
    matmul = layers * (4 * hidden * hidden + 8 * hidden * hidden) + hidden * hidden + hidden * 2
    expected = 6 * matmul * seq + 12 * layers * hidden * seq * seq
    assert flops_per_sample(bert, seq) == expected
    gpt2 = _model("causal-lm", hidden, layers)
    vocab = gpt2.config.vocab_size
    # GPT-2's Conv1D layers count, and the tied LM head counts once, as a matmul
    matmul = layers * 12 * hidden * hidden + vocab * hidden
    assert flops_per_sample(gpt2, seq) == 6 * matmul * seq + 12 * layers * hidden * seq * seq


def test_peak_flops_and_mfu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert peak_flops_per_device(CPU) is None
    assert mfu(100.0, 1e9, 2, None) is None
    assert peak_flops_per_device(CPU, override_tflops=50.0) == 50e12
    gpu = Backend(kind="cuda", device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops_per_device(gpu) == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-40GB")
    assert peak_flops_per_device(gpu) == 312e12
    monkeypatch.setattr(
        torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce GTX 1080"
    )
    assert peak_flops_per_device(gpu) is None
    neuron = Backend(kind="xla", device=torch.device("cpu"), xla_device_type="NEURON")
    monkeypatch.setenv("INSTANCE_TYPE", "trn1.32xlarge")
    assert peak_flops_per_device(neuron) == 95e12
    monkeypatch.setenv("INSTANCE_TYPE", "trn2.48xlarge")
    assert peak_flops_per_device(neuron) == 166.75e12
    xla_cpu = Backend(kind="xla", device=torch.device("cpu"), xla_device_type="CPU")
    assert peak_flops_per_device(xla_cpu) is None
    # 32 NeuronCores at 95 TFLOP/s each, 1000 samples/s of 1 TFLOP each: 1e15 / 3.04e15
    assert mfu(1000.0, 1e12, 32, 95e12) == pytest.approx(1e15 / (32 * 95e12))


def test_device_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    import workload

    monkeypatch.setattr(workload, "PJRT_DEVICE_AT_START", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("workload.backend._neuron_present", lambda: False)
    assert resolve_device_kind("auto") == "cpu"
    monkeypatch.setattr(workload, "PJRT_DEVICE_AT_START", "CPU")
    assert resolve_device_kind("auto") == "xla"
    assert resolve_device_kind("cpu") == "cpu"
    with pytest.raises(BackendError, match="no CUDA device is visible"):
        resolve_device_kind("cuda")
