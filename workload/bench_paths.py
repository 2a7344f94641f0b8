"""The benchmark's paths: each one a way to train the same model on the same batches.

A path is a ``Runner``: ``run(steps, skip)`` takes ``skip`` untimed steps, then times a block
of ``steps`` steps from a finished device to a finished device. ``PATHS`` names them, in the
order ``--paths`` lists them by default:

- ``trainer``: ``engine.TrainStep``, set up the way train.py sets it up;
- ``plain``: the textbook PyTorch loop;
- ``hf-trainer``: the Hugging Face ``Trainer`` (where transformers and accelerate allow it).

To add a path, write a function that builds its ``Runner`` from ``PathInputs`` and a model
(a ``StepRunner`` around a step function, or a ``Runner`` subclass for a framework that owns
its loop) and add it to ``PATHS``, with the reason it cannot run where that applies.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workload.backend import Backend
from workload.config import TrainConfig
from workload.engine import TrainStep, build_optimizer, build_scheduler, model_inputs

#: One batch as the trainer's data loader gives it: name -> tensor.
Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class PathInputs:
    """What every path is built from, besides its model (each path gets fresh weights)."""

    backend: Backend
    config: TrainConfig
    batches: list[Batch]
    total_steps: int  # warm-up and timed steps: the length of the learning-rate schedule
    workdir: Path  # scratch space of this path


class Runner:
    """Runs timed steps of one path; subclasses say how a step is taken."""

    name = ""  # its key in PATHS: results are filed under it

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.features: list[str] = []

    def run(self, steps: int, skip: int) -> float:
        """Take ``skip + steps`` steps; return the wall time of the last ``steps``, from a
        finished device to a finished device, with no wait for the device between them."""
        raise NotImplementedError

    def resident_bytes(self) -> int:
        """Device memory this path holds between steps (parameters, gradients, optimizer)."""
        return 0


def _tensor_bytes(tensors: Iterator[Any], device: torch.device) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in tensors
        if isinstance(t, torch.Tensor) and t.device.type == device.type
    )


def _state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device
) -> int:
    """Bytes of parameters, gradients and optimizer state on ``device``."""
    params = list(model.parameters())
    total = _tensor_bytes(iter(params), device)
    total += _tensor_bytes((p.grad for p in params), device)
    if optimizer is not None:
        state = (v for s in optimizer.state.values() for v in s.values())
        total += _tensor_bytes(state, device)
    return total


class StepRunner(Runner):
    """Calls a step function on pre-made device batches; waits for the device only at the
    edges of a timed block."""

    def __init__(
        self,
        backend: Backend,
        step: Callable[[Mapping[str, torch.Tensor]], Any],
        batches: list[Batch],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
    ) -> None:
        super().__init__(backend)
        self.step = step
        self.batches = [{k: v.to(backend.device) for k, v in b.items()} for b in batches]
        self.model = model
        self.optimizer = optimizer
        self.taken = 0

    def _take(self) -> None:
        batch = self.batches[self.taken % len(self.batches)]
        self.taken += 1
        self.step(batch)

    def run(self, steps: int, skip: int) -> float:
        for _ in range(skip):
            self._take()
        self.backend.wait()
        start = time.perf_counter()
        for _ in range(steps):
            self._take()
        self.backend.wait()
        return time.perf_counter() - start

    def resident_bytes(self) -> int:
        return _state_bytes(self.model, self.optimizer, self.backend.device)


def trainer_runner(inputs: PathInputs, model: nn.Module) -> StepRunner:
    """The trainer's step, set up the way train.py sets it up."""
    backend, config, total_steps = inputs.backend, inputs.config, inputs.total_steps
    model = backend.prepare_model(model)
    optimizer = build_optimizer(model, lr=config.peak_lr, weight_decay=config.weight_decay)
    scheduler = build_scheduler(
        optimizer,
        warmup_steps=int(config.warmup_ratio * total_steps),
        total_steps=total_steps,
    )
    step = TrainStep(
        model,
        optimizer,
        scheduler,
        backend,
        max_grad_norm=config.max_grad_norm,
        compile=config.compile_model,
    )
    runner = StepRunner(backend, step, inputs.batches, model, optimizer)
    runner.name = "trainer"
    defaults = optimizer.defaults
    runner.features = [
        f"{backend.precision} autocast" if backend.autocast_dtype is not None else "fp32",
        "fused AdamW"
        if defaults.get("fused")
        else " ".join([k for k in ("capturable", "foreach") if defaults.get(k)] + ["AdamW"]),
        f"{_attention(model)} attention",
    ]
    if step.compiled:
        runner.features.append("torch.compile")
    if config.max_grad_norm > 0:
        runner.features.append(f"grad clip {config.max_grad_norm:g}")
    return runner


