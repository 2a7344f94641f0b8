"""The training step, evaluation, and the FLOP/MFU arithmetic.

This module is the one place the per-step work is defined: ``train.py`` runs it in its
loop and ``bench.py`` times it, so a benchmark measures exactly the step the trainer runs.

Usage (both scripts)::

    backend = setup_backend("auto")
    model = backend.prepare_model(model)                # DDP on cuda/cpu, plain on xla
    optimizer = build_optimizer(model, lr=5e-5, weight_decay=0.01)
    scheduler = build_scheduler(optimizer, warmup_steps=100, total_steps=10_000)
    step = TrainStep(model, optimizer, scheduler, backend, max_grad_norm=1.0)
    for batch in backend.device_loader(loader):         # dict of device tensors
        loss = step(batch)                              # detached device tensor
    mean_loss = step.pop_mean_loss()                    # one host transfer per log line

A step is: forward (under bf16 autocast where the backend uses it; on XLA with the 4D
attention mask, see ``model_inputs``), backward, gradient all-reduce + clipping + optimizer
step (``Backend.optimizer_step``; capturable AdamW on XLA), scheduler step, and on XLA one
``torch_xla.sync()`` (``graphs_per_step=2`` adds one after the backward). Nothing in it
moves a value to the host, so on XLA the step never waits for the device, and every step
traces the same graph: after the first steps there is nothing new to compile
(tests/test_workload_xla_graphs.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .backend import Backend
from .checkpoint import to_cpu

#: Keys of a batch that are passed to the model; other keys (``weight``: 1 for a real
#: example, 0 for padding in the last evaluation batch) are for the metrics only.
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "labels")

TASKS = ("classification", "causal-lm")


def model_inputs(
    batch: Mapping[str, torch.Tensor], *, static_mask: bool = False, causal: bool = False
) -> dict[str, torch.Tensor]:
    """The subset of ``batch`` that the model's forward takes.

    ``static_mask`` (XLA): pass the attention mask as the 4D additive mask the attention
    adds to its scores, built in the graph. transformers 5 otherwise builds it itself and
    first asks whether the batch has any padding (``padding_mask.all()`` in
    ``masking_utils._ignore_bidirectional_mask_sdpa`` / ``_ignore_causal_mask_sdpa``): a
    device-to-host read in every forward, and another graph for a batch without padding.
    A 4D mask is used as it is (``masking_utils._preprocess_mask_arguments``), so neither
    happens. ``causal``: the model is a decoder; its mask also hides later positions.
    """
    inputs = {k: v for k, v in batch.items() if k in MODEL_INPUTS}
    if static_mask and "attention_mask" in inputs:
        inputs["attention_mask"] = additive_mask(inputs["attention_mask"], causal=causal)
    return inputs


def additive_mask(attention_mask: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """(batch, 1, query, key) float32: 0 where a query may attend a key, the float32
    minimum elsewhere; the mask transformers' eager attention adds (``eager_mask``)."""
    keys = attention_mask.bool()[:, None, None, :]
    if causal:
        length = attention_mask.shape[-1]
        order = torch.arange(length, device=attention_mask.device)
        keys = keys & (order[None, :] <= order[:, None])[None, None]
    zero = torch.zeros((), dtype=torch.float32, device=attention_mask.device)
    low = torch.full((), torch.finfo(torch.float32).min, device=attention_mask.device)
    return torch.where(keys, zero, low)


