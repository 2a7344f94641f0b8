"""The model as ``build_model`` gives it: nothing left for the first forward to decide.

On CUDA the trainer runs the forward through ``torch.compile``. Two things transformers 5
decides inside the first forward cost a compiled step (found in the H100 profile, README):
BERT sets ``config.problem_type`` on its first call (Dynamo's guard on it fails at the
second step: a recompile), and GPT-2's ``loss_function`` logs a warning on every call
because ``loss_type`` is unset (a graph break). Dynamo decides graphs, breaks and guards
whatever the backend, so these tests compile with the ``eager`` backend on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.workload_support import no_xla_side_effects, single_thread
from workload.backend import Backend
from workload.bench_device import dynamo_stats
from workload.config import TrainConfig
from workload.engine import TASKS, TrainStep, build_optimizer
from workload.model import build_model, train_tiny_tokenizer

pytestmark = pytest.mark.usefixtures(single_thread.__name__)

CPU = Backend(kind="cpu", device=torch.device("cpu"))
TEXTS = [f"this {w} thing is {v}" for w in ("red", "blue", "odd") for v in ("good", "bad")] * 4
LENGTH = 16


def _tiny(task: str) -> Any:
    config = TrainConfig(
        data="d", output="o", task=task, tiny_hidden_size=32, tiny_layers=1, tiny_heads=2,
        tiny_vocab_size=100, max_length=LENGTH,
    )  # fmt: skip
    with no_xla_side_effects():
        tokenizer = train_tiny_tokenizer(TEXTS, task, 100)
        torch.manual_seed(0)
        return build_model(config, tokenizer)


def _batch(task: str, seed: int, *, padded: bool) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (4, LENGTH), generator=generator)
    mask = torch.ones_like(ids)
    if padded:
        mask[:, LENGTH // 2 :] = 0
        ids = ids * mask
    if task == "classification":
        labels = (ids[:, 1] > 50).long()
    else:
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.fixture
def eager_compile(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``torch.compile`` with Dynamo only (the ``eager`` backend): no Inductor build on two
    CPU cores, the same graphs, graph breaks and guards."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures(eager_compile.__name__)
@pytest.mark.parametrize("task", TASKS)
def test_the_compiled_forward_is_one_graph_that_never_recompiles(task: str) -> None:
    model = _tiny(task)
    optimizer = build_optimizer(model, 1e-3, 0.01)
    step = TrainStep(model, optimizer, None, CPU, compile=True)  # as on CUDA
    assert step.compiled
    before = dynamo_stats()
    # Padded and unpadded batches, as real text gives them; a fresh model's first steps.
    for seed, padded in ((0, True), (1, False), (2, True), (3, False)):
        assert torch.isfinite(step(_batch(task, seed, padded=padded)))
    after = dynamo_stats()
    breaks = {
        reason: count - before["breaks"].get(reason, 0)
        for reason, count in after["breaks"].items()
        if count != before["breaks"].get(reason, 0)
    }
    assert breaks == {}
    assert after["recompiles"][len(before["recompiles"]) :] == []
    assert after["graphs"] - before["graphs"] == 1


def test_the_loss_is_settled_when_the_model_is_built() -> None:
    bert, gpt2 = _tiny("classification"), _tiny("causal-lm")
    assert bert.config.problem_type == "single_label_classification"
    assert gpt2.loss_type == "ForCausalLM"
    # What transformers itself would compute: the same losses as the default path.
    batch = _batch("causal-lm", 0, padded=True)
    settled = gpt2(**batch).loss
    gpt2.loss_type = None
    assert torch.equal(gpt2(**batch).loss, settled)