def plain_runner(inputs: PathInputs, model: nn.Module) -> StepRunner:
    """The textbook loop (the Hugging Face course's "training loop in native PyTorch")."""
    from transformers import get_scheduler

    backend, config, total_steps = inputs.backend, inputs.config, inputs.total_steps
    model = model.to(backend.device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.peak_lr)
    scheduler = get_scheduler(
        "linear", optimizer, num_warmup_steps=0, num_training_steps=total_steps
    )

    def step(batch: Mapping[str, torch.Tensor]) -> None:
        outputs = model(**model_inputs(batch))
        outputs.loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        backend.sync()  # torch_xla.sync() on XLA, as its textbook loop does; no-op elsewhere

    runner = StepRunner(backend, step, inputs.batches, model, optimizer)
    runner.name = "plain"
    runner.features = ["fp32", "AdamW", f"{_attention(model)} attention", "eager"]
    return runner


class HfTrainerRunner(Runner):
    """transformers.Trainer, timed from each step's start to its end by a callback."""

    name = "hf-trainer"

    def __init__(
        self,
        backend: Backend,
        model: nn.Module,
        config: TrainConfig,
        batches: list[Batch],
        workdir: Path,
    ) -> None:
        super().__init__(backend)
        from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

        examples = [
            {k: v[i] for k, v in model_inputs(batch).items()}
            for batch in batches
            for i in range(len(next(iter(batch.values()))))
        ]
        bf16 = backend.autocast_dtype == torch.bfloat16
        # Its best settings on a GPU: bf16, fused AdamW (the default optim), SDPA attention
        # (the model's), and torch.compile where the trainer compiles too.
        compile_ = backend.kind == "cuda" and config.compile != "off"
        args = TrainingArguments(
            output_dir=str(workdir),
            per_device_train_batch_size=config.batch_size,
            learning_rate=config.peak_lr,
            weight_decay=config.weight_decay,
            max_grad_norm=config.max_grad_norm,
            max_steps=1,
            bf16=bf16,
            torch_compile=compile_,
            use_cpu=backend.kind == "cpu",
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_drop_last=True,
            seed=config.seed,
        )
        runner = self
        self._skip = 0
        self._start = self._end = 0.0

        class _Timer(TrainerCallback):
            # Waits for the device before the first timed step and after the last one only.
            def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                if state.global_step == runner._skip:
                    runner.backend.wait()
                    runner._start = time.perf_counter()

            def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
                if state.global_step == state.max_steps:
                    runner.backend.wait()
                    runner._end = time.perf_counter()

        self.trainer = Trainer(
            model=model, args=args, train_dataset=_ListDataset(examples), callbacks=[_Timer()]
        )
        # Its end-of-training summary would go to stdout, in the middle of the report.
        self.trainer.remove_callback(PrinterCallback)
        self.model = model
        self.features = [
            "bf16 autocast" if bf16 else "fp32",
            f"optim={getattr(args.optim, 'value', args.optim)}",
            f"{_attention(model)} attention",
        ]
        if compile_:
            self.features.append("torch.compile")

    def run(self, steps: int, skip: int) -> float:
        # Every train() builds a new optimizer, so its first step (state allocation) is
        # always skipped.
        self._skip = max(skip, 1)
        self._start = self._end = 0.0
        self.trainer.args.max_steps = self._skip + steps
        with _quiet_transformers():
            self.trainer.train()
        return self._end - self._start if steps else 0.0

    def resident_bytes(self) -> int:
        return _state_bytes(self.model, None, self.backend.device)


class _ListDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, items: list[dict[str, torch.Tensor]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.items[index]


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def hf_trainer_unavailable(backend: Backend) -> str | None:
    """Why the Hugging Face Trainer baseline cannot run here, or None if it can."""
    if backend.kind == "xla":
        return "transformers.Trainer's XLA path targets TPUs; Trainium uses optimum-neuron"
    missing = [m for m in ("transformers", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        return f"transformers.Trainer needs {' and '.join(missing)}, not installed here"
    from transformers.utils import is_torch_xla_available

    if is_torch_xla_available():
        return "transformers was imported with torch-xla enabled; set USE_TORCH_XLA=0"
    return None


def _attention(model: nn.Module) -> str:
    config = getattr(Backend.unwrap(model), "config", None)
    return str(getattr(config, "_attn_implementation", None) or "default")


def hf_trainer_runner(inputs: PathInputs, model: nn.Module) -> HfTrainerRunner:
    """The Hugging Face Trainer, with its output in the path's scratch space."""
    return HfTrainerRunner(inputs.backend, model, inputs.config, inputs.batches, inputs.workdir)


def _always_available(backend: Backend) -> str | None:
    return None


@dataclass(frozen=True)
class BenchPath:
    """One path: how its runner is built, and why it cannot run on a backend (None: it can)."""

    build: Callable[[PathInputs, nn.Module], Runner]
    unavailable: Callable[[Backend], str | None] = _always_available


#: The paths by name, in the order they run by default.
PATHS: dict[str, BenchPath] = {
    "trainer": BenchPath(trainer_runner),
    "plain": BenchPath(plain_runner),
    "hf-trainer": BenchPath(hf_trainer_runner, hf_trainer_unavailable),
}