def is_causal(model: nn.Module) -> bool:
    """Whether ``model`` is a decoder (causal attention): transformers' own registry."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    bare = Backend.unwrap(model)
    config = getattr(bare, "config", None)
    return bool(getattr(config, "is_decoder", False)) or (
        type(bare).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    )


def build_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with no weight decay on biases and LayerNorm weights (the BERT recipe).

    Build it after the model is on its device: that picks the kernel (fused on CPU and
    CUDA, foreach under XLA).
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "LayerNorm" in name or "ln_" in name else decay).append(
            param
        )
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # The fused kernel is the fastest AdamW on CUDA and on the CPU (a sixth of foreach's
    # optimizer time for BERT-base on one CPU core). XLA traces the optimizer into its
    # step graph, capturable: the step count and the bias corrections then stay on the
    # device. Non-capturable AdamW computes ``bias_correction2 ** 0.5`` as a Python float
    # (torch/optim/adam.py), which reaches exactly 1.0 at step 36,314; torch-xla traces
    # 0 and 1 as constants, so that step would compile a new graph. Capturable foreach
    # refuses XLA tensors (``_multi_tensor_adam`` checks ``supports_xla=False``); the
    # single-tensor form accepts them and traces the same arithmetic.
    fused = {p.device.type for p in decay + no_decay} <= {"cpu", "cuda"}
    kernel: dict[str, Any] = (
        {"fused": True, "foreach": None, "capturable": False}
        if fused
        else {"fused": None, "foreach": False, "capturable": True}
    )
    optimizer = torch.optim.AdamW(groups, lr=lr, **kernel)

    # The kernel belongs to this process's device, not to the checkpoint a resume loads
    # (state saved by a CUDA run must not switch a Trainium run to the fused kernel).
    def keep_kernel(opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            group.update(kernel)
            if not (kernel["capturable"] or kernel["fused"]):
                continue
            for param in group["params"]:  # such kernels keep the step count on the device
                state = opt.state.get(param, {})
                step = state.get("step")
                if isinstance(step, torch.Tensor) and step.device != param.device:
                    state["step"] = step.to(device=param.device, dtype=torch.float32)

    # A resumed step must trace the steady-state step's graph (precompile makes no other).
    optimizer.register_load_state_dict_pre_hook(state_as_device_data)
    optimizer.register_load_state_dict_post_hook(keep_kernel)
    optimizer.register_load_state_dict_post_hook(parameters_as_after_a_step)
    return optimizer


def state_as_device_data(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> dict[str, Any] | None:
    """A loaded optimizer state with its CPU tensors already on the XLA device, each its
    own device data, sent in one transfer (``xm.send_cpu_data_to_device``); None (load
    as it is) off XLA.

    ``load_state_dict`` would move them one by one with ``.to(device)``, and torch-xla
    uploads a 0-dim CPU tensor through a cache keyed by its value
    (``XLATensor::GetIrValueForTensor``): the per-parameter AdamW step counts, all equal
    after a resume, would become one graph input where the steady-state step has one per
    parameter (each an output of the step before), and the first step after a resume a
    graph of its own. Each float tensor is cast on the host to its parameter's dtype (the
    step counts to float32, as capturable AdamW keeps them), so no cast enters the graph.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params or params[0].device.type != "xla":
        return None
    import torch_xla.core.xla_model as xm

    saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    param_of = dict(zip(saved_ids, params, strict=False))
    state = {pid: dict(entry) for pid, entry in state_dict["state"].items()}
    places: list[tuple[Any, str]] = []
    tensors: list[torch.Tensor] = []
    for pid, entry in state.items():
        param = param_of.get(pid)
        for key, value in entry.items():
            if param is None or not isinstance(value, torch.Tensor) or value.device.type != "cpu":
                continue
            if key == "step":
                tensors.append(value.to(torch.float32))
            elif value.is_floating_point() and param.is_floating_point():
                tensors.append(value.to(param.dtype))
            else:
                tensors.append(value)
            places.append((pid, key))
    if not tensors:
        return None
    moved: list[torch.Tensor] = xm.send_cpu_data_to_device(tensors, params[0].device)  # type: ignore[assignment]
    for (pid, key), tensor in zip(places, moved, strict=True):
        state[pid][key] = tensor
    return {**state_dict, "state": state}


def parameters_as_after_a_step(optimizer: torch.optim.Optimizer) -> None:
    """Leave every XLA parameter as an optimizer step leaves it: updated in place.

    torch-xla runs on functionalization: an in-place update is recorded on the
    parameter's storage and applied when the parameter is next read, not at the sync.
    In steady state the forward pass therefore takes its views (each ``nn.Linear``'s
    ``weight.t()``) from parameters the last step updated, and the backward pass
    regenerates them from the storage: the step's HLO holds each such transpose twice.
    A parameter just loaded has nothing pending, so the first step after a resume would
    trace each transpose once: another HLO for the compiler, though torch-xla's graph
    hash (and so its compile counters) cannot tell the two apart. A copy of each
    parameter onto itself records an update and computes nothing (the next step's HLO is
    the steady one's, tests/test_workload_xla_resume.py)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params or params[0].device.type != "xla":
        return
    with torch.no_grad():
        for param in params:
            param.copy_(param)


def lr_factor(step: int, warmup_steps: int, total_steps: int) -> float:
    """Linear warm-up then linear decay, never exactly 0 on a step that trains.

    ``step`` counts finished optimizer steps. The first step uses ``1/(warmup+1)`` and
    the last ``1/(total-warmup)`` rather than 0: under XLA a scalar of exactly 0 or 1 is
    traced as a constant, so an lr of 0 would compile a graph of its own.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    remaining = total_steps - step
    return max(remaining, 1) / max(total_steps - warmup_steps, 1)


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule of ``lr_factor``; its state (the step count) goes into checkpoints."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps)
    )


#: Graphs per step under XLA: 1 cuts one graph after the optimizer step; 2 also cuts
#: after forward + backward (the gradient all-reduce then cannot overlap the backward).
GRAPHS_PER_STEP = (1, 2)


class TrainStep:
    """One optimizer step of data-parallel training; call it with a batch on the device.

    Returns the (detached) loss as a device tensor and adds the mean over ranks to an
    on-device running sum (under XLA inside the step graph, elsewhere when read), read
    with ``pop_mean_loss`` when a log line is due; nothing else leaves the device.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None,
        backend: Backend,
        *,
        max_grad_norm: float = 1.0,
        compile: bool | None = None,
        graphs_per_step: int = 1,
    ) -> None:
        """``compile``: run the forward through ``torch.compile`` (None = on for cuda only;
        never under xla, which compiles the whole step already). ``graphs_per_step``: see
        ``GRAPHS_PER_STEP`` (xla only)."""
        if graphs_per_step not in GRAPHS_PER_STEP:
            raise ValueError(f"graphs_per_step {graphs_per_step} is not one of {GRAPHS_PER_STEP}")
        self.graphs_per_step = graphs_per_step
        self.static_mask = backend.kind == "xla"
        self.causal = is_causal(model)
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.backend = backend
        self.max_grad_norm = max_grad_norm
        self._parameters = [p for p in model.parameters() if p.requires_grad]
        wanted = backend.kind == "cuda" if compile is None else compile
        self.compiled = bool(wanted) and backend.kind != "xla"
        self._forward: Callable[..., Any] = torch.compile(model) if self.compiled else model
        self._loss_sum = self._zero()
        self._loss_count = 0
        self.last_lr = float(optimizer.param_groups[0]["lr"])

    def _zero(self) -> torch.Tensor:
        # Made on the host and copied over, so the running sum is always device *data*
        # (never a traced constant) and every step traces the same graph.
        return torch.zeros((), dtype=torch.float32).to(self.backend.device)

    def __call__(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        self.model.train()
        inputs = model_inputs(batch, static_mask=self.static_mask, causal=self.causal)
        with self.backend.autocast():
            outputs = self._forward(**inputs)
        loss = outputs.loss
        loss.backward()
        loss = loss.detach().float()
        if self.backend.kind == "xla" and self.backend.world_size > 1:
            # In the graph; elsewhere once per log line (``pop_mean_loss``).
            loss = self.backend.all_reduce_sum(loss) / self.backend.world_size
        self._loss_sum = self._loss_sum + loss
        self._loss_count += 1
        del inputs, outputs  # not graph outputs: a tensor alive at a sync is materialized
        if self.graphs_per_step == 2:
            self.backend.sync()  # graph 1 of 2: forward + backward
        self.backend.optimizer_step(self.optimizer, self._parameters, self.max_grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        self.last_lr = float(self.optimizer.param_groups[0]["lr"])
        if self.scheduler is not None:
            self.scheduler.step()
        self.backend.sync()  # the step's (last) graph: all-reduce + optimizer update
        return loss

    def pop_mean_loss(self) -> float:
        """Mean loss over all ranks and the steps since the last call (one host transfer;
        every rank must call it, at the same steps)."""
        if self._loss_count == 0:
            return math.nan
        total = self._loss_sum
        if self.backend.kind != "xla" and self.backend.world_size > 1:
            total = self.backend.all_reduce_sum(total.clone()) / self.backend.world_size
        value = float(total.item()) / self._loss_count
        self._loss_sum = self._zero()
        self._loss_count = 0
        return value


@dataclass(frozen=True)
class EvalResult:
    """Exact metrics over every example of the split, summed over all ranks."""

    loss: float
    accuracy: float
    #: Examples (classification) or predicted tokens (causal-lm) counted.
    count: int


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    backend: Backend,
    task: str,
) -> EvalResult:
    """Loss and accuracy over all batches of every rank.

    Every batch has the same shape; the padding rows of the last one carry ``weight`` 0,
    so they count for nothing and no example is lost or counted twice. Sums stay on the
    device until one all-reduce and one host transfer at the end.

    classification: mean cross-entropy and accuracy over examples.
    causal-lm: mean next-token cross-entropy and next-token accuracy over real tokens.
    """
    model.eval()
    # The loss sum in fp32; the counts as int32, exact at any size (an fp32 count stops
    # being exact above 2**24, a bf16 one above 256).
    loss_sum = torch.zeros((), dtype=torch.float32).to(backend.device)
    counts = torch.zeros(2, dtype=torch.int32).to(backend.device)
    static, causal = backend.kind == "xla", is_causal(model)
    for batch in batches:
        with backend.autocast():
            inputs = model_inputs(batch, static_mask=static, causal=causal)
            inputs.pop("labels", None)
            logits = model(**inputs).logits
        logits = logits.float()
        weight = batch["weight"].float()
        if task == "classification":
            labels = batch["labels"]
            losses = F.cross_entropy(logits, labels, reduction="none")
            correct = logits.argmax(dim=-1) == labels
            mask = weight
        else:
            labels = batch["labels"][:, 1:]
            logits = logits[:, :-1]
            valid = labels != -100
            safe = labels.clamp(min=0)
            losses = F.cross_entropy(logits.transpose(1, 2), safe, reduction="none")
            correct = logits.argmax(dim=-1) == safe
            mask = valid.float() * weight[:, None]
        real = mask > 0
        loss_sum = loss_sum + (losses * mask).sum()
        counts = counts + torch.stack(
            [(correct & real).sum(dtype=torch.int32), real.sum(dtype=torch.int32)]
        )
        backend.sync()
    # One graph and one transfer for both.
    reduced = [backend.all_reduce_sum(loss_sum), backend.all_reduce_sum(counts)]
    loss_cpu, counts_cpu = to_cpu(reduced)
    loss_total = float(loss_cpu)
    correct_total, count = (int(v) for v in counts_cpu.tolist())
    model.train()
    if count == 0:
        return EvalResult(loss=math.nan, accuracy=math.nan, count=0)
    return EvalResult(loss=loss_total / count, accuracy=correct_total / count, count=count)


# -- FLOPs and MFU ---------------------------------------------------------------------------

#: Dense bf16 peak per device in TFLOP/s: per NeuronCore on Trainium, per GPU otherwise.
#: (Kept in step with stacks/instance_types.py, which the nodes do not ship.)
PEAK_TFLOPS_BF16 = {
    "trn1": 95.0,  # NeuronCore-v2; 190 per Trainium chip
    "trn2": 166.75,  # logical NeuronCore (LNC=2): 667 per Trainium2 chip / 4
    "h100": 989.0,  # SXM, dense (not the 2:4 sparsity figure)
    "h200": 989.0,
    "a100": 312.0,
}


def _matmul_parameters(model: nn.Module) -> int:
    """Weights that take part in a matmul per token (Linear / GPT-2 Conv1D), embeddings
    excluded; a tied LM head counts because it is a matmul over the vocabulary."""
    total = 0
    seen: set[int] = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        is_matmul = isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
        if is_matmul and isinstance(weight, torch.Tensor) and weight.ndim == 2:
            key = id(module)
            if key not in seen:
                seen.add(key)
                total += weight.numel()
    return total


def flops_per_sample(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs (forward + backward) for one sequence of ``seq_len`` tokens.

    6 FLOPs per matmul weight per token (2 forward, 4 backward), plus attention scores and
    weighted values: 12 * layers * hidden * seq_len^2 (the PaLM paper's accounting).
    Padding tokens count: the device computes them.
    """
    model = Backend.unwrap(model)
    config = getattr(model, "config", None)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    dense = 6.0 * _matmul_parameters(model) * seq_len
    attention = 12.0 * layers * hidden * seq_len * seq_len
    return dense + attention


def device_name(backend: Backend) -> str | None:
    """A key of ``PEAK_TFLOPS_BF16`` for this device, or None where it is not known."""
    if backend.kind == "cuda":
        name = torch.cuda.get_device_name(backend.device).lower()
        for key in ("h200", "h100", "a100"):
            if key in name:
                return key
        return None
    if backend.kind == "xla" and backend.xla_device_type == "NEURON":
        instance = _instance_type()
        for key in ("trn2", "trn1"):
            if instance.startswith(key):
                return key
        return "trn1"
    return None


def _instance_type() -> str:
    value = os.environ.get("INSTANCE_TYPE", "")
    if not value:
        # On Nitro instances DMI reports the EC2 instance type.
        dmi = Path("/sys/devices/virtual/dmi/id/product_name")
        try:
            value = dmi.read_text(encoding="utf-8").strip()
        except OSError:
            value = ""
    return value.lower()


def peak_flops_per_device(backend: Backend, override_tflops: float | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of one device, or None (CPU, unknown GPU): then MFU is null."""
    if override_tflops:
        return override_tflops * 1e12
    name = device_name(backend)
    return PEAK_TFLOPS_BF16[name] * 1e12 if name else None


def mfu(
    samples_per_second: float,
    flops_per_sample_: float,
    world_size: int,
    peak_flops: float | None,
) -> float | None:
    """Model FLOPs utilization: achieved model FLOP/s over the job's peak FLOP/s."""
    if not peak_flops or samples_per_second <= 0:
        return None
    return samples_per_second * flops_per_sample_ / (world_size * peak_flops)
